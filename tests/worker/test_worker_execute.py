"""WorkerService.Execute through real gRPC: a compile service in this process, a worker process
with four CPU devices (two emulating accelerators), shards checked against a single-device
reference, every refusal's status code, and the pieces (target types, artifact cache,
cancellation) on their own."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

import grpc
import jax
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.hardware.model import DeviceSpec
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.launcher import start_service
from accelmesh.runtime.tensors import TensorAssembler, split
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.config import CompileConfig
from accelmesh.programs import BuildOptions
from compile_svc.programs.mlp import mlp_classifier
from compile_svc.programs.transformer import transformer_encoder
from compile_svc.server import build_compile_service
from conftest import rpc_error
from worker_svc import executor as ex
from worker_svc.agent import NodeAgent
from worker_svc.artifacts import ArtifactStore
from worker_svc.config import WorkerConfig
from worker_svc.server import build_worker
from fakes import host
from fakes.nvml import FakeNvml

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
CALL_TIMEOUT_S = 60.0
NODE = "127.0.0.1"
A100, V100, CPU, CPU_3 = f"{NODE}/cuda:0", f"{NODE}/cuda:1", f"{NODE}/cpu:2", f"{NODE}/cpu:3"
EXECUTABLE_BATCH, PORTABLE_BATCH = 32, 24  # the portable artifact serves a size with no executable
TRANSFORMER_BATCH = 512
MAX_INPUT_BYTES = 16 * MIB
HELD_BYTES = 150_000  # the mlp's parameters (104,488 bytes) are held for one job at a time
STAGES = [pb.SHARD_STAGE_QUEUED, pb.SHARD_STAGE_LOADING, pb.SHARD_STAGE_RUNNING, pb.SHARD_STAGE_DONE]


@dataclass
class Outcome:
    stages: list[int]
    outputs: list[np.ndarray]
    timings: pb.ShardTimings
    seen: dict[int, float] = field(default_factory=dict)  # stage -> when this client received it


@dataclass(frozen=True)
class Model:
    compile_address: str
    builds: dict[str, compile_pb.TargetBuild]  # device id -> its build
    params: list[np.ndarray]
    reference: object  # jitted fp32 fn on this process's single CPU device


def compile_for(stub, program: str, devices, batch_sizes) -> dict[str, compile_pb.TargetBuild]:
    response = stub.Compile(compile_pb.CompileRequest(program=program, targets=list(devices), batch_sizes=batch_sizes),
                            timeout=CALL_TIMEOUT_S)
    return {device_id: build for build in response.builds for device_id in build.device_ids}


def model_for(compile_service, devices, entry, device_ids, batch_sizes) -> Model:
    address, stub = compile_service
    program = entry.program
    builds = compile_for(stub, program.name, [devices[d] for d in device_ids], batch_sizes)
    return Model(address, builds, [np.asarray(p) for p in program.init_params(0)], jax.jit(program.fn))


def header(model: Model, device: str, batch: int, fmt: str = "executable", **changes) -> pb.ShardHeader:
    """A header for `device`'s build; `changes` override fields (device_id too, to send it elsewhere)."""
    build = model.builds[device]
    artifact = build.portable if fmt == "stablehlo" else next(e for e in build.executables if e.batch_size == batch)
    fields = dict(job_id="job-1", shard_index=0, attempt=1, device_id=device, target_type=build.target_type,
                  artifact_key=artifact.key, artifact_digest=artifact.digest, artifact_format=artifact.format,
                  rule=build.rule, compile_address=model.compile_address, input_count=len(model.params) + 1,
                  batch_size=batch, report_stages=True)
    return pb.ShardHeader(**{**fields, **changes})


def requests(head: pb.ShardHeader | None, arrays, chunk_bytes: int = MIB):
    if head is not None:
        yield pb.ExecuteRequest(header=head)
    for index, array in enumerate(arrays):
        tensor, chunks = split(f"input_{index}", array, chunk_bytes)
        yield pb.ExecuteRequest(tensor=tensor)
        for chunk in chunks:
            yield pb.ExecuteRequest(chunk=chunk)


