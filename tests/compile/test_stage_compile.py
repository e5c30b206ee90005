"""Pipeline stages (CompileRequest.layers): a compile service in this process, a worker process
with three CPU devices (two emulating accelerators), transformer_encoder cut into three stages
whose composition must equal the whole model, every refusal's status code, and the stage
catalog (tied weights, single flight) on its own."""

from __future__ import annotations

import hashlib
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accelmesh import artifacts
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.programs import BuildOptions, OutputSpec, Program, TensorSpec
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_from_proto, device_to_proto
from accelmesh.runtime.launcher import start_service
from accelmesh.runtime.tensors import TensorCollector, dtype_code_for_name
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.config import CompileConfig
from compile_svc.programs.layers import LayerFn
from compile_svc.programs.stages import LayerRange, StageCatalog
from compile_svc.programs.transformer import transformer_encoder
from compile_svc.server import build_compile_service
from dispatch_svc.dataplane.device_queues import CancelScope
from dispatch_svc.ports import JobDevice

from conftest import CREDENTIALS, DispatchClients, mesh_stub, rpc_error

pytestmark = pytest.mark.slow

MODEL = "transformer_encoder"
LAYER_NAMES = ["embed", "block_0", "block_1", "block_2", "block_3", "head"]
STAGES = [LayerRange(0, 2), LayerRange(2, 2), LayerRange(4, 2)]
BATCH = 8
CALL_TIMEOUT_S = 60.0
NODE = "127.0.0.1"
A100, V100, CPU = f"{NODE}/cuda:0", f"{NODE}/cuda:1", f"{NODE}/cpu:2"


# -- fixtures: one compile service here, one worker process with three devices -------------------

