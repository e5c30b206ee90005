"""A job's reservations are a lease its dispatcher renews while the job runs, through a real mesh:
an inventory, a compile service and a worker as processes, the dispatcher in this process so that
its lease can be short and its lease keeper watched. A job that outlives several leases keeps its
reservations all along and releases them at its end; a job whose reservations someone releases
while it runs stops, FAILED with an error saying its reservations lapsed and why, sends no more
shards and leaves nothing reserved.

The jobs are long because their client makes them so, not because of the machine's speed: it
sends the first rows, then waits for the test before it sends the rest.

Last, the lease keeper alone against an inventory that does not answer (a scripted stand-in for
the Mesh port, as tests/dispatch/tests/fakes/ports.py is for jobs): a short outage is retried through,
one as long as the lease stops the job, never before the lease ran out."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.client import MeshClient, job_spec
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_compile, start_inventory, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.tensors import TensorCollector, to_proto
from compile_svc.programs.builtin import IDENTITY_WIDTH
from dispatch_svc.admission.reservations import LeaseKeeper
from dispatch_svc.config import DispatchConfig
from dispatch_svc.ports import LiveJob
from dispatch_svc.server import build_dispatch

from conftest import CREDENTIALS, mesh_stub

pytestmark = pytest.mark.slow

LEASE_TTL_S = 2  # renewed every 2/3 s: a job waiting a few seconds outlives several leases
SHARD_ROWS = 4  # identity rows are 4 KiB; 16 KiB shards hold at most 4
ROWS = 4 * SHARD_ROWS
FIRST_ROWS = SHARD_ROWS  # what the client sends before it waits: shard 0's rows at least
WAIT_S = 60.0  # bound of every wait for something the mesh does
POLL_S = 0.05  # between two looks at the inventory's reservations


@dataclasses.dataclass
class Dispatcher:
    address: str
    runner: object  # dispatch_svc.execution.runner.JobRunner
    inventory: object  # an InventoryService stub whose calls carry a role that may make them


@pytest.fixture(scope="module")
def dispatcher(tmp_path_factory):
    root = tmp_path_factory.mktemp("leases")
    processes = [start_inventory(root, CREDENTIALS)]
    try:
        inventory = processes[0].address
        processes.append(compile_ := start_compile(root, CREDENTIALS))
        processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=1, emulate=("v100-32gb",),
                                      nvml=False, artifact_dir=root / "worker-artifacts"))
        server, runner = build_dispatch(DispatchConfig(
            listen="127.0.0.1:0", inventory=inventory, compile=compile_.address, data_dir=str(root / "dispatch"),
            max_shard_bytes=SHARD_ROWS * IDENTITY_WIDTH * 4, reservation_ttl_s=LEASE_TTL_S))  # a short lease
        server.start()
        try:
            yield Dispatcher(f"127.0.0.1:{server.port}", runner,
                             mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory))
        finally:
            server.stop(0)
    finally:
        for process in reversed(processes):
            process.terminate()


class PacedJob:
    """An identity job through RunJob whose client sends FIRST_ROWS rows, then the rest once `go`
    is set: until then the job runs, its devices reserved, with its first shards done."""

    def __init__(self, address: str, name: str, x: np.ndarray):
        self.go = threading.Event()
        self.events: list[job_pb.JobEvent] = []
        self.results, self.job = TensorCollector("result"), None
        self._client = MeshClient(address)
        spec = job_spec("identity", {"x": x}, name=name)

        def requests():
            yield pb.RunJobRequest(spec=spec)
            yield pb.RunJobRequest(block=pb.InputBlock(first_row=0, tensors=[to_proto(x[:FIRST_ROWS])]))
            self.go.wait(WAIT_S)
            yield pb.RunJobRequest(block=pb.InputBlock(first_row=FIRST_ROWS, tensors=[to_proto(x[FIRST_ROWS:])]))

        self._responses = self._client.stub.RunJob(requests(), timeout=4 * WAIT_S)
        self.job_id = ""

    def read_until(self, event_type: int, count: int = 1) -> job_pb.JobEvent:
        """Read the stream until the `count`-th event of `event_type` came; return it."""
        for response in self._responses:
            self._take(response)
            is_one = response.WhichOneof("part") == "event" and response.event.type == event_type
            if is_one and sum(e.type == event_type for e in self.events) == count:
                return response.event
        raise AssertionError(f"RunJob ended before {count} {job_pb.JobEventType.Name(event_type)} events")

    def finish(self) -> grpc.RpcError | None:
        """Send the rest of the rows and read the stream to its end; the status when it failed."""
        self.go.set()
        try:
            for response in self._responses:
                self._take(response)
        except grpc.RpcError as exc:
            return exc
        return None

    def close(self) -> None:
        self.go.set()
        self._responses.cancel()
        self._client.close()

    def find_id(self, name: str) -> str:
        jobs = self._client.stub.ListJobs(pb.ListJobsRequest()).jobs
        self.job_id = next(j.job_id for j in jobs if j.spec.name == name)
        return self.job_id

    def _take(self, response) -> None:
        part = response.WhichOneof("part")
        if part == "event":
            self.events.append(response.event)
        elif part == "tensor":
            self.results.header(response.tensor)
        elif part == "chunk":
            self.results.chunk(response.chunk)
        else:
            self.job = response.job


def seconds(stamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def held(dispatcher: Dispatcher, job_id: str = "") -> list:
    return list(dispatcher.inventory.ListReservations(inv_pb.ListReservationsRequest(job_id=job_id)).reservations)


def started_shards(job: PacedJob) -> list[int]:
    return [e.shard.index for e in job.events if e.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED]


@pytest.mark.slow
def test_a_job_that_outlives_several_leases_keeps_its_reservations_and_releases_them_at_its_end(dispatcher):
    x = np.random.default_rng(1).standard_normal((ROWS, IDENTITY_WIDTH)).astype(np.float32)
    job = PacedJob(dispatcher.address, "outlives-its-leases", x)
    try:
        job.read_until(job_pb.JOB_EVENT_TYPE_SHARD_FINISHED)  # running, reserved, shard 0 done
        job_id = job.find_id("outlives-its-leases")
        first = held(dispatcher, job_id)
        devices = [r.device_id for r in first]
        assert devices, "the running job holds no reservation"
        first_end = max(seconds(r.expire_time) for r in first)  # within one lease of the reservation
        # Until a whole lease past the end of the first one, every look finds every reservation live.
        deadline = time.monotonic() + WAIT_S
        while (now := time.time()) <= first_end + LEASE_TTL_S:
            assert time.monotonic() < deadline, "the inventory's clock never passed the first lease's end"
            current = held(dispatcher, job_id)
            lapsed = f"reservations lapsed {now - first_end:.2f} s past the first lease's end"
            assert [r.device_id for r in current] == devices, lapsed
            assert all(seconds(r.expire_time) > now for r in current)
            time.sleep(POLL_S)
        keeper = dispatcher.runner.live(job_id).lease
        assert keeper.renewals >= 2 and keeper.lapse is None
        assert job.finish() is None
    finally:
        job.close()
    assert job.job.state == job_pb.JOB_STATE_SUCCEEDED, job.job.error
    np.testing.assert_array_equal(job.results.results()["y"], x)
    assert held(dispatcher, job_id) == []


@pytest.mark.slow
def test_a_job_whose_reservations_are_released_from_outside_stops_failed_and_says_they_lapsed(dispatcher):
    x = np.random.default_rng(2).standard_normal((ROWS, IDENTITY_WIDTH)).astype(np.float32)
    job = PacedJob(dispatcher.address, "released-from-outside", x)
    try:
        planned = job.read_until(job_pb.JOB_EVENT_TYPE_PLANNED).plan
        # The shards the first rows complete: all of them done before the release, none after.
        before_wait = [s.index for s in planned.shards if s.first_row + s.rows <= FIRST_ROWS]
        assert before_wait and len(planned.shards) > len(before_wait), planned.shards
        job.read_until(job_pb.JOB_EVENT_TYPE_SHARD_FINISHED, count=len(before_wait))
        job_id = job.find_id("released-from-outside")
        keeper = dispatcher.runner.live(job_id).lease
        released = dispatcher.inventory.ReleaseDevices(inv_pb.ReleaseDevicesRequest(job_id=job_id))
        assert released.released_count >= 1
        assert keeper.lapsed.wait(WAIT_S), "the dispatcher never noticed its reservations were gone"
        error = job.finish()  # the rest of the rows arrive: the job takes no more of them
    finally:
        job.close()
    assert error is not None and error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the reservations of job {job_id} lapsed while it ran" in error.details()
    assert "someone released them" in error.details()
    with MeshClient(dispatcher.address) as client:
        ended = client.get(job_id)
    assert ended.state == job_pb.JOB_STATE_FAILED and "lapsed" in ended.error
    assert sorted(set(started_shards(job))) == before_wait
    assert held(dispatcher) == []


class SilentInventory:
    """The Mesh port's renew as an inventory that does not answer its first `outage` calls."""

    def __init__(self, outage: int):
        self.outage, self.calls = outage, 0

    def renew(self, job_id, device_ids, ttl_s, timeout_s):
        self.calls += 1
        if self.calls <= self.outage:
            raise errors.Unavailable("inventory renew: UNAVAILABLE: connection refused")


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(POLL_S)