def execute(stub, messages) -> Outcome:
    stages, outputs, timings, seen = [], [], None, {}
    for part in stub.Execute(messages, timeout=CALL_TIMEOUT_S):
        kind = part.WhichOneof("part")
        if kind == "stage":
            stages.append(part.stage)
            seen[part.stage] = time.perf_counter()
        elif kind == "tensor":
            outputs.append(TensorAssembler(part.tensor, "output"))
        elif kind == "chunk":
            outputs[-1].add(part.chunk)
        else:
            timings = part.timings
    return Outcome(stages, [o.result() for o in outputs], timings, seen)


def digits(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 64)).astype(np.float32)


def run_mlp(stub, model: Model, device_id: str, batch: int, fmt: str = "executable") -> Outcome:
    return execute(stub, requests(header(model, device_id, batch, fmt), [*model.params, digits(batch)]))


def kept(model: Model) -> list[pb.TensorRef]:
    """The parameters as `requests` names them, each under a key of its own."""
    return [pb.TensorRef(name=f"input_{index}", key=f"params:{index}") for index in range(len(model.params))]


def referring(head: pb.ShardHeader, refs: list[pb.TensorRef], x: np.ndarray):
    """A call whose parameters are references to held tensors and whose data input is sent in full."""
    yield pb.ExecuteRequest(header=head)
    for ref in refs:
        yield pb.ExecuteRequest(held=ref)
    tensor, chunks = split(f"input_{len(refs)}", x)
    yield pb.ExecuteRequest(tensor=tensor)
    yield from (pb.ExecuteRequest(chunk=chunk) for chunk in chunks)


# -- fixtures: one compile service here, one worker process with four devices ---------------------

