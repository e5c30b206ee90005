"""Faults on a real mesh: workers killed mid-job, cancels, deadlines, disconnects and a dispatcher
killed mid-job. Two worker processes on their own loopback addresses (127.0.0.2 and 127.0.0.3:
device ids carry the node IP, so two workers on one machine need two IPs) emulate the same fp32
device type, so a shard may move between them and the result still equals a one-device run."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import reservations, rpc_error

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.embedded import (
    EmbeddedMesh,
    start_compile,
    start_dispatch,
    start_inventory,
    start_worker,
)
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import split
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.programs import default_registry
from dispatch_svc.device_queues import CancelScope, ShardFailed
from dispatch_svc.mesh_client import GrpcMesh
from dispatch_svc.interface import ArtifactRef, Build, JobDevice

pytestmark = pytest.mark.slow

NODE_IPS = ("127.0.0.2", "127.0.0.3")
EMULATE = ("v100-32gb", "v100-32gb")  # no bf16: the fp32 rule, so a moved shard changes nothing
POLL_INTERVAL_S = 0.25
LOST_AFTER = 2
POLL_TIMEOUT_S = 2.0  # the inventory's default DescribeNode deadline
# A killed node is lost after LOST_AFTER missed polls; each costs at most an interval plus the deadline.
LOST_WINDOW_S = LOST_AFTER * (POLL_INTERVAL_S + POLL_TIMEOUT_S) + POLL_INTERVAL_S
# 32 token rows (4 KiB) a shard: a 512-row job is 16 shards, 4 a device, so there is always a shard
# in flight to cancel.
DISPATCH_ENV = {"ACCELMESH_MAX_SHARD_BYTES": str(4096)}
TOKENS = np.random.default_rng(7).integers(0, 512, size=(4096, 32), dtype=np.int32)
JOB_ROWS = 512
DEVICES = len(NODE_IPS) * len(EMULATE)
KILL_ROUNDS = 10
# A cancel drops a job's queued shards at once; a shard already running cannot be interrupted (XLA
# offers no way), so a device may stay busy for one shard more. How long a shard runs depends on
# the machine, so the workers must be idle within the job's own longest shard (as the workers timed
# it) plus CANCEL_REACH_S, the time for a cancel to reach them (one gRPC cancel, the executor's
# 0.05 s queue poll).
CANCEL_REACH_S = 0.5
# Both workers together, in cores: an idle worker answers a poll now and then (a 10 ms tick in a
# 0.1 s sample is 0.1), a worker running shards uses one core or more.
BUSY_CORES = 0.3
CPU_SAMPLE_S = 0.1
FAILURE = r"^{ip}/cuda:\d+: [A-Z_]+: \S"  # "<device>: <status code>: <details>"


def start_node(mesh: EmbeddedMesh, ip: str, port: int | str = 0):
    return start_worker(mesh.inventory.address, devices=len(EMULATE), emulate=EMULATE, listen=f"{ip}:{port}",
                        artifact_dir=mesh.data_dir / "worker-artifacts", name=f"worker-{ip}")


def port_of(process) -> str:
    return process.address.rsplit(":", 1)[1]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("faults")
    inventory = start_inventory(data_dir, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=LOST_AFTER)
    with EmbeddedMesh(data_dir, inventory) as running:
        running.compile = start_compile(data_dir)
        running.workers = [start_node(running, ip) for ip in NODE_IPS]
        running.dispatch = start_dispatch(data_dir, inventory.address, running.compile.address, env=DISPATCH_ENV)
        with MeshClient(running.dispatch.address) as client:  # builds and loads the 32-row executable everywhere
            client.run("transformer_encoder", {"tokens": TOKENS[:128]})
        yield running


@pytest.fixture
def pool(mesh):
    """The mesh with both workers up (a test that failed half-way may have left one dead)."""
    for index, ip in enumerate(NODE_IPS):
        if mesh.workers[index].process.poll() is not None:
            mesh.workers[index] = start_node(mesh, ip, port_of(mesh.workers[index]))
    return mesh


@pytest.fixture
def client(pool):
    with MeshClient(pool.dispatch.address) as c:
        yield c


@pytest.fixture(scope="module")
def expected():
    """The encoder's logits for TOKENS[:JOB_ROWS] computed on one device in this process."""
    import jax

    program = default_registry().get("transformer_encoder")
    (logits,) = jax.jit(program.fn)(*program.init_params(0), TOKENS[:JOB_ROWS])
    return np.asarray(logits)


