"""The job queue through a real mesh (an inventory, a compile service and a one-device worker as
processes, the dispatcher in this process with a short queue poll): a RunJob that finds the pool
full is told QUEUED with its place and why, waits, and streams its results once the pool has room;
a queued job can be cancelled; two tenants cannot see or touch each other's queued jobs; quotas are
set by operators alone and a priority above one's quota is refused.

The pool is made full by a reservation of the test's own, taken through the inventory as the
dispatcher takes them, and freed by releasing it: what frees the devices is the inventory, so the
queue finds out by its poll, as it does when another replica's job ends."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.runtime.batches import unbatched
from accelmesh.runtime.tensors import TensorCollector
from compile_svc.programs.builtin import IDENTITY_WIDTH

from conftest import CREDENTIALS, rpc_error, small_mesh

pytestmark = pytest.mark.slow

WAIT_S = 60.0
OCCUPIER = "occupier-of-the-test"


@dataclasses.dataclass
class Mesh:
    address: str
    inventory: object  # an InventoryService stub with the dispatch role
    device: str
    people: dict  # name -> client Security


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    people = {name: CREDENTIALS.client(CREDENTIALS.add_user(name)) for name in ("alice", "bob")}
    with small_mesh(tmp_path_factory.mktemp("queue"), queue_poll_s=0.1) as (server, _, inventory):
        device = inventory.ListDevices(inv_pb.ListDevicesRequest()).devices[0]
        yield Mesh(f"127.0.0.1:{server.port}", inventory, device.id, people)


def fill(mesh: Mesh) -> None:
    """Reserve all of the device's free memory."""
    device = mesh.inventory.GetDevice(inv_pb.GetDeviceRequest(device_id=mesh.device)).device
    mesh.inventory.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id=OCCUPIER, ttl_seconds=300, claims=[
        inv_pb.DeviceClaim(device_id=mesh.device, memory_bytes=device.status.memory_free_bytes, compute_fraction=1.0)]))


def free(mesh: Mesh) -> None:
    mesh.inventory.ReleaseDevices(inv_pb.ReleaseDevicesRequest(job_id=OCCUPIER))


class Running:
    """A RunJob call read as far as the test asks."""

    def __init__(self, client: MeshClient, x: np.ndarray, program: str = "identity", **options):
        spec = job_spec(program, {"x": x}, **options)
        requests = (pb.RunJobRequest(**{field: message}, accept_batches=field == "spec")
                    for field, message in request_parts(spec, {"x": x}, None, client.chunk_bytes))
        self.call = client.stub.RunJob(requests, timeout=4 * WAIT_S)
        self._responses = unbatched(self.call)
        self.events: list[job_pb.JobEvent] = []
        self.results, self.job = TensorCollector("result"), None

    def until(self, event_type: int) -> job_pb.JobEvent:
        for response in self._responses:
            self._take(response)
            if response.WhichOneof("part") == "event" and response.event.type == event_type:
                return response.event
        raise AssertionError(f"RunJob ended before a {job_pb.JobEventType.Name(event_type)} event")

    def rest(self) -> None:
        for response in self._responses:
            self._take(response)

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


def rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((8, IDENTITY_WIDTH)).astype(np.float32)


def job_id_of(client: MeshClient, name: str) -> str:
    return next(j.job_id for j in client.stub.ListJobs(pb.ListJobsRequest()).jobs if j.spec.name == name)