@pytest.fixture(scope="module")
def compile_service(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    server, _ = build_compile_service(CompileConfig(
        listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs")))
    server.start()
    address = f"127.0.0.1:{server.port}"
    channel = open_channel(address)
    yield address, compile_service_pb2_grpc.CompileServiceStub(channel)
    channel.close()
    server.stop(0)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """Its two CPU devices (cpu:2, cpu:3) are shares of a CPU without bf16: they get an fp32 rule."""
    artifacts = tmp_path_factory.mktemp("worker-artifacts")
    process = start_service("worker", "worker_svc", [
        "--listen", "127.0.0.1:0", "--devices", "4", "--emulate", "a100-80gb,v100-32gb",
        "--artifact-dir", str(artifacts), "--proc-root", str(host.proc_root(host.FP32_CPU)),
    ], env={"ACCELMESH_WORKER_MAX_INPUT_BYTES": str(MAX_INPUT_BYTES), "ACCELMESH_WORKER_HELD_BYTES": str(HELD_BYTES)})
    channel = open_channel(process.address)
    yield worker_service_pb2_grpc.WorkerServiceStub(channel)
    channel.close()
    process.terminate()


@pytest.fixture(scope="module")
def devices(worker):
    return {d.id: d for d in worker.DescribeNode(pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices}


@pytest.fixture(scope="module")
def mlp(compile_service, devices):
    return model_for(compile_service, devices, mlp_classifier(), [A100, V100, CPU], [EXECUTABLE_BATCH])


@pytest.fixture(scope="module")
def transformer(compile_service, devices):
    return model_for(compile_service, devices, transformer_encoder(), [CPU, CPU_3], [TRANSFORMER_BATCH])


# -- results ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_id", [CPU, V100, A100])
@pytest.mark.parametrize("fmt, batch, load_kind", [("executable", EXECUTABLE_BATCH, "executable"),
                                                    ("stablehlo", PORTABLE_BATCH, "compiled")])
def test_outputs_match_the_single_device_reference(worker, mlp, device_id, fmt, batch, load_kind):
    outcome = run_mlp(worker, mlp, device_id, batch, fmt)
    assert outcome.stages == STAGES
    assert outcome.timings.load_kind == load_kind
    (logits,) = outcome.outputs
    (want,) = map(np.asarray, mlp.reference(*mlp.params, digits(batch)))
    assert logits.shape == (batch, 10) and logits.dtype == np.float32
    rule = mlp.builds[device_id].rule.build
    scale = float(np.max(np.abs(want)))
    if rule.compute_dtype == "fp32":
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        error = float(np.max(np.abs(logits - want))) / scale
        assert 0 < error <= rule.tolerance, f"{rule.compute_dtype} run is off by {error:.2e}"


def test_without_report_stages_only_outputs_and_timings_come_back(worker, mlp):
    quiet = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, report_stages=False),
                                     [*mlp.params, digits(EXECUTABLE_BATCH)]))
    loud = run_mlp(worker, mlp, CPU, EXECUTABLE_BATCH)
    assert quiet.stages == [] and quiet.timings is not None
    np.testing.assert_array_equal(quiet.outputs[0], loud.outputs[0])


def test_a_second_shard_of_the_same_shape_skips_loading(worker, mlp):
    batch = 40  # a size no other test uses: the first shard compiles it
    first = run_mlp(worker, mlp, V100, batch, "stablehlo")
    second = run_mlp(worker, mlp, V100, batch, "stablehlo")
    assert second.timings.artifact_cached and second.timings.load_kind == "compiled"
    assert second.timings.load_seconds < first.timings.load_seconds / 10
    np.testing.assert_array_equal(second.outputs[0], first.outputs[0])


def test_kept_parameters_serve_later_calls_of_the_job_by_reference(worker, mlp):
    keep = kept(mlp)
    full = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1", keep_tensors=keep),
                                    [*mlp.params, digits(EXECUTABLE_BATCH)]))
    for seed in (0, 1):
        by_reference = execute(worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1"), keep,
                                                 digits(EXECUTABLE_BATCH, seed)))
        in_full = full if seed == 0 else execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH),
                                                                  [*mlp.params, digits(EXECUTABLE_BATCH, seed)]))
        assert by_reference.stages == STAGES
        np.testing.assert_array_equal(by_reference.outputs[0], in_full.outputs[0])
    error = rpc_error(execute, worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-other"), keep,
                                                 digits(EXECUTABLE_BATCH)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, "held per job: another job's key is not its own"
    _, chunks = split("input_0", mlp.params[0])
    chunk_after_reference = [pb.ExecuteRequest(header=header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1")),
                             pb.ExecuteRequest(held=keep[0]), *(pb.ExecuteRequest(chunk=c) for c in chunks)]
    error = rpc_error(execute, worker, iter(chunk_after_reference))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "unexpected chunk" in error.details()


def test_the_byte_limit_evicts_the_least_recently_used_job(worker, mlp):
    keep = kept(mlp)
    for job in ("evict-a", "evict-b"):  # two jobs' parameters do not fit HELD_BYTES: b's push a's out
        execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id=job, keep_tensors=keep),
                                 [*mlp.params, digits(EXECUTABLE_BATCH)]))
    error = rpc_error(execute, worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="evict-a"), keep,
                                                 digits(EXECUTABLE_BATCH)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "input 0 ('input_0')" in error.details() and "is not held" in error.details()
    assert error_reason(error) == errors.TENSOR_NOT_HELD  # what the dispatcher acts on
    assert execute(worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="evict-b"), keep,
                                     digits(EXECUTABLE_BATCH))).stages == STAGES


def run_together(stub, shards) -> list[Outcome]:
    """Start every shard's call at once, from its own thread."""
    barrier = threading.Barrier(len(shards))
    results: list = [None] * len(shards)

    def call(index, messages):
        barrier.wait()
        results[index] = execute(stub, messages)

    threads = [threading.Thread(target=call, args=(i, iter(list(m)))) for i, m in enumerate(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert all(results), "a shard did not finish"
    return results


def test_shards_on_two_devices_match_the_reference_and_share_their_types_artifact(worker, transformer):
    tokens = np.random.default_rng(1).integers(0, 512, size=(TRANSFORMER_BATCH, 32), dtype=np.int32)

    def shard(device_id):
        return requests(header(transformer, device_id, TRANSFORMER_BATCH), [*transformer.params, tokens])

    assert {transformer.builds[d].rule.build.compute_dtype for d in (CPU, CPU_3)} == {"fp32"}
    first, other_device = execute(worker, shard(CPU)), execute(worker, shard(CPU_3))
    # The first shard fetched the artifact; the second device of the same type found it on disk.
    assert not first.timings.artifact_cached and other_device.timings.artifact_cached
    (want,) = map(np.asarray, transformer.reference(*transformer.params, tokens))
    for outcome in (first, other_device):
        np.testing.assert_allclose(outcome.outputs[0], want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))

    # Sent at once, to two devices and twice to one: each shard's stages in order, every output the
    # reference's, the artifact from memory. Who waits for whom: the executor test below.
    for pair in ([shard(CPU), shard(CPU_3)], [shard(CPU), shard(CPU)]):
        for outcome in run_together(worker, pair):
            assert outcome.stages == STAGES and outcome.timings.artifact_cached
            np.testing.assert_allclose(outcome.outputs[0], want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))


