"""Replicas of every control-plane service on one PostgreSQL and one shared data dir (MISSION
scale-out): two inventories, two compile services, two dispatchers and two workers, every
process real. Each loss is repeated five times:

- SIGKILL the dispatch replica running a job: the other takes it over (its lease lapses), keeps
  the shards finished, and the job's result equals a fault-free run's, with no reservation left;
- SIGKILL an inventory replica: the nodes it polled are polled by the other within two intervals
  of its last poll (ACCELMESH_POLL_INTERVAL_S; the bound inventory_svc/inventory.py keeps).

Dispatchers and workers name both replicas of each service (`ipv4:a:p,b:p`): gRPC spreads calls
round robin and retries the idempotent ones on the other replica when one is gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from _fault_helpers import EMULATE, NODE_IPS, TOKENS, node_certificate
from conftest import CREDENTIALS, _postgres_server

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_compile, start_dispatch, start_inventory, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel

pytestmark = pytest.mark.slow

REPEATS = 5
POLL_INTERVAL_S = 0.5
LEASE_S = 2.0  # the dispatchers' job leases: a killed one's job moves on within 1.25 of them
JOB_ROWS = 1024  # 32 shards of 32 token rows
DISPATCH_ENV = {"ACCELMESH_MAX_SHARD_BYTES": str(4096), "ACCELMESH_DISPATCH_LEASE_S": str(LEASE_S)}
# The bounds themselves (two poll intervals; 1.25 leases) are proven on a test clock in
# tests/inventory/test_poll_leases.py and tests/dispatch/test_takeover.py. Here real processes
# share a loaded machine: a poll is recorded when its answers are, a moment after it began, and
# a process may wait for a core. bench/ha.py reports the times measured.
SCHEDULING_SLACK_S = 1.0


def both(processes) -> str:
    return "ipv4:" + ",".join(p.address for p in processes)


class Replicas:
    def __init__(self, data_dir: Path, inventory_db: str, dispatch_db: str):
        self.data_dir, self.inventory_db, self.dispatch_db = data_dir, inventory_db, dispatch_db
        self.inventories = [self.start_inventory(i) for i in range(2)]
        self.compiles = [self.start_compile(i) for i in range(2)]
        self.workers = [start_worker(both(self.inventories), both(self.compiles), CREDENTIALS, devices=len(EMULATE),
                                     emulate=EMULATE, listen=f"{ip}:0", artifact_dir=data_dir / f"artifacts-{ip}",
                                     name=f"worker-{ip}", env=node_certificate(ip)) for ip in NODE_IPS]
        self.dispatchers = [self.start_dispatch(i) for i in range(2)]

    # A replica killed is started again on its address: the others name the replicas by address.
    def start_inventory(self, index: int, listen: str = "127.0.0.1:0"):
        return start_inventory(self.data_dir, CREDENTIALS, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=3,
                               db=self.inventory_db, name=f"inventory-{index}", listen=listen)

    def start_compile(self, index: int, listen: str = "127.0.0.1:0"):
        return start_compile(self.data_dir, CREDENTIALS, name=f"compile-{index}", listen=listen)

    def start_dispatch(self, index: int, listen: str = "127.0.0.1:0"):
        return start_dispatch(self.data_dir, both(self.inventories), both(self.compiles), CREDENTIALS,
                              env={**DISPATCH_ENV, "ACCELMESH_DISPATCH_DB": self.dispatch_db}, name=f"dispatch-{index}",
                              listen=listen)

    def stop(self):
        for process in [*self.dispatchers, *self.workers, *self.compiles, *self.inventories]:
            process.terminate()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    server = _postgres_server()
    mesh = Replicas(tmp_path_factory.mktemp("replicas"), server.database(), server.database())
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def fault_free(replicas):
    """The job's logits from a run that lost nothing."""
    with MeshClient(replicas.dispatchers[0].address) as client:
        return client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}).outputs["logits"]


def reservations_of(replicas, job_id: str) -> list:
    with open_channel(replicas.inventories[0].address) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        return list(stub.ListReservations(inv_pb.ListReservationsRequest(job_id=job_id)).reservations)


def await_finished(client: MeshClient, job_id: str, count: int) -> None:
    for event in client.watch(job_id):
        count -= event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED
        if count <= 0:
            return
    raise AssertionError(f"job {job_id} ended before {count} more shards finished")


def test_a_job_outlives_the_dispatch_replica_running_it(replicas, fault_free):
    takeovers = []
    for repeat in range(REPEATS):
        owner, other = repeat % 2, 1 - repeat % 2
        with MeshClient(replicas.dispatchers[owner].address) as client:
            job_id = client.submit("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
            await_finished(client, job_id, 4)
        killed_at = time.time()
        replicas.dispatchers[owner].kill()
        with MeshClient(replicas.dispatchers[other].address) as client:
            events = list(client.watch(job_id))  # through the other replica, to the job's end
            job = client.get(job_id)
            assert job.state == job_pb.JOB_STATE_SUCCEEDED, job.error
            taken = next(e for e in events if e.type == job_pb.JOB_EVENT_TYPE_TAKEN_OVER)
            assert "shards were finished and are kept" in taken.message
            kept = int(taken.message.split(" of ")[0].rsplit(" ", 1)[1])
            assert kept >= 4
            np.testing.assert_array_equal(client.fetch_result(job_id)["logits"], fault_free)
        assert reservations_of(replicas, job_id) == []
        takeovers.append(taken.time.seconds + taken.time.nanos / 1e9 - killed_at)
        replicas.dispatchers[owner] = replicas.start_dispatch(owner, replicas.dispatchers[owner].address)
    # The lease lapses LEASE_S after its last renewal, and the other replica looks every quarter lease.
    assert max(takeovers) <= 1.25 * LEASE_S + SCHEDULING_SLACK_S, takeovers


def node_polls(db: str) -> dict[str, tuple[str, float]]:
    engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT address, poller, last_seen_at FROM nodes")).all()
    finally:
        engine.dispose()
    return {address: (poller, seen) for address, poller, seen in rows}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # polling the database: the test's own reads, not synchronisation
    raise AssertionError(f"timed out waiting for {what}")


def test_the_nodes_of_a_killed_inventory_replica_are_polled_by_the_other(replicas):
    gaps = []
    for repeat in range(REPEATS):
        victim = repeat % 2
        # Both replicas poll (one node each: the fair share of two nodes between two replicas).
        wait_for(lambda: len({poller for poller, _ in node_polls(replicas.inventory_db).values()}) == 2,
                 10 * POLL_INTERVAL_S, "both inventory replicas to poll a node each")
        replicas.inventories[victim].kill()
        killed_at = time.time()
        polls = node_polls(replicas.inventory_db)  # the dead replica's last poll of its node is in it
        after = wait_for(lambda: (p := node_polls(replicas.inventory_db)) and len({v[0] for v in p.values()}) == 1
                         and all(seen > killed_at for _, seen in p.values()) and p,
                         10 * POLL_INTERVAL_S, "one replica to poll both nodes")
        survivor = next(iter(after.values()))[0]
        orphan = next(address for address, (poller, _) in polls.items() if poller != survivor)
        # From the dead replica's last poll of its node to the survivor's first, as the book records them.
        gaps.append(after[orphan][1] - polls[orphan][1])
        replicas.inventories[victim] = replicas.start_inventory(victim, replicas.inventories[victim].address)
    assert max(gaps) <= 2 * POLL_INTERVAL_S + SCHEDULING_SLACK_S, gaps
