"""Shared by the WorkerService.Execute tests: a compile service in this process, a worker
process with four CPU devices (two emulating accelerators), and the calls that build shard
headers, stream inputs and collect what comes back. A module of its own, not a conftest.py:
a second conftest.py would shadow the top-level one that tests import as `conftest`. Each
fixture is defined as `<name>_fixture` with name="<name>", so a test module that imports it
can take `<name>` as a parameter without shadowing the import."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np
import pytest

from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.launcher import start_service
from accelmesh.runtime.tensors import TensorAssembler, split
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.config import CompileConfig
from compile_svc.programs.mlp import mlp_classifier
from compile_svc.programs.transformer import transformer_encoder
from compile_svc.server import build_compile_service

from conftest import CREDENTIALS, mesh_stub
from fakes import host

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
    builds: dict[str, build_pb.TargetBuild]  # device id -> its build
    params: list[np.ndarray]
    reference: object  # jitted fp32 fn on this process's single CPU device


def compile_for(stub, program: str, devices, batch_sizes) -> dict[str, build_pb.TargetBuild]:
    response = stub.Compile(compile_pb.CompileRequest(program=program, targets=list(devices), batch_sizes=batch_sizes),
                            timeout=CALL_TIMEOUT_S)
    return {device_id: build for build in response.builds for device_id in build.device_ids}


def model_for(compile_service, devices, entry, device_ids, batch_sizes) -> Model:
    _, stub = compile_service
    program = entry.program
    builds = compile_for(stub, program.name, [devices[d] for d in device_ids], batch_sizes)
    return Model(builds, [np.asarray(p) for p in program.init_params(0)], jax.jit(program.fn))


def header(model: Model, device: str, batch: int, fmt: str = "executable", **changes) -> pb.ShardHeader:
    """A header for `device`'s build; `changes` override fields (device_id too, to send it elsewhere)."""
    build = model.builds[device]
    artifact = build.portable if fmt == "stablehlo" else next(e for e in build.executables if e.batch_size == batch)
    fields = dict(job_id="job-1", shard_index=0, attempt=1, device_id=device, target_type=build.target_type,
                  artifact_key=artifact.key, artifact_digest=artifact.digest, artifact_format=artifact.format,
                  rule=build.rule, input_count=len(model.params) + 1, batch_size=batch, report_stages=True)
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

@pytest.fixture(scope="module", name="compile_service")
def compile_service_fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    server, _ = build_compile_service(CompileConfig(
        listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs")))
    server.start()
    address = f"127.0.0.1:{server.port}"
    yield address, mesh_stub(compile_service_pb2_grpc.CompileServiceStub, address)
    server.stop(0)


@pytest.fixture(scope="module", name="worker")
def worker_fixture(tmp_path_factory, compile_service):
    """Its two CPU devices (cpu:2, cpu:3) are shares of a CPU without bf16: they get an fp32 rule.
    It fetches artifacts from the compile service above, and is called as the dispatcher calls it."""
    artifacts = tmp_path_factory.mktemp("worker-artifacts")
    process = start_service("worker", "worker_svc", [
        "--listen", "127.0.0.1:0", "--devices", "4", "--emulate", "a100-80gb,v100-32gb",
        "--compile", compile_service[0],
        "--artifact-dir", str(artifacts), "--proc-root", str(host.proc_root(host.FP32_CPU)),
    ], env={**CREDENTIALS.env(Role.WORKER), "ACCELMESH_WORKER_MAX_INPUT_BYTES": str(MAX_INPUT_BYTES),
            "ACCELMESH_WORKER_HELD_BYTES": str(HELD_BYTES)})
    yield mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, process.address)
    process.terminate()


@pytest.fixture(scope="module", name="devices")
def devices_fixture(worker):
    return {d.id: d for d in worker.DescribeNode(pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices}


@pytest.fixture(scope="module", name="mlp")
def mlp_fixture(compile_service, devices):
    return model_for(compile_service, devices, mlp_classifier(), [A100, V100, CPU], [EXECUTABLE_BATCH])


@pytest.fixture(scope="module", name="transformer")
def transformer_fixture(compile_service, devices):
    return model_for(compile_service, devices, transformer_encoder(), [CPU, CPU_3], [TRANSFORMER_BATCH])

