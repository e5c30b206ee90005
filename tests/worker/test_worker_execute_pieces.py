"""The pieces of WorkerService.Execute run in this process, where a test can hold a shard
mid-load: a cancelled caller's shard does not run, shards on one device run in turn and on two
at once, target types must match the device, and the artifact cache fetches a key once and
replaces a bad copy. The calls through a worker process are in test_worker_execute.py."""

from __future__ import annotations

import hashlib
import threading

import jax
import numpy as np
import pytest
from _execute_helpers import (  # noqa: F401  (fixtures: pytest finds them in this module)
    CALL_TIMEOUT_S,
    CPU,
    EXECUTABLE_BATCH,
    NODE,
    STAGES,
    compile_service_fixture,
    devices_fixture,
    digits,
    header,
    mlp_fixture,
    model_for,
    requests,
    run_mlp,
    worker_fixture,
)
from grpc_health.v1.health_pb2 import HealthCheckRequest
from grpc_health.v1.health_pb2_grpc import HealthStub

from accelmesh import errors
from accelmesh.hardware.model import DeviceSpec
from accelmesh.programs import BuildOptions
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.programs.mlp import mlp_classifier
from worker_svc import executor as ex
from worker_svc.agent import NodeAgent
from worker_svc.artifacts import ArtifactStore
from worker_svc.config import WorkerConfig
from worker_svc.server import build_worker

from conftest import CREDENTIALS, as_role, mesh_stub
from fakes import host
from fakes.nvml import FakeNvml

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]


# -- cancellation, in this process so the test can hold a shard mid-load --------------------------

class GatedArtifacts:
    """An artifact source that holds each fetch until the test releases it."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def fetch(self, key, digest):
        self.entered.set()
        assert self.release.wait(CALL_TIMEOUT_S)
        return self.inner.fetch(key, digest)


def artifact_store(root, compile_service) -> ArtifactStore:
    """A worker's artifact cache, fetching from the compile service of this module."""
    return ArtifactStore(root, compile_service[0], CREDENTIALS.service(Role.WORKER))