@pytest.fixture(scope="module")
def compile_service(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    server, compiler = build_compile_service(CompileConfig(
        listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs")))
    server.start()
    address = f"127.0.0.1:{server.port}"
    channel = open_channel(address)
    yield address, compile_service_pb2_grpc.CompileServiceStub(channel), compiler
    channel.close()
    server.stop(0)


@pytest.fixture(scope="module")
def stub(compile_service):
    return compile_service[1]


@pytest.fixture(scope="module")
def worker(tmp_path_factory, compile_service):
    process = start_service("worker", "worker_svc", [
        "--listen", "127.0.0.1:0", "--devices", "3", "--emulate", "a100-80gb,v100-32gb",
        "--compile", compile_service[0],
        "--artifact-dir", str(tmp_path_factory.mktemp("worker-artifacts"))], env=CREDENTIALS.env(Role.WORKER))
    yield process
    process.terminate()


@pytest.fixture(scope="module")
def devices(worker) -> dict[str, JobDevice]:
    described = mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, worker.address).DescribeNode(
        worker_pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S)
    return {d.id: JobDevice(device_from_proto(d, d.id)[0], worker.address) for d in described.devices}


@pytest.fixture(scope="module")
def mesh(compile_service):
    mesh = DispatchClients.open(compile_service[0], max_message_bytes=64 << 20)
    yield mesh
    mesh.close()


@pytest.fixture(scope="module")
def model(mesh) -> Program:
    return mesh.compiler.describe_program(MODEL, "")


@pytest.fixture(scope="module")
def params(stub) -> dict[str, np.ndarray]:
    """The model's initial leaves by name, as FetchParameters streams them."""
    leaves = TensorCollector("parameter")
    for part in stub.FetchParameters(pb.FetchParametersRequest(program=MODEL, seed=0), timeout=CALL_TIMEOUT_S):
        if part.WhichOneof("part") == "tensor":
            leaves.header(part.tensor)
        else:
            leaves.chunk(part.chunk)
    return leaves.results()


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 512, size=(BATCH, 32), dtype=np.int32)


@pytest.fixture(scope="module")
def reference(model, params, tokens) -> np.ndarray:
    """The whole program, fp32, on this process's CPU."""
    fn = transformer_encoder().program.fn
    (logits,) = jax.jit(fn)(*[params[spec.name] for spec in model.parameters], tokens)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def cpu_stages(mesh, devices, model):
    """(stage program, its one build) per stage, for the CPU device, with executables at BATCH."""
    out = []
    for layers in STAGES:
        stage, (build,) = mesh.compiler.compile_stage(model, [devices[CPU]], layers.first, layers.count,
                                                      batch_sizes=[BATCH])
        out.append((stage, build))
    return out


def fetch(stub, key: str) -> bytes:
    parts = list(stub.FetchArtifact(pb.FetchArtifactRequest(key=key), timeout=CALL_TIMEOUT_S))
    data = b"".join(p.chunk for p in parts)
    assert hashlib.sha256(data).hexdigest() == parts[0].digest
    return data


def stage_request(layers: LayerRange, *targets, **fields) -> pb.CompileRequest:
    return pb.CompileRequest(program=MODEL, targets=[device_to_proto(t.spec) for t in targets],
                             layers=pb.LayerRange(first=layers.first, count=layers.count), **fields)


def options(build) -> BuildOptions:
    b = build.rule.build
    return BuildOptions(b.compute_dtype, b.matmul_precision, b.remat, dict(b.xla_options), b.tolerance)


def assert_within_rule(got: np.ndarray, want: np.ndarray, build) -> None:
    rule = build.rule.build
    scale = float(np.max(np.abs(want)))
    if rule.compute_dtype == "fp32":
        np.testing.assert_allclose(got, want, rtol=rule.tolerance, atol=rule.tolerance * scale)
    else:
        error = float(np.max(np.abs(got - want))) / scale
        assert 0 < error <= rule.tolerance, f"{build.rule.name}: {rule.compute_dtype} stage is off by {error:.2e}"


# -- signatures ------------------------------------------------------------------------------------

def test_stage_programs_name_their_layers_leaves_and_activations(model, cpu_stages):
    stages = [stage for stage, _ in cpu_stages]
    assert [s.name for s in stages] == [f"{MODEL}:0-1", f"{MODEL}:2-3", f"{MODEL}:4-5"]
    assert all(s.version == model.version and s.kind == "model" for s in stages)
    for stage, layers in zip(stages, STAGES):
        mine = tuple(LAYER_NAMES[layers.first : layers.last + 1])
        assert [layer.name for layer in stage.layers] == list(mine)
        # Exactly its own layers' leaves at the model's shapes, in first-use order: layer by layer,
        # so embed's leaves come before block_0's though the model's (sorted) order is the reverse.
        assert stage.parameters == tuple(p for layer in mine for p in model.parameters
                                         if p.name.startswith(layer + "/"))
    activation = TensorSpec("activation", "float32", (None, 32, 128))
    assert [s.inputs for s in stages] == [model.inputs, (activation,), (activation,)]
    handed_on = OutputSpec("activation", "float32", (None, 32, 128), "concat")
    assert [s.outputs for s in stages] == [(handed_on,), (handed_on,), model.outputs]
    assert stages[-1].outputs[0] == OutputSpec("logits", "float32", (None, 16), "concat")
    assert len({model.digest, *(s.digest for s in stages)}) == 4
    assert len({build.portable.key for _, build in cpu_stages}) == 3


def test_the_request_inputs_are_checked_against_the_stage_not_the_model(stub, devices):
    activation = program_pb.TensorSpec(name="activation", dtype=dtype_code_for_name("float32"), shape=[-1, 32, 128])
    response = stub.Compile(stage_request(STAGES[1], devices[CPU], inputs=[activation]), timeout=CALL_TIMEOUT_S)
    assert list(response.stage.inputs) == [activation]
    tokens = program_pb.TensorSpec(name="tokens", dtype=dtype_code_for_name("int32"), shape=[-1, 32])
    error = rpc_error(stub.Compile, stage_request(STAGES[1], devices[CPU], inputs=[tokens]), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "expects 'activation'" in error.details()


# -- results ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["stablehlo", "executable"])
def test_stages_run_locally_compose_to_the_whole_program(stub, cpu_stages, params, tokens, reference, fmt):
    x = tokens
    for stage, build in cpu_stages:
        leaves = [params[spec.name] for spec in stage.parameters]
        if fmt == "executable":
            (x,) = artifacts.load_executable(fetch(stub, build.executables[BATCH].key))(*leaves, x)
        else:
            (x,) = artifacts.run_portable(artifacts.load_portable(fetch(stub, build.portable.key)), options(build),
                                          *leaves, x)
        assert x.shape == (BATCH, *stage.outputs[0].shape[1:]) and x.dtype == jnp.float32
    assert_within_rule(np.asarray(x), reference, cpu_stages[-1][1])


def test_stages_run_on_a_worker_compose_to_the_whole_program(mesh, devices, cpu_stages, params, tokens, reference):
    x, scope = tokens, CancelScope()
    for index, (stage, build) in enumerate(cpu_stages):
        arrays = [*((spec.name, params[spec.name]) for spec in stage.parameters), (stage.inputs[0].name, x)]
        result = mesh.workers.execute("stage-job", index, 1, devices[CPU], build, build.executables[BATCH],
                                      arrays, BATCH, scope)
        (x,) = result.outputs
        assert result.load_kind == "executable"
    assert_within_rule(x, reference, cpu_stages[-1][1])


def test_a_repeated_stage_request_is_answered_from_the_cache(compile_service, devices, cpu_stages):
    _, stub, compiler = compile_service
    builds_before = compiler.cache.builds
    response = stub.Compile(stage_request(STAGES[1], devices[CPU], batch_sizes=[BATCH]), timeout=CALL_TIMEOUT_S)
    (build,) = response.builds
    assert build.portable.cache_hit and all(e.cache_hit for e in build.executables)
    assert build.portable.key == cpu_stages[1][1].portable.key
    assert compiler.cache.builds == builds_before
    assert response.program == MODEL and response.stage.name == f"{MODEL}:2-3"


def test_two_target_types_get_their_own_rule_and_artifact_for_one_stage(mesh, stub, devices, model, params,
                                                                       cpu_stages):
    stage, builds = mesh.compiler.compile_stage(model, [devices[A100], devices[V100]], STAGES[1].first, STAGES[1].count)
    assert stage == cpu_stages[1][0]
    by_rule = {b.rule_name: b for b in builds}
    assert set(by_rule) == {"cuda-bf16", "cuda-fp32"}
    assert by_rule["cuda-bf16"].device_ids == (A100,) and by_rule["cuda-fp32"].device_ids == (V100,)
    assert by_rule["cuda-bf16"].portable.key != by_rule["cuda-fp32"].portable.key
    assert "xbf16>" in artifacts.hlo_text(fetch(stub, by_rule["cuda-bf16"].portable.key))
    assert "xbf16>" not in artifacts.hlo_text(fetch(stub, by_rule["cuda-fp32"].portable.key))

    activation = np.random.default_rng(1).normal(size=(BATCH, 32, 128)).astype(np.float32)
    leaves = [(spec.name, params[spec.name]) for spec in stage.parameters]
    want = fp32_stage(STAGES[1], params, activation)
    for build in builds:
        (device_id,) = build.device_ids
        result = mesh.workers.execute("stage-job", 0, 1, devices[device_id], build, build.portable,
                              [*leaves, ("activation", activation)], BATCH, CancelScope())
        assert result.load_kind == "compiled"
        assert_within_rule(result.outputs[0], want, build)


def fp32_stage(layers: LayerRange, params, x) -> np.ndarray:
    """The stage in fp32 on this process, cut from the registered model's own layer functions."""
    entry = transformer_encoder()
    local = StageCatalog().stage(entry.program, entry.layer_fns, layers)
    (y,) = jax.jit(local.fn)(*[params[s.name] for s in local.parameters], x)
    return np.asarray(y)


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("first, count, field, valid", [
    (0, 0, "layers.count", "1..6"),
    (4, 3, "layers.count", "1..2"),
    (0, 7, "layers.count", "1..6"),
    (-1, 1, "layers.first", "0..5"),
    (6, 1, "layers.first", "0..5"),
])
def test_a_range_outside_the_model_is_invalid_and_names_the_field(stub, devices, first, count, field, valid):
    error = rpc_error(stub.Compile, stage_request(LayerRange(first, count), devices[CPU]), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} is {count if field.endswith('count') else first}" in error.details()
    assert valid in error.details()


@pytest.mark.parametrize("program", ["identity", "mlp_train_step"])
def test_a_program_without_layer_functions_has_no_stages(stub, devices, program):
    request = stage_request(LayerRange(0, 1), devices[CPU])
    request.program = program
    error = rpc_error(stub.Compile, request, timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a layered model" in error.details() and "leave layers unset" in error.details()


# -- the stage catalog on its own ------------------------------------------------------------------

def tied_model(traced: list[str] | None = None) -> tuple[Program, tuple[LayerFn, ...]]:
    """embed (x @ w) then head (y @ w.T + b): the head reads the embedding's weight, a tied leaf."""
    def embed(w, x):
        if traced is not None:
            traced.append("embed")
        return x @ w

    def head(w, b, y):
        if traced is not None:
            traced.append("head")
        return y @ w.T + b

    parameters = (TensorSpec("embed/w", "float32", (4, 8)), TensorSpec("head/b", "float32", (4,)))
    program = Program(
        name="tied", version="1", kind="model", description="tied weights",
        parameters=parameters, inputs=(TensorSpec("x", "float32", (None, 4)),),
        outputs=(OutputSpec("y", "float32", (None, 4), "concat"),), digest="tied-digest",
        fn=lambda w, b, x: (head(w, b, embed(w, x)),))
    return program, (LayerFn("embed", "embedding", ("embed/w",), embed),
                     LayerFn("head", "dense", ("embed/w", "head/b"), head))


def test_a_tied_leaf_is_one_argument_of_every_stage_that_reads_it():
    program, layer_fns = tied_model()
    catalog = StageCatalog()
    whole, head = (catalog.stage(program, layer_fns, r) for r in (LayerRange(0, 2), LayerRange(1, 1)))
    assert [p.name for p in whole.parameters] == ["embed/w", "head/b"]
    assert [p.name for p in head.parameters] == ["embed/w", "head/b"]
    assert head.inputs == (TensorSpec("activation", "float32", (None, 8)),) and head.outputs == program.outputs
    rng = np.random.default_rng(0)
    w, b, x = (rng.normal(size=s).astype(np.float32) for s in [(4, 8), (4,), (3, 4)])
    (want,) = program.fn(w, b, x)
    np.testing.assert_allclose(whole.fn(w, b, x)[0], want, rtol=1e-6)
    (embedded,) = catalog.stage(program, layer_fns, LayerRange(0, 1)).fn(w, x)
    np.testing.assert_allclose(head.fn(w, b, embedded)[0], want, rtol=1e-6)


def test_concurrent_requests_derive_a_stage_once():
    traced: list[str] = []
    program, layer_fns = tied_model(traced)
    catalog = StageCatalog()
    barrier = threading.Barrier(8)
    got = []

    def ask():
        barrier.wait()
        got.append(catalog.stage(program, layer_fns, LayerRange(1, 1)))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 8 and all(stage is got[0] for stage in got)
    assert sorted(traced) == ["embed", "head"]  # the activations were traced once, for all eight
    assert catalog.stage(program, layer_fns, LayerRange(1, 1)) is got[0]