# -- refusals --------------------------------------------------------------------------------------

def _garbage_executable(model):
    portable = model.builds[CPU].portable  # StableHLO bytes announced as an executable
    return requests(header(model, CPU, EXECUTABLE_BATCH, artifact_key=portable.key,
                           artifact_digest=portable.digest), [*model.params, digits(EXECUTABLE_BATCH)])


def _stream_ends_mid_tensor(model):
    messages = list(requests(header(model, CPU, EXECUTABLE_BATCH), [*model.params, digits(EXECUTABLE_BATCH)], 1024))
    return iter(messages[:-1])


def _oversized_input(model):
    big = pb.ExecuteRequest(tensor=split("x", np.zeros(0, np.float32))[0])
    big.tensor.shape[:] = [MAX_INPUT_BYTES // 4 + 1]
    big.tensor.total_bytes = (MAX_INPUT_BYTES // 4 + 1) * 4
    return iter([pb.ExecuteRequest(header=header(model, CPU, EXECUTABLE_BATCH, input_count=1)), big])


REFUSALS = {
    "unknown device": (grpc.StatusCode.NOT_FOUND, CPU, lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, device_id=f"{NODE}/cuda:7"), [*m.params, digits(EXECUTABLE_BATCH)])),
    "another target type": (grpc.StatusCode.FAILED_PRECONDITION, "a100-80gb", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, target_type=m.builds[A100].target_type),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "wrong digest": (grpc.StatusCode.FAILED_PRECONDITION, "failed verification", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_digest=hashlib.sha256(b"other").hexdigest()),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "garbage key": (grpc.StatusCode.NOT_FOUND, "not-a-key", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_key="not-a-key"), [*m.params, digits(EXECUTABLE_BATCH)])),
    "unknown key": (grpc.StatusCode.NOT_FOUND, "0" * 64, lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_key="0" * 64), [*m.params, digits(EXECUTABLE_BATCH)])),
    "artifact that does not load": (grpc.StatusCode.FAILED_PRECONDITION, "did not load", _garbage_executable),
    "header not first": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: requests(
        None, [*m.params, digits(EXECUTABLE_BATCH)])),
    "empty stream": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: iter([])),
    "stream ends early": (grpc.StatusCode.INVALID_ARGUMENT, "ended after", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), m.params)),
    "stream ends inside a tensor": (grpc.StatusCode.INVALID_ARGUMENT, "stream ended", _stream_ends_mid_tensor),
    "more tensors than announced": (grpc.StatusCode.INVALID_ARGUMENT, "more tensors", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), [*m.params, digits(EXECUTABLE_BATCH), digits(1)])),
    "input of the wrong shape": (grpc.StatusCode.INVALID_ARGUMENT, "input 6", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), [*m.params, digits(EXECUTABLE_BATCH)[:, :63]])),
    "inputs over the worker's limit": (grpc.StatusCode.RESOURCE_EXHAUSTED, "ACCELMESH_WORKER_MAX_INPUT_BYTES",
                                       _oversized_input),
    "reference to a tensor not held": (grpc.StatusCode.FAILED_PRECONDITION, "is not held", lambda m: referring(
        header(m, CPU, EXECUTABLE_BATCH, job_id="never-kept"), kept(m), digits(EXECUTABLE_BATCH))),
    "reference before the header": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: iter(
        [pb.ExecuteRequest(held=kept(m)[0])])),
    "keeping a tensor the call does not send": (grpc.StatusCode.INVALID_ARGUMENT, "'x'", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, keep_tensors=[pb.TensorRef(name="x", key="k")]),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "keeping a tensor twice": (grpc.StatusCode.INVALID_ARGUMENT, "listed twice", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, keep_tensors=[pb.TensorRef(name="input_0", key="a"),
                                                       pb.TensorRef(name="input_1", key="a")]),
        [*m.params, digits(EXECUTABLE_BATCH)])),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_have_their_status_and_the_worker_keeps_serving(worker, mlp, case):
    code, fragment, make = REFUSALS[case]
    error = rpc_error(execute, worker, make(mlp))
    assert error.code() == code, error.details()
    assert fragment in error.details()
    assert run_mlp(worker, mlp, CPU, EXECUTABLE_BATCH).stages == STAGES