def test_a_shard_whose_caller_is_gone_does_not_run(tmp_path, compile_service):
    gate = GatedArtifacts(artifact_store(tmp_path, compile_service))
    agent = NodeAgent(NODE, jax_devices=jax.devices("cpu"), nvml=FakeNvml([]), proc_root=str(host.proc_root()), env={},
                      hostname="node-c")
    server = build_worker(WorkerConfig(listen="127.0.0.1:0"), agent=agent, artifacts=gate).start()
    executor = server.services[0].servicer.executor
    address = f"127.0.0.1:{server.port}"
    channel = open_channel(address, **as_role(Role.DISPATCH))
    try:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        describe = mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, address).DescribeNode
        (device,) = describe(pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices
        model = model_for(compile_service, {device.id: device}, mlp_classifier(), [device.id], [EXECUTABLE_BATCH])
        call = stub.Execute(requests(header(model, device.id, EXECUTABLE_BATCH),
                                     [*model.params, digits(EXECUTABLE_BATCH)]), timeout=CALL_TIMEOUT_S)
        assert [next(call).stage for _ in range(2)] == STAGES[:2]
        assert gate.entered.wait(CALL_TIMEOUT_S)
        call.cancel()
        # A call after the cancel on the same connection: the server has read the cancel first.
        HealthStub(channel).Check(HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        gate.release.set()
        # The next shard waits for the device the cancelled one held while loading, then runs.
        assert run_mlp(stub, model, device.id, EXECUTABLE_BATCH).timings.artifact_cached
        assert executor.executions == 1
    finally:
        channel.close()
        server.stop(0)


def test_cancelled_while_loading_stops_before_running_and_frees_the_device(tmp_path, compile_service, mlp):
    cpu = DeviceSpec(id=f"{NODE}/cpu:0", node_ip=NODE, local_index=0, platform="cpu", kind="cpu", type="cpu",
                     execution_device="cpu:0")
    gone = threading.Event()

    class Source:  # the caller goes away while the artifact is being fetched
        def fetch(self, key, digest):
            gone.set()
            return artifact_store(tmp_path, compile_service).fetch(key, digest)

    executor = ex.ShardExecutor({cpu.id: cpu}, {"cpu:0": jax.devices("cpu")[0]}, Source())
    build = mlp.builds[CPU]
    shard = ex.Shard("job", 0, 1, cpu.id, "cpu:cpu[]", build.portable.key, build.portable.digest, "stablehlo",
                     BuildOptions(), len(mlp.params) + 1, 8)
    stages = []
    with pytest.raises(ex.ShardCancelled):
        executor.run(shard, [*mlp.params, digits(8)], on_stage=stages.append, cancelled=gone.is_set)
    assert stages == [ex.QUEUED, ex.LOADING] and executor.executions == 0
    result = executor.run(shard, [*mlp.params, digits(8)], on_stage=stages.append)
    assert result.timings.artifact_cached and executor.executions == 1


class HoldFirstFetch:
    """An artifact source that holds the first fetch until the test releases it; later ones pass."""

    def __init__(self, inner):
        self.inner, self.held, self.release = inner, threading.Event(), threading.Event()
        self._first = threading.Lock()

    def fetch(self, key, digest):
        if self._first.acquire(blocking=False):
            self.held.set()
            assert self.release.wait(CALL_TIMEOUT_S)
        return self.inner.fetch(key, digest)


def test_shards_on_one_device_run_in_turn_and_on_two_devices_at_once(tmp_path, compile_service, mlp):
    """Shard A holds device 0 while its artifact is being fetched: B on device 1 must finish meanwhile
    and C on device 0 must wait for A, on any machine at any speed. The two device names share this
    process's one XLA device; the executor's locks are per name."""
    names = ("cpu:0", "cpu:1")
    specs = {name: DeviceSpec(id=f"{NODE}/{name}", node_ip=NODE, local_index=i, platform="cpu", kind="cpu", type="cpu",
                              execution_device=name) for i, name in enumerate(names)}
    source = HoldFirstFetch(artifact_store(tmp_path, compile_service))
    executor = ex.ShardExecutor({s.id: s for s in specs.values()}, dict.fromkeys(names, jax.devices("cpu")[0]), source)
    build = mlp.builds[CPU]
    x = digits(8)
    (want,) = map(np.asarray, mlp.reference(*mlp.params, x))
    log: list[tuple[str, str]] = []  # (shard, stage) in the order the executor reported them
    queued = {label: threading.Event() for label in "ABC"}
    results: dict[str, ex.ShardResult] = {}

    def run(label: str, name: str):
        def on_stage(stage):
            log.append((label, stage))
            if stage == ex.QUEUED:
                queued[label].set()

        shard = ex.Shard("job", "ABC".index(label), 1, specs[name].id, "cpu:cpu[]", build.portable.key,
                         build.portable.digest, "stablehlo", BuildOptions(), len(mlp.params) + 1, 8)
        thread = threading.Thread(target=lambda: results.setdefault(label, executor.run(shard, [*mlp.params, x],
                                                                                       on_stage=on_stage)))
        thread.start()
        return thread

    a = run("A", "cpu:0")
    assert source.held.wait(CALL_TIMEOUT_S)  # A has device 0 and is loading
    b = run("B", "cpu:1")
    b.join(CALL_TIMEOUT_S)
    assert "B" in results, "a shard on device 1 waited for device 0"
    c = run("C", "cpu:0")
    assert queued["C"].wait(CALL_TIMEOUT_S)
    assert ("C", ex.LOADING) not in log  # A still holds device 0
    source.release.set()
    for thread in (a, c):
        thread.join(CALL_TIMEOUT_S)
    assert set(results) == {"A", "B", "C"}, f"shards left unfinished; stages: {log}"
    assert log.index(("B", ex.DONE)) < log.index(("A", ex.RUNNING))
    assert log.index(("A", ex.DONE)) < log.index(("C", ex.LOADING))
    assert [stage for label, stage in log if label == "C"] == [ex.QUEUED, ex.LOADING, ex.RUNNING, ex.DONE]
    for result in results.values():
        np.testing.assert_allclose(result.outputs[0], want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))
    assert executor.executions == 3


# -- the pieces on their own -----------------------------------------------------------------------

A100_SPEC = DeviceSpec(id="n/cuda:0", node_ip="n", local_index=0, platform="cuda", kind="A100", type="a100-80gb",
                       capabilities=frozenset({"bf16", "tf32", "fp16"}), emulated=True, execution_device="cpu:0")


@pytest.mark.parametrize("target_type, error", [
    ("cuda@cpu:a100-80gb[bf16]", None),
    ("cuda@cpu:a100-80gb[]", None),
    ("cuda:a100-80gb[bf16]", errors.FailedPrecondition),  # built for a real GPU backend
    ("rocm@cpu:a100-80gb[bf16]", errors.FailedPrecondition),
    ("cuda@cpu:v100-32gb[]", errors.FailedPrecondition),
    ("cuda@cpu:a100-80gb[bf16,fp8]", errors.FailedPrecondition),  # a flag the device lacks
    ("a100-80gb", errors.InvalidArgument),
])
def test_target_type_must_match_the_device(target_type, error):
    if error is None:
        ex.check_target_type(target_type, A100_SPEC)
    else:
        with pytest.raises(error, match="n/cuda:0" if error is errors.FailedPrecondition else "form"):
            ex.check_target_type(target_type, A100_SPEC)


def test_concurrent_fetches_of_one_key_share_one_stream_and_bad_copies_are_replaced(tmp_path, compile_service, mlp):
    artifact = mlp.builds[CPU].portable
    store = artifact_store(tmp_path, compile_service)
    barrier = threading.Barrier(8)
    got = []

    def fetch():
        barrier.wait()
        got.append(store.get(artifact.key, artifact.digest))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert len(got) == 8 and all(hashlib.sha256(g).hexdigest() == artifact.digest for g in got)
    assert store.fetches == 1
    assert store.fetch(artifact.key, artifact.digest).cached
    (tmp_path / f"{artifact.key}.bin").write_bytes(b"corrupt")
    again = store.fetch(artifact.key, artifact.digest)
    assert not again.cached and store.fetches == 2
    assert hashlib.sha256((tmp_path / f"{artifact.key}.bin").read_bytes()).hexdigest() == artifact.digest
    store.close()