def inventory_stub(mesh):
    channel = open_channel(mesh.inventory.address)
    return channel, inventory_service_pb2_grpc.InventoryServiceStub(channel)



def node_state(mesh, address: str) -> int:
    channel, stub = inventory_stub(mesh)
    with channel:
        return next(n.state for n in stub.ListNodes(inv_pb.ListNodesRequest()).nodes if n.address == address)


def seconds(stamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


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


def stop_within_s(job: pb.Job) -> float:
    """How soon after a cancel the workers must be idle: see CANCEL_REACH_S."""
    ran = [s.execute_seconds for s in job.shards if s.done]
    assert ran, f"job {job.job_id} finished no shard to time the bound by"
    return CANCEL_REACH_S + max(ran)


def worker_pids(mesh) -> list[int]:
    return [w.process.pid for w in mesh.workers]


# -- a worker killed mid-job -------------------------------------------------------------------


def kill_mid_job(mesh, client: MeshClient, victim: int):
    """Run the job, SIGKILL worker `victim` as soon as a shard starts on it."""
    ip, process = NODE_IPS[victim], mesh.workers[victim]
    killed_at = []

    def on_event(event):
        if not killed_at and event.type == pb.JOB_EVENT_TYPE_SHARD_STARTED and event.shard.device_id.startswith(f"{ip}/"):
            process.kill()
            killed_at.append(time.time())

    result = client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}, on_event=on_event)
    assert killed_at, f"no shard started on {ip}"
    return result, killed_at[0]


