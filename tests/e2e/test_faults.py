"""Workers killed on a real mesh: a worker SIGKILLed mid-job has its shards retried on the other
one and the job completes, ten kills in a row each leave no reservation, and a job started
before the inventory calls a dead worker lost runs on the others. The mesh is built in
_fault_helpers.py; cancels and disconnects are in test_faults_jobs.py, cut-short worker streams
in test_faults_stream.py."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from _fault_helpers import (  # noqa: F401  (fixtures)
    EMULATE,
    JOB_ROWS,
    LOST_WINDOW_S,
    NODE_IPS,
    TOKENS,
    client_fixture,
    expected_fixture,
    inventory_stub,
    mesh_fixture,
    node_state,
    pool_fixture,
    port_of,
    seconds,
    start_node,
)

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb

from conftest import reservations

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

KILL_ROUNDS = 10
FAILURE = r"^{ip}/cuda:\d+: [A-Z_]+: \S"  # "<device>: <status code>: <details>"


# -- a worker killed mid-job -------------------------------------------------------------------


def kill_mid_job(mesh, client: MeshClient, victim: int):
    """Run the job, SIGKILL worker `victim` as soon as a shard starts on it."""
    ip, process = NODE_IPS[victim], mesh.workers[victim]
    killed_at = []

    def on_event(event):
        started = event.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED
        if not killed_at and started and event.shard.device_id.startswith(f"{ip}/"):
            process.kill()
            killed_at.append(time.time())

    result = client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}, on_event=on_event)
    assert killed_at, f"no shard started on {ip}"
    return result, killed_at[0]


def check_completed_despite(result, expected, victim_ip: str, survivor_ip: str) -> None:
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED
    np.testing.assert_allclose(result.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    retried = [s for s in result.job.shards if s.attempts > 1]
    assert retried, "a shard was running or queued on the killed worker, so at least one was retried"
    for shard in retried:
        assert shard.done and shard.device_id.startswith(f"{survivor_ip}/")
        assert len(shard.failures) == shard.attempts - 1
        for failure in shard.failures:
            assert re.match(FAILURE.format(ip=re.escape(victim_ip)), failure), failure
    retries = [e for e in result.events if e.type == job_pb.JOB_EVENT_TYPE_SHARD_RETRIED]
    assert len(retries) == sum(len(s.failures) for s in result.job.shards)


def await_lost(stream, device_ids: set[str]) -> float:
    """The inventory's time of the last LOST event among `device_ids`."""
    seen: dict[str, float] = {}
    for event in stream:
        if event.type == inv_pb.DEVICE_EVENT_TYPE_LOST and event.device.id in device_ids:
            seen[event.device.id] = seconds(event.event_time)
            if set(seen) == device_ids:
                return max(seen.values())
    raise AssertionError(f"the stream ended before {sorted(device_ids - set(seen))} were lost")


def watch_devices(mesh, ip: str):
    """A WatchDevices stream already subscribed (its EXISTING events for `ip` were read)."""
    channel, stub = inventory_stub(mesh)
    stream = stub.WatchDevices(inv_pb.WatchDevicesRequest(include_existing=True), timeout=60)
    ids = set()
    for event in stream:
        if event.type != inv_pb.DEVICE_EVENT_TYPE_EXISTING:
            continue
        if event.device.id.startswith(f"{ip}/"):
            ids.add(event.device.id)
        if len(ids) == len(EMULATE):
            return channel, stream, ids
    raise AssertionError(f"no devices of {ip} in the inventory")


def kill_round(mesh, client, expected, victim: int) -> None:
    ip, survivor = NODE_IPS[victim], NODE_IPS[1 - victim]
    address = mesh.workers[victim].address
    channel, stream, device_ids = watch_devices(mesh, ip)
    with channel:
        result, killed_at = kill_mid_job(mesh, client, victim)
        check_completed_despite(result, expected, ip, survivor)
        lost_at = await_lost(stream, device_ids)
        stream.cancel()
    assert lost_at - killed_at < LOST_WINDOW_S
    assert node_state(mesh, address) == inv_pb.NODE_STATE_LOST
    assert reservations(mesh) == []
    mesh.workers[victim] = start_node(mesh, ip, port_of(mesh.workers[victim]))  # registered once it is ready
    assert node_state(mesh, address) == inv_pb.NODE_STATE_ACTIVE


def test_a_worker_killed_mid_job_is_retried_elsewhere_and_the_job_completes(pool, client, expected):
    kill_round(pool, client, expected, victim=0)


def test_ten_kills_in_a_row_each_complete_and_leave_no_reservation(pool, client, expected):
    for round_ in range(KILL_ROUNDS):  # each worker in turn; each round checks everything test (a) does
        kill_round(pool, client, expected, victim=round_ % 2)


def test_a_job_started_before_the_inventory_calls_a_dead_worker_lost_runs_on_the_others(pool, client, expected):
    address = pool.workers[0].address
    channel, stream, device_ids = watch_devices(pool, NODE_IPS[0])
    with channel:
        pool.workers[0].kill()
        assert node_state(pool, address) == inv_pb.NODE_STATE_ACTIVE  # one missed poll at most: not lost yet
        result = client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
        assert {s.device_id.split("/")[0] for s in result.job.shards} == {NODE_IPS[1]}
        assert all(s.attempts == 1 for s in result.job.shards)
        np.testing.assert_allclose(result.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
        assert reservations(pool) == []
        await_lost(stream, device_ids)  # lost as ever, though no job called it since
        stream.cancel()
    pool.workers[0] = start_node(pool, NODE_IPS[0], port_of(pool.workers[0]))

