"""Jobs ended early on a real mesh: a cancel and a passed client deadline stop the workers
within a shard and release the devices, a client gone after its job finished loses no result,
a submitted job outlives its channel, and a dispatcher killed mid-job restarts with that job
failed and older results kept. The mesh is built in _fault_helpers.py."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from _fault_helpers import (  # noqa: F401  (fixtures)
    DISPATCH_ENV,
    EMULATE,
    JOB_ROWS,
    NODE_IPS,
    TOKENS,
    await_shards_running,
    client_fixture,
    expected_fixture,
    inventory_stub,
    mesh_fixture,
    pool_fixture,
    port_of,
    seconds,
    shards_run,
)

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_dispatch
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb

from conftest import reservations, rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

DEVICES = len(NODE_IPS) * len(EMULATE)
# A cancel drops a job's queued shards at once; a shard already running cannot be interrupted (XLA
# offers no way), so a device may run one shard more. How long a shard runs depends on the
# machine, so the workers must run no shard later than the job's own longest shard (as the workers
# timed it) plus CANCEL_REACH_S, the time for a cancel to reach them (one gRPC cancel, the
# executor's 0.05 s queue poll).
CANCEL_REACH_S = 0.5
# After a job is stopped, how long the workers' shard counts are watched for a shard run past the
# bound: they count every shard they run (their /metrics), so a shard run then shows.
OBSERVE_S = 1.0


def counts_past_the_bound(pool, since: float, stop_s: float) -> tuple[float, float]:
    """The workers' shard count at `since` + `stop_s` (time.monotonic), and OBSERVE_S later."""
    threading.Event().wait(max(0.0, since + stop_s - time.monotonic()))  # to the bound, not for anything
    at_bound = shards_run(pool)
    threading.Event().wait(OBSERVE_S)  # a window to watch, not a wait for anything
    return at_bound, shards_run(pool)


def stop_within_s(job: job_pb.Job) -> float:
    """How soon after a cancel the workers must be idle: see CANCEL_REACH_S."""
    ran = [s.execute_seconds for s in job.shards if s.done]
    assert ran, f"job {job.job_id} finished no shard to time the bound by"
    return CANCEL_REACH_S + max(ran)


# -- cancel and deadline -----------------------------------------------------------------------


