"""A job's reservations released at its end (dispatch_svc/admission/releases.py): a release the
inventory does not answer is sent again in the background until it lands, or until the lease made
it moot; a reservation made anew for the job supersedes it. Against a real inventory server that
stops before a job ends and starts again on the same data and port, and against a fake port."""

from __future__ import annotations

import threading
import time

import pytest

from accelmesh import errors
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.security.identity import Role
from dispatch_svc.admission.releases import RetriedReleases
from dispatch_svc.config import DispatchConfig
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.server import inventory_port
from inventory_svc.config import InventoryConfig
from inventory_svc.server import build_inventory

from conftest import CREDENTIALS, mesh_stub
from fakes.ports import AFFINE, WAIT_S, FakeCompiler, FakeInventory, FakeWorkers, Feed, X, spec_for

# The inventory it starts polls a worker describing the fixture CPU.
pytestmark = pytest.mark.fixture_cpu

TTL_S = 3600  # far longer than the test: the lease running out cannot be what frees them


def start_inventory(tmp_path, port: int = 0):
    config = InventoryConfig(listen=f"127.0.0.1:{port}", db=str(tmp_path / "inventory.db"))
    server, _ = build_inventory(config, start_poller=False)
    return server.start()


def reserved_jobs(address: str) -> set[str]:
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, address)
    return {r.job_id for r in stub.ListReservations(inv_pb.ListReservationsRequest()).reservations}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        threading.Event().wait(0.05)


def test_an_inventory_restart_before_a_job_ends_does_not_leak_its_reservations_until_they_expire(tmp_path, worker):
    """The inventory stops while the job's shards run and is started again, on the same data and
    port, after the job ended: the release the job's end could not send is sent again, and the
    inventory holds nothing of the job long before its hour-long lease would end."""
    inventory = start_inventory(tmp_path)
    address = f"127.0.0.1:{inventory.port}"
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, address)
    stub.RegisterNode(inv_pb.RegisterNodeRequest(address=f"127.0.0.1:{worker.port}"))
    # The port the dispatcher's runner is built with (dispatch_svc/server.py).
    port = inventory_port(DispatchConfig(inventory=address, reservation_ttl_s=TTL_S),
                          CREDENTIALS.service(Role.DISPATCH), {"max_message_bytes": 4 << 20})
    workers = FakeWorkers(AFFINE)
    workers.hold = True  # the shards run until the test lets them go
    runner = JobRunner(port, FakeCompiler(AFFINE), workers, JobBook(tmp_path / "dispatch", retention_s=3600),
                       ThroughputModel(), limits=Limits(1024, 1 << 20, reservation_ttl_s=TTL_S))
    again = None
    try:
        job, live = runner.start(spec_for(AFFINE, [X]))
        runner.run(job, live, Feed([X]))
        assert workers.started.wait(WAIT_S)
        assert reserved_jobs(address) == {job.job_id}

        inventory.stop(0)
        workers.let_go.set()
        done = runner.book.wait_final(job.job_id, WAIT_S)  # its end does not wait for the inventory
        assert done.state == m.SUCCEEDED, done.error
        assert runner.wait_idle(WAIT_S)

        again = start_inventory(tmp_path, inventory.port)
        assert again.port == inventory.port
        wait_until(lambda: job.job_id not in reserved_jobs(address), "the inventory holds nothing of the job")
        assert reserved_jobs(address) == set()
    finally:
        workers.let_go.set()
        runner.wait_idle(WAIT_S)
        runner.book.close()
        port.close()
        if again is not None:
            again.stop(0)
        inventory.stop(0)


class DownInventory(FakeInventory):
    """Answers no release (UNAVAILABLE) until `up` is set; `released` lists those it answered."""

    def __init__(self):
        super().__init__([])
        self.up = threading.Event()
        self.tried = threading.Event()

    def release(self, job_id):
        self.tried.set()
        if not self.up.is_set():
            raise errors.Unavailable("inventory release: UNAVAILABLE: connection refused")
        super().release(job_id)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def down():
    inventory = DownInventory()
    yield inventory
    inventory.up.set()


def test_a_reservation_made_anew_for_the_job_supersedes_its_pending_release(down):
    releases = RetriedReleases(down, ttl_s=TTL_S)
    try:
        releases.release("job-1")  # does not raise: it is pending
        assert releases.pending() == {"job-1"}
        releases.reserve("job-1", [("10.0.0.1/cuda:0", 1024)], TTL_S)  # a replica took the job over
        assert releases.pending() == frozenset()
        down.up.set()
        assert "job-1" in down.reserved and down.released == []
    finally:
        releases.close()


def test_a_pending_release_is_dropped_once_the_lease_has_run_out_by_itself(down):
    clock = Clock()
    releases = RetriedReleases(down, ttl_s=10, clock=clock)
    try:
        releases.release("job-1")
        down.tried.clear()
        clock.now += 10  # past the lease: the inventory ended the reservations itself
        wait_until(lambda: not releases.pending(), "the release is given up")
        assert not down.tried.is_set() and down.released == []
    finally:
        releases.close()
