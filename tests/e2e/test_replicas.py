"""Replicas of every control-plane service on one PostgreSQL and one shared data dir (requirements
D2; the mesh is tests/replicas.py). Each loss is repeated five times:

- SIGKILL the dispatch replica running a job: the other takes it over (its lease lapses), keeps
  the shards finished, and the job's result equals a fault-free run's, with no reservation left;
- SIGKILL an inventory replica: the nodes it polled are polled by the other within two intervals
  of its last poll (ACCELMESH_POLL_INTERVAL_S; the bound inventory_svc/inventory.py keeps);
- SIGKILL the compile replica building a job's artifact: the dispatcher's call goes to the other,
  which builds it, and the job's result equals a fault-free run's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _fault_helpers import TOKENS, await_shards_running

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb

from conftest import CREDENTIALS, _postgres_server
from replicas import LEASE_S, POLL_INTERVAL_S, Replicas, seconds

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

REPEATS = 5
JOB_ROWS = 1024  # 32 shards of 32 token rows
# The bounds themselves (two poll intervals; 1.25 leases) are proven on a test clock in
# tests/inventory/test_poll_leases.py and tests/dispatch/execution/test_takeover.py. Here real processes
# share a loaded machine: a poll is recorded when its answers are, a moment after it began, and
# a process may wait for a core. bench/ha.py reports the times measured.
SCHEDULING_SLACK_S = 1.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    server = _postgres_server()
    mesh = Replicas(tmp_path_factory.mktemp("replicas"), CREDENTIALS, server.database(), server.database())
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def fault_free(replicas):
    """The job's logits from a run that lost nothing."""
    with MeshClient(replicas.dispatchers[0].address) as client:
        return client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}).outputs["logits"]


def test_a_job_outlives_the_dispatch_replica_running_it(replicas, fault_free):
    takeovers = []
    for repeat in range(REPEATS):
        owner, other = repeat % 2, 1 - repeat % 2
        with MeshClient(replicas.dispatchers[owner].address) as client:
            job_id = client.submit("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
            await_shards_running(client, job_id, finished=4)
        killed_at = time.time()
        replicas.dispatchers[owner].kill()
        with MeshClient(replicas.dispatchers[other].address) as client:
            events = list(client.watch(job_id))  # through the other replica, to the job's end
            job = client.get(job_id)
            assert job.state == job_pb.JOB_STATE_SUCCEEDED, job.error
            taken = next(e for e in events if e.type == job_pb.JOB_EVENT_TYPE_TAKEN_OVER)
            assert "shards were finished and are kept" in taken.message
            assert int(taken.message.split(" of ")[0].rsplit(" ", 1)[1]) >= 4
            np.testing.assert_array_equal(client.fetch_result(job_id)["logits"], fault_free)
        assert replicas.reservations_of(job_id) == []
        takeovers.append(seconds(taken.time) - killed_at)
        replicas.restart("dispatchers", owner)
    # The lease lapses LEASE_S after its last renewal, and the other replica looks every quarter lease.
    assert max(takeovers) <= 1.25 * LEASE_S + SCHEDULING_SLACK_S, takeovers


def test_the_nodes_of_a_killed_inventory_replica_are_polled_by_the_other(replicas):
    gaps = []
    for repeat in range(REPEATS):
        gaps.append(replicas.kill_an_inventory(repeat % 2))
        replicas.restart("inventories", repeat % 2)
    assert max(gaps) <= 2 * POLL_INTERVAL_S + SCHEDULING_SLACK_S, gaps


def test_a_compile_replica_killed_mid_build_leaves_the_job_its_artifact(replicas, fault_free):
    for repeat in range(REPEATS):
        replicas.clear_artifacts()  # built afresh: there is a build to interrupt
        with ThreadPoolExecutor(1) as pool, MeshClient(replicas.dispatchers[repeat % 2].address) as client:
            running = pool.submit(client.run, "transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
            victim = replicas.kill_the_builder()
            job = running.result(timeout=120)
        assert job.job.state == job_pb.JOB_STATE_SUCCEEDED, job.job.error
        np.testing.assert_array_equal(job.outputs["logits"], fault_free)
        replicas.restart("compiles", victim)