def check_completed_despite(result, expected, victim_ip: str, survivor_ip: str) -> None:
    assert result.job.state == pb.JOB_STATE_SUCCEEDED
    np.testing.assert_allclose(result.outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    retried = [s for s in result.job.shards if s.attempts > 1]
    assert retried, "a shard was running or queued on the killed worker, so at least one was retried"
    for shard in retried:
        assert shard.done and shard.device_id.startswith(f"{survivor_ip}/")
        assert len(shard.failures) == shard.attempts - 1
        for failure in shard.failures:
            assert re.match(FAILURE.format(ip=re.escape(victim_ip)), failure), failure
    retries = [e for e in result.events if e.type == pb.JOB_EVENT_TYPE_SHARD_RETRIED]
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


# -- cancel and deadline -----------------------------------------------------------------------


def await_shards_running(client: MeshClient, job_id: str, finished: int) -> None:
    for event in client.watch(job_id):
        finished -= event.type == pb.JOB_EVENT_TYPE_SHARD_FINISHED
        if finished <= 0:
            return
    raise AssertionError(f"job {job_id} ended before {finished} more shards finished")


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

    assert job.state == pb.JOB_STATE_CANCELLED
    events = list(client.watch(job_id))
    assert events[-1].type == pb.JOB_EVENT_TYPE_CANCELLED
    assert seconds(events[-1].time) - cancelled_at < stop_s and answered_at - cancelled_at < stop_s
    assert last_busy_s(busy) < stop_s, f"the workers were busy after the cancel (s, cores): {busy}; bound {stop_s:.2f} s"
    # A device's shard already past its start when the cancel landed is the most that may follow it.
    late = [e for e in events if e.type == pb.JOB_EVENT_TYPE_SHARD_STARTED and seconds(e.time) > cancelled_at]
    assert len(late) <= DEVICES and all(seconds(e.time) < answered_at for e in late)
    assert sum(e.type == pb.JOB_EVENT_TYPE_SHARD_FINISHED for e in events) < len(job.plan.shards)
    assert reservations(pool) == []


def test_a_passed_client_deadline_cancels_the_job_and_releases_the_devices(pool, client):
    streamed = []
    error = rpc_error(client.run, "transformer_encoder", {"tokens": TOKENS}, name="deadline", timeout=1.5,
                      on_event=streamed.append)
    failed_at = time.time()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pb.JOB_EVENT_TYPE_SHARD_FINISHED in [e.type for e in streamed], "the deadline should pass while shards run"
    job = client.get(job_named(client, "deadline").job_id)  # with its shard records
    stop_s = stop_within_s(job)
    busy = busy_after(worker_pids(pool), failed_at, observe_s=stop_s + 1.0)

    events = list(client.watch(job.job_id))
    assert events[-1].type == pb.JOB_EVENT_TYPE_CANCELLED and client.get(job.job_id).state == pb.JOB_STATE_CANCELLED
    assert seconds(events[-1].time) - failed_at < stop_s
    assert last_busy_s(busy) < stop_s, f"the workers were busy after the deadline (s, cores): {busy}; bound {stop_s:.2f} s"
    assert reservations(pool) == []


# -- disconnects and a dispatcher restart --------------------------------------------------------


def job_named(client: MeshClient, name: str) -> pb.Job:
    return next(j for j in client.stub.ListJobs(pb.ListJobsRequest()).jobs if j.spec.name == name)


def test_a_client_gone_after_the_job_finished_loses_no_result(pool, expected):
    inputs = {"tokens": TOKENS[:JOB_ROWS]}
    parts = request_parts(job_spec("transformer_encoder", inputs, name="gone-after-finish"), inputs, None, 1 << 20)
    with MeshClient(pool.dispatch.address) as first:
        call = first.stub.RunJob(pb.RunJobRequest(**{field: message}) for field, message in parts)
        for response in call:
            if response.WhichOneof("part") == "event" and response.event.type == pb.JOB_EVENT_TYPE_SUCCEEDED:
                break
        else:
            raise AssertionError("RunJob ended without a SUCCEEDED event")
        call.cancel()  # gone before reading a single result chunk
    with MeshClient(pool.dispatch.address) as second:
        job = job_named(second, "gone-after-finish")
        assert job.state == pb.JOB_STATE_SUCCEEDED
        np.testing.assert_allclose(second.fetch_result(job.job_id)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_a_submitted_job_outlives_its_channel(pool, expected):
    first = MeshClient(pool.dispatch.address)
    job_id = first.submit("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]})
    first.close()  # while the job runs
    with MeshClient(pool.dispatch.address) as second:
        assert list(second.watch(job_id))[-1].type == pb.JOB_EVENT_TYPE_SUCCEEDED
        np.testing.assert_allclose(second.fetch_result(job_id)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_a_dispatcher_killed_mid_job_restarts_with_the_job_failed_and_older_results_kept(pool, tmp_path, expected):
    dispatch = start_dispatch(tmp_path, pool.inventory.address, pool.compile.address, env=DISPATCH_ENV)
    running = ""
    try:
        with MeshClient(dispatch.address) as client:
            finished = client.run("transformer_encoder", {"tokens": TOKENS[:JOB_ROWS]}).job
            done, stop_s = finished.job_id, stop_within_s(finished)  # the running job's shards are as long
            running = client.submit("transformer_encoder", {"tokens": TOKENS})
            await_shards_running(client, running, finished=4)
        killed_at = time.time()
        dispatch.kill()
        busy = busy_after(worker_pids(pool), killed_at, observe_s=stop_s + 1.0)
        dispatch = start_dispatch(tmp_path, pool.inventory.address, pool.compile.address, env=DISPATCH_ENV,
                                  listen=f"127.0.0.1:{port_of(dispatch)}")
        with MeshClient(dispatch.address) as client:
            job = client.get(running)
            assert job.state == pb.JOB_STATE_FAILED and "restarted" in job.error
            assert [e.type for e in client.watch(running)][-1] == pb.JOB_EVENT_TYPE_FAILED  # ends, does not hang
            assert client.get(done).state == pb.JOB_STATE_SUCCEEDED
            np.testing.assert_allclose(client.fetch_result(done)["logits"], expected, rtol=1e-5, atol=1e-5)
        # The restarted dispatcher released what the interrupted job held.
        channel, stub = inventory_stub(pool)
        with channel:
            assert list(stub.ListReservations(inv_pb.ListReservationsRequest(job_id=running)).reservations) == []
        assert last_busy_s(busy) < stop_s, f"the workers were busy after the kill (s, cores): {busy}; bound {stop_s:.2f} s"
    finally:
        dispatch.terminate()


# -- the dispatcher's side of a worker's stream, against in-process fake workers ---------------


CLEAN_END = "clean end"


class FakeWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Answers every shard with a two-chunk output. `cut` ends the call after the first chunk: with
    that status, or with CLEAN_END as a normal end (timings sent, half the tensor never)."""

    def __init__(self, cut: grpc.StatusCode | str | None = None):
        self.cut = cut

    def Execute(self, request_iterator, context):
        for _ in request_iterator:
            pass
        header, chunks = split("output_0", np.arange(2048, dtype=np.float32), 4096)
        yield worker_pb.ExecuteResponse(tensor=header)
        for chunk in chunks:
            yield worker_pb.ExecuteResponse(chunk=chunk)
            if isinstance(self.cut, grpc.StatusCode):
                context.abort(self.cut, "worker went away")
            if self.cut == CLEAN_END:
                break
        yield worker_pb.ExecuteResponse(timings=worker_pb.ShardTimings(execute_seconds=0.001))


def serve_fake(worker: FakeWorker, port: int = 0):
    return create_server([Service("accelmesh.worker.v1.WorkerService",
                                  worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, worker)],
                         address=f"127.0.0.1:{port}").start()


def send_shard(mesh: GrpcMesh, port: int):
    device = JobDevice(type("Spec", (), {"id": "127.0.0.1/cuda:0"})(), f"127.0.0.1:{port}", "t")
    artifact = ArtifactRef("k", "d", "stablehlo", 2048)
    build = Build("t", "rule", "float32", compile_pb.Rule(), (device.id,), artifact, {})
    return mesh.execute("job", 0, 1, device, build, artifact, [("x", np.zeros(2048, np.float32))], 2048, CancelScope())


@pytest.fixture
def grpc_mesh():
    mesh = GrpcMesh("127.0.0.1:1", "127.0.0.1:1", max_message_bytes=1 << 22, chunk_bytes=4096)
    yield mesh
    mesh.close()


CUTS = [(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE: "), (grpc.StatusCode.CANCELLED, "CANCELLED: "),
        (grpc.StatusCode.INTERNAL, "INTERNAL: "), (CLEAN_END, "worker sent a malformed result: ")]


@pytest.mark.parametrize("cut, cause", CUTS, ids=["unavailable", "cancelled", "internal", "clean-end"])
def test_a_result_cut_short_fails_the_attempt_and_is_never_used(grpc_mesh, cut, cause):
    server = serve_fake(FakeWorker(cut))  # the error interceptor keeps the status it aborted with
    try:
        with pytest.raises(ShardFailed) as info:  # the pool retries a ShardFailed on another device
            send_shard(grpc_mesh, server.port)
        assert info.value.cause.startswith(cause), info.value.cause
    finally:
        server.stop(0)


def test_a_worker_back_on_its_address_takes_the_next_shard_at_once(grpc_mesh):
    server = serve_fake(FakeWorker())
    port = server.port
    np.testing.assert_array_equal(send_shard(grpc_mesh, port).outputs[0], np.arange(2048, dtype=np.float32))
    server.stop(0)
    for _ in range(3):  # the dispatcher keeps trying while the worker is down: its channel backs off
        with pytest.raises(ShardFailed):
            send_shard(grpc_mesh, port)
    server = serve_fake(FakeWorker(), port)
    try:
        np.testing.assert_array_equal(send_shard(grpc_mesh, port).outputs[0], np.arange(2048, dtype=np.float32))
    finally:
        server.stop(0)