# -- cancellation, in this process so the test can hold a shard mid-load --------------------------

class GatedArtifacts:
    """An artifact source that holds each fetch until the test releases it."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def fetch(self, key, digest, compile_address):
        self.entered.set()
        assert self.release.wait(CALL_TIMEOUT_S)
        return self.inner.fetch(key, digest, compile_address)


def test_a_shard_whose_caller_is_gone_does_not_run(tmp_path, compile_service):
    gate = GatedArtifacts(ArtifactStore(tmp_path))
    agent = NodeAgent(NODE, jax_devices=jax.devices("cpu"), nvml=FakeNvml([]), proc_root=str(host.proc_root()), env={},
                      hostname="node-c")
    server = build_worker(WorkerConfig(listen="127.0.0.1:0"), agent=agent, artifacts=gate).start()
    executor = server.services[0].servicer.executor
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        (device,) = stub.DescribeNode(pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices
        model = model_for(compile_service, {device.id: device}, mlp_classifier(), [device.id], [EXECUTABLE_BATCH])
        call = stub.Execute(requests(header(model, device.id, EXECUTABLE_BATCH),
                                     [*model.params, digits(EXECUTABLE_BATCH)]), timeout=CALL_TIMEOUT_S)
        assert [next(call).stage for _ in range(2)] == STAGES[:2]
        assert gate.entered.wait(CALL_TIMEOUT_S)
        call.cancel()
        # A call after the cancel on the same connection: the server has read the cancel first.
        stub.DescribeNode(pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S)
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
        def fetch(self, key, digest, compile_address):
            gone.set()
            return ArtifactStore(tmp_path).fetch(key, digest, compile_address)

    executor = ex.ShardExecutor({cpu.id: cpu}, {"cpu:0": jax.devices("cpu")[0]}, Source())
    build = mlp.builds[CPU]
    shard = ex.Shard("job", 0, 1, cpu.id, "cpu:cpu[]", build.portable.key, build.portable.digest, "stablehlo",
                     BuildOptions(), mlp.compile_address, len(mlp.params) + 1, 8)
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

    def fetch(self, key, digest, compile_address):
        if self._first.acquire(blocking=False):
            self.held.set()
            assert self.release.wait(CALL_TIMEOUT_S)
        return self.inner.fetch(key, digest, compile_address)


def test_shards_on_one_device_run_in_turn_and_on_two_devices_at_once(tmp_path, compile_service, mlp):
    """Shard A holds device 0 while its artifact is being fetched: B on device 1 must finish meanwhile
    and C on device 0 must wait for A, on any machine at any speed. The two device names share this
    process's one XLA device; the executor's locks are per name."""
    names = ("cpu:0", "cpu:1")
    specs = {name: DeviceSpec(id=f"{NODE}/{name}", node_ip=NODE, local_index=i, platform="cpu", kind="cpu", type="cpu",
                              execution_device=name) for i, name in enumerate(names)}
    source = HoldFirstFetch(ArtifactStore(tmp_path))
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
                         build.portable.digest, "stablehlo", BuildOptions(), mlp.compile_address, len(mlp.params) + 1, 8)
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
    store = ArtifactStore(tmp_path)
    barrier = threading.Barrier(8)
    got = []

    def fetch():
        barrier.wait()
        got.append(store.get(artifact.key, artifact.digest, mlp.compile_address))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert len(got) == 8 and all(hashlib.sha256(g).hexdigest() == artifact.digest for g in got)
    assert store.fetches == 1
    assert store.fetch(artifact.key, artifact.digest, mlp.compile_address).cached
    (tmp_path / f"{artifact.key}.bin").write_bytes(b"corrupt")
    again = store.fetch(artifact.key, artifact.digest, mlp.compile_address)
    assert not again.cached and store.fetches == 2
    assert hashlib.sha256((tmp_path / f"{artifact.key}.bin").read_bytes()).hexdigest() == artifact.digest
    store.close()