def test_a_job_that_finds_the_pool_full_is_queued_and_runs_once_it_frees_up(mesh):
    x = rows(1)
    with MeshClient(mesh.address, security=mesh.people["alice"]) as alice, \
            MeshClient(mesh.address, security=mesh.people["bob"]) as bob:
        fill(mesh)
        try:
            running = Running(alice, x, name="waits")
            queued = running.until(job_pb.JOB_EVENT_TYPE_QUEUED)
            assert queued.queue.position == 1
            assert "devices:" in queued.queue.reason and mesh.device in queued.queue.reason
            job_id = job_id_of(alice, "waits")
            job = alice.get(job_id)
            assert job.state == job_pb.JOB_STATE_QUEUED and job.queue.position == 1
            assert job.queue.reason == queued.queue.reason
            assert job.queue.deadline.seconds > job.queue.enqueue_time.seconds

            # Bob sees nothing of it, and cannot touch it.
            for call in (lambda: bob.get(job_id), lambda: bob.cancel(job_id), lambda: list(bob.watch(job_id))):
                assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
            assert job_id not in [j.job_id for j in bob.stub.ListJobs(pb.ListJobsRequest()).jobs]
            uses = bob.stub.ListQuotas(pb.ListQuotasRequest()).quotas
            assert [u.tenant for u in uses] == ["user:bob"] and uses[0].queued == 0
            assert alice.stub.ListQuotas(pb.ListQuotasRequest()).quotas[0].queued == 1
        finally:
            free(mesh)
        running.rest()
        assert running.job.state == job_pb.JOB_STATE_SUCCEEDED, running.job.error
        np.testing.assert_array_equal(running.results.results()["y"], x)
        types = [e.type for e in running.events]
        assert types.index(job_pb.JOB_EVENT_TYPE_QUEUED) < types.index(job_pb.JOB_EVENT_TYPE_SHARD_FINISHED)
        assert alice.get(job_id).state == job_pb.JOB_STATE_SUCCEEDED


def test_a_queued_job_is_cancelled_by_cancel_job_and_its_call_ends_cancelled(mesh):
    with MeshClient(mesh.address, security=mesh.people["alice"]) as alice:
        fill(mesh)
        try:
            running = Running(alice, rows(2), name="never-runs")
            running.until(job_pb.JOB_EVENT_TYPE_QUEUED)
            job = alice.cancel(job_id_of(alice, "never-runs"))
            assert job.state == job_pb.JOB_STATE_CANCELLED and job.error == "cancelled by CancelJob"
            with pytest.raises(grpc.RpcError) as raised:
                running.rest()
            assert raised.value.code() == grpc.StatusCode.CANCELLED
        finally:
            free(mesh)


def test_a_job_that_may_not_wait_is_refused_at_once(mesh):
    with MeshClient(mesh.address, security=mesh.people["alice"]) as alice:
        fill(mesh)
        try:
            error = rpc_error(lambda: alice.run("identity", {"x": rows(3)}, queue_timeout_s=0.0, timeout=WAIT_S))
        finally:
            free(mesh)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "spec.queue_timeout is 0 s" in error.details()


def test_quotas_are_set_by_operators_and_bound_priorities(mesh):
    with MeshClient(mesh.address) as operator, MeshClient(mesh.address, security=mesh.people["alice"]) as alice:
        quota = pb.Quota(tenant="user:alice", max_priority=2, max_jobs=4)
        denied = rpc_error(alice.stub.SetQuota, pb.SetQuotaRequest(quota=quota))
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
        stored = operator.stub.SetQuota(pb.SetQuotaRequest(quota=quota)).quota
        assert (stored.max_priority, stored.max_jobs, stored.HasField("max_devices")) == (2, 4, False)
        try:
            high = rpc_error(lambda: alice.run("identity", {"x": rows(4)}, priority=5, timeout=WAIT_S))
            assert high.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "spec.priority is 5, but the quota of user:alice allows at most 2" in high.details()
            result = alice.run("identity", {"x": rows(4)}, priority=2, timeout=WAIT_S)
            assert result.job.state == job_pb.JOB_STATE_SUCCEEDED and result.job.spec.priority == 2
            mine = alice.stub.ListQuotas(pb.ListQuotasRequest()).quotas
            assert [(u.tenant, u.quota.max_jobs) for u in mine] == [("user:alice", 4)]
            bad = rpc_error(operator.stub.SetQuota,
                            pb.SetQuotaRequest(quota=pb.Quota(tenant="user:alice", max_jobs=-1)))
            assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "quota.max_jobs is -1" in bad.details()
            out_of_range = rpc_error(lambda: alice.run("identity", {"x": rows(4)}, priority=1001, timeout=WAIT_S))
            assert out_of_range.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.priority" in out_of_range.details()
        finally:
            operator.stub.SetQuota(pb.SetQuotaRequest(quota=pb.Quota(tenant="user:alice"), remove=True))
        assert rpc_error(operator.stub.SetQuota, pb.SetQuotaRequest(
            quota=pb.Quota(tenant="user:alice"), remove=True)).code() == grpc.StatusCode.NOT_FOUND
