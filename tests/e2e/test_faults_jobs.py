"""Jobs ended early on a real mesh: a cancel and a passed client deadline stop the workers
within a shard and release the devices, a client gone after its job finished loses no result,
a submitted job outlives its channel, and a dispatcher killed mid-job restarts with that job
failed and older results kept. The mesh is built in _fault_helpers.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import reservations, rpc_error

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_dispatch
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from _fault_helpers import (
    DISPATCH_ENV, EMULATE, JOB_ROWS, NODE_IPS, TOKENS, await_shards_running, inventory_stub, port_of, seconds,
    shards_run,
)
from _fault_helpers import client_fixture, expected_fixture, mesh_fixture, pool_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

DEVICES = len(NODE_IPS) * len(EMULATE)
# A cancel drops a job's queued shards at once; a shard already running cannot be interrupted (XLA
# offers no way), so a device may stay busy for one shard more. How long a shard runs depends on
# the machine, so the workers must be idle within the job's own longest shard (as the workers timed
# it) plus CANCEL_REACH_S, the time for a cancel to reach them (one gRPC cancel, the executor's
# 0.05 s queue poll).
CANCEL_REACH_S = 0.5
# Both workers together, in cores. An idle worker answers the inventory's polls (four a second
# here) and hands freed pages back every two seconds (runtime/memory.py): both at once in both
# workers reached 0.3 of a 0.1 s sample on CI after a job's memory was freed. A shard runs on a
# core for longer than a sample (execute_seconds, ~0.1 s and more), so one that ran after the
# bound puts half a core or more into at least one sample.
BUSY_CORES = 0.45
CPU_SAMPLE_S = 0.1
# After the dispatcher is killed, how long the workers' shard counts are watched for a shard run
# past the bound.
OBSERVE_S = 1.0


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: every thread of the process
    return total / os.sysconf("SC_CLK_TCK")


def cpu_rate(pids: Sequence[int], period_s: float) -> float:
    before = cpu_seconds(pids)
    threading.Event().wait(period_s)  # a sampling period, not a wait for anything
    return (cpu_seconds(pids) - before) / period_s


def busy_after(pids: Sequence[int], since: float, observe_s: float) -> list[tuple[float, float]]:
    """(seconds after `since`, cores) of every CPU sample above BUSY_CORES within `observe_s`."""
    busy = []
    while time.time() - since < observe_s:
        cores = cpu_rate(pids, CPU_SAMPLE_S)
        if cores > BUSY_CORES:
            busy.append((round(time.time() - since, 2), round(cores, 2)))
    return busy


def last_busy_s(busy: list[tuple[float, float]]) -> float:
    return busy[-1][0] if busy else 0.0


def stop_within_s(job: job_pb.Job) -> float:
    """How soon after a cancel the workers must be idle: see CANCEL_REACH_S."""
    ran = [s.execute_seconds for s in job.shards if s.done]
    assert ran, f"job {job.job_id} finished no shard to time the bound by"
    return CANCEL_REACH_S + max(ran)


def worker_pids(mesh) -> list[int]:
    return [w.process.pid for w in mesh.workers]


# -- cancel and deadline -----------------------------------------------------------------------


def test_cancel_stops_the_workers_within_a_shard_and_releases_the_devices(pool, client):
    job_id = client.submit("transformer_encoder", {"tokens": TOKENS})  # 128 shards, 32 a device
    await_shards_running(client, job_id, finished=8)
    pids = worker_pids(pool)
    assert cpu_rate(pids, 2 * CPU_SAMPLE_S) > BUSY_CORES  # what "stopped" is told apart from
    cancelled_at = time.time()
    job = client.cancel(job_id)
    answered_at = time.time()
    stop_s = stop_within_s(job)
    busy = busy_after(pids, cancelled_at, observe_s=stop_s + 1.0)

    assert job.state == job_pb.JOB_STATE_CANCELLED
    events = list(client.watch(job_id))
    assert events[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert seconds(events[-1].time) - cancelled_at < stop_s and answered_at - cancelled_at < stop_s
    assert last_busy_s(busy) < stop_s, f"the workers were busy after the cancel (s, cores): {busy}; bound {stop_s:.2f} s"
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
    failed_at = time.time()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert job_pb.JOB_EVENT_TYPE_SHARD_FINISHED in [e.type for e in streamed], \
        "the deadline should pass while shards run"
    job = client.get(job_named(client, "deadline").job_id)  # with its shard records
    stop_s = stop_within_s(job)
    busy = busy_after(worker_pids(pool), failed_at, observe_s=stop_s + 1.0)

    events = list(client.watch(job.job_id))
    assert events[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert client.get(job.job_id).state == job_pb.JOB_STATE_CANCELLED
    assert seconds(events[-1].time) - failed_at < stop_s
    assert last_busy_s(busy) < stop_s, f"the workers were busy after the deadline (s, cores): {busy}; bound {stop_s:.2f} s"
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
        killed_at = time.monotonic()
        # The workers count every shard they run: from the bound on, the count stands still. (Their
        # CPU, sampled, also moves with the inventory's polls and memory handed back: not a shard.)
        threading.Event().wait(max(0.0, killed_at + stop_s - time.monotonic()))  # to the bound, not for anything
        at_bound = shards_run(pool)
        threading.Event().wait(OBSERVE_S)  # a window to watch, not a wait for anything
        after_bound = shards_run(pool)
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