def test_an_inventory_silent_for_part_of_the_lease_is_asked_again_and_the_job_goes_on():
    live, inventory = LiveJob(), SilentInventory(outage=1)
    # 3 s: the first renewal (at 1 s) fails, the retry comes with a second of the lease still left.
    live.lease = LeaseKeeper(inventory, "job", ["10.0.0.1/cuda:0"], 3, live, reserved_at=time.monotonic())
    try:
        wait_until(lambda: live.lease.renewals >= 1)
        assert live.lease.lapse is None and not live.scope.cancelled.is_set() and inventory.calls >= 2
    finally:
        live.done.set()


def test_an_inventory_silent_for_the_whole_lease_stops_the_job_once_the_lease_ran_out():
    live, inventory = LiveJob(), SilentInventory(outage=10**6)
    reserved_at = time.monotonic()
    live.lease = LeaseKeeper(inventory, "job", ["10.0.0.1/cuda:0"], 1, live, reserved_at=reserved_at)
    try:
        assert live.lease.lapsed.wait(WAIT_S)
        assert time.monotonic() - reserved_at >= 1  # never before the lease ran out
        assert inventory.calls >= 2 and live.scope.cancelled.is_set()
        with pytest.raises(errors.Unavailable, match="did not answer for the whole 1 s lease .*connection refused"):
            live.check()
    finally:
        live.done.set()