def test_cancel_stops_the_workers_within_a_shard_and_releases_the_devices(pool, client):
    before = shards_run(pool)
    job_id = client.submit("transformer_encoder", {"tokens": TOKENS})  # 128 shards, 32 a device
    await_shards_running(client, job_id, finished=8)
    cancelled_at, since = time.time(), time.monotonic()
    job = client.cancel(job_id)
    answered_at = time.time()
    stop_s = stop_within_s(job)
    at_bound, later = counts_past_the_bound(pool, since, stop_s)

    assert job.state == job_pb.JOB_STATE_CANCELLED
    events = list(client.watch(job_id))
    assert events[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert seconds(events[-1].time) - cancelled_at < stop_s and answered_at - cancelled_at < stop_s
    assert at_bound - before >= 8  # what "stopped" is told apart from: its shards ran, and were counted
    assert later == at_bound, f"the workers ran {later - at_bound:g} shard(s) more than {stop_s:.2f} s after the cancel"
    # A device's shard already past its start when the cancel landed is the most that may follow it.
    late = [e for e in events if e.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED and seconds(e.time) > cancelled_at]
    assert len(late) <= DEVICES and all(seconds(e.time) < answered_at for e in late)
    assert sum(e.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED for e in events) < len(job.plan.shards)
    assert reservations(pool) == []


def test_a_passed_client_deadline_cancels_the_job_and_releases_the_devices(pool, client):
    # The deadline is half of what the same job takes warm on this machine, now: it passes while
    # shards run however fast the machine is (a fixed 1.5 s outlasted the whole job on a fast one).
    for _ in range(2):  # the first run builds the job's executables; the second is the warm one timed
        began = time.perf_counter()
        assert client.run("transformer_encoder", {"tokens": TOKENS}).job.state == job_pb.JOB_STATE_SUCCEEDED
    whole_s = time.perf_counter() - began
    streamed = []
    error = rpc_error(client.run, "transformer_encoder", {"tokens": TOKENS}, name="deadline", timeout=whole_s / 2,
                      on_event=streamed.append)
    failed_at, since = time.time(), time.monotonic()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert job_pb.JOB_EVENT_TYPE_SHARD_FINISHED in [e.type for e in streamed], \
        "the deadline should pass while shards run"
    job = client.get(job_named(client, "deadline").job_id)  # with its shard records
    stop_s = stop_within_s(job)
    at_bound, later = counts_past_the_bound(pool, since, stop_s)

    events = list(client.watch(job.job_id))
    assert events[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert client.get(job.job_id).state == job_pb.JOB_STATE_CANCELLED
    assert seconds(events[-1].time) - failed_at < stop_s
    assert later == at_bound, (
        f"the workers ran {later - at_bound:g} shard(s) more than {stop_s:.2f} s after the deadline")
    assert reservations(pool) == []


# -- disconnects and a dispatcher restart --------------------------------------------------------


def job_named(client: MeshClient, name: str) -> job_pb.Job:
    return next(j for j in client.stub.ListJobs(pb.ListJobsRequest()).jobs if j.spec.name == name)


def test_a_client_gone_after_the_job_finished_loses_no_result(pool, expected):
    inputs = {"tokens": TOKENS[:JOB_ROWS]}
    parts = request_parts(job_spec("transformer_encoder", inputs, name="gone-after-finish"), inputs, None, 1 << 20)
    with MeshClient(pool.dispatch.address) as first:
        call = first.stub.RunJob(pb.RunJobRequest(**{field: message}) for field, message in parts)
        for response in call:
            if response.WhichOneof("part") == "event" and response.event.type == job_pb.JOB_EVENT_TYPE_SUCCEEDED:
                break
        else:
            raise AssertionError("RunJob ended without a SUCCEEDED event")
        call.cancel()  # gone before reading a single result chunk
    with MeshClient(pool.dispatch.address) as second:
        job = job_named(second, "gone-after-finish")
        assert job.state == job_pb.JOB_STATE_SUCCEEDED
        np.testing.assert_allclose(second.fetch_result(job.job_id)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_a_submitted_job_outlives_its_channel(pool, expected):
    first = MeshClient(pool.dispatch.address)
    job_id = first.submit("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
    first.close()  # while the job runs
    with MeshClient(pool.dispatch.address) as second:
        assert list(second.watch(job_id))[-1].type == job_pb.JOB_EVENT_TYPE_SUCCEEDED
        np.testing.assert_allclose(second.fetch_result(job_id)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_a_dispatcher_killed_mid_job_restarts_with_the_job_failed_and_older_results_kept(pool, tmp_path, expected):
    dispatch = start_dispatch(tmp_path, pool.inventory.address, pool.compile.address, pool.credentials,
                              env=DISPATCH_ENV)
    running = ""
    try:
        with MeshClient(dispatch.address) as client:
            finished = client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}).job
            done, stop_s = finished.job_id, stop_within_s(finished)  # the running job's shards are as long
            before = shards_run(pool)
            running = client.submit("transformer_encoder", {"tokens": TOKENS})
            await_shards_running(client, running, finished=4)
        dispatch.kill()
        # From the bound on, the workers' shard count stands still. (Their CPU, sampled, also moves
        # with the inventory's polls and memory handed back, which are not shards.)
        at_bound, after_bound = counts_past_the_bound(pool, time.monotonic(), stop_s)
        dispatch = start_dispatch(tmp_path, pool.inventory.address, pool.compile.address, pool.credentials,
                                  env=DISPATCH_ENV, listen=f"127.0.0.1:{port_of(dispatch)}")
        with MeshClient(dispatch.address) as client:
            job = client.get(running)
            assert job.state == job_pb.JOB_STATE_FAILED and "restarted" in job.error
            assert [e.type for e in client.watch(running)][-1] == job_pb.JOB_EVENT_TYPE_FAILED  # ends, does not hang
            assert client.get(done).state == job_pb.JOB_STATE_SUCCEEDED
            np.testing.assert_allclose(client.fetch_result(done)["logits"], expected, rtol=1e-5, atol=1e-5)
        # The restarted dispatcher released what the interrupted job held.
        channel, stub = inventory_stub(pool)
        with channel:
            assert list(stub.ListReservations(inv_pb.ListReservationsRequest(job_id=running)).reservations) == []
        assert at_bound - before >= 4  # the shards it finished before the kill, counted
        assert after_bound == at_bound, (f"the workers ran {after_bound - at_bound:g} shard(s) more than "
                                         f"{stop_s:.2f} s after the kill")
    finally:
        dispatch.terminate()
