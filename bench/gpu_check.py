"""GPU check: the whole mesh on a real NVIDIA GPU, from the NVML probe to a checked transformer job.

    python bench/gpu_check.py [--rows N] [--timeout S]   # on a machine with an NVIDIA GPU
    .venv/bin/python bench/gpu_check.py --cpu            # CPU-only: fake NVML, emulated GPU

Prints one JSON document on stdout (progress on stderr) and exits 1 when a check fails: no GPU
found, a build, the job or the baseline failed, or a result is outside the rule's tolerance.
`mode` says which ran: "gpu" (the real driver and device) or "cpu" (fake NVML table, the worker
on CPU devices emulating a catalog profile, labelled emulated). Both take the same path:

(a) nvml: the worker's own probe (worker_svc/probes/nvml.py, `nvml_devices`, the function the
    worker registers), handed its driver as the worker is (`NodeContext.drivers["nvml"]`): pynvml
    on the real driver, or with --cpu the repository's table-driven fake (tests/fakes/nvml.py,
    loaded from its file by --fake-nvml; bench/ and tests/ are not packages) over FAKE_NVML_GPUS,
    one uncatalogued GPU modelled on an H200 and one catalog A100. Per GPU: what NVML said, the
    DeviceSpec the worker would register (id, type, capabilities, peak rates, memory), and whether
    the dispatcher can plan on it (it prices a device by its peak rate at the rule's dtype).
(b) compile: inventory, compile service, one worker and dispatch as real processes on loopback
    (accelmesh/embedded.py's helpers, mutual TLS and tokens as in production). Every process but
    the worker runs JAX on the CPU (JAX_PLATFORMS=cpu), so the compile service builds the cuda
    rule's portable StableHLO on the CPU host. One Compile for the devices the inventory lists for
    the job and the GPUs of (a): rule, compute dtype, tolerance, build seconds per target type.
(c) job: transformer_encoder over --rows token sequences planned by the dispatcher (MeshClient),
    restricted to the GPU (or the emulated profile), on the direct data path (data_path="direct",
    docs/data-plane.md: this process puts the tokens into the worker's object store and fetches
    the logits from it, by shared memory since the worker is on this host; no tensor byte passes
    the dispatcher), run twice: the first run's shards fetch the artifact and finish compiling it
    on the worker (load seconds), the second is the warm one. Then once more, warm, on the relay
    path (the bytes through the dispatcher), for comparison. Each run's record says which path its
    bytes took and how many went each way. All three are checked against a CPU fp32 run of the
    same program in this process (accelmesh/reference.py: the default-fp32 rule at highest matmul
    precision) within the rule's own tolerance (bf16 5e-2, fp32 1e-4: deploy/rules/compile_rules.toml).
(d) baseline (STYLE rule 12): the same artifact, parameters and tokens in a child process in the
    worker's environment (this file, --role device), compiled for the job's first device as the
    worker's executor does (accelmesh.artifacts.compile_portable with the rule's XLA options) and
    timed per call (inputs put on the device, run, outputs back); checked against the reference
    too. The job's rows/s per device (shard records: rows over execute seconds and over shard
    seconds) and over the job's wall time (the warm direct run's, and the relay run's) are set
    beside it as ratios, so the mesh's cost shows apart from the device's, on each data path.

`--rows`: token sequences in the job (default 4096; --cpu 64). `--timeout`: seconds the whole check
may take (default 480, so that it fits a 10-minute command); each call gets what is left of it.
When a check fails, the JSON holds the last lines of every mesh process's output.

On the GPU machine (no network; Python 3.12, JAX with its CUDA plugin, grpcio, protobuf and
nvidia-ml-py installed), bring the other packages the mesh imports as wheels: bench/README.md
("GPU check") has the download command to run here and the install and run commands for there.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import grpc
import jax
import numpy as np

# bench/common.py: this file runs from bench/, which Python puts first on sys.path
from common import progress, ratio

from accelmesh.cli.inventory import inventory_stub, list_all_devices
from accelmesh.client import MeshClient
from accelmesh.compile.v1 import build_pb2, compile_service_pb2_grpc
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.dispatch.v1 import job_pb2
from accelmesh.embedded import (
    EmbeddedMesh,
    mesh_credentials,
    start_compile,
    start_dispatch,
    start_inventory,
    start_worker,
)
from accelmesh.errors import AccelmeshError
from accelmesh.hardware.catalog import find_by_kind, load_catalog
from accelmesh.hardware.model import DeviceSample, DeviceSpec
from accelmesh.reference import reference_outputs
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import PLATFORM_FROM_PROTO, device_to_proto
from accelmesh.runtime.tensors import TensorCollector
from compile_svc.programs.transformer import SEQ_LEN, VOCAB
from worker_svc.config import GPU_ENVIRONMENT
from worker_svc.probes.nvml import NvmlGpu, nvml_devices, probe_nvml
from worker_svc.probes.registry import NodeContext

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = "transformer_encoder"
PARAMETER_SEED = 0
# The CPU reference runs this many token sequences at a time: its memory is a chunk's activations
# (262,144 rows at once took more than the GPU machine's memory and were killed, 2026-12-04).
REFERENCE_CHUNK_ROWS = 8192
NODE_IP = "127.0.0.1"  # the worker listens on loopback, so its device ids carry this address
# The fake GPUs' node (TEST-NET-1, never dialled): their ids must not meet the emulated device's.
FAKE_NODE_IP = "192.0.2.1"
GPU, CPU = "gpu", "cpu"
DIRECT, RELAY = "direct", "relay"  # MeshClient.run's data paths: the job's, and the one beside it
DEFAULT_ROWS = {GPU: 4096, CPU: 64}
# The whole check, so that it fits one 10-minute command on a lent machine with room to spare; each
# call (Compile, a job, the baseline's child) gets what is left of it.
DEFAULT_BUDGET_S = 480.0
# The profile the --cpu worker emulates: the catalog's Hopper, bf16-capable as an H200 is, so it
# gets the same cuda-bf16 rule the real GPU does.
DEFAULT_EMULATE = "h100-sxm-80gb"
BASELINE_CALLS = 5  # timed calls of the baseline after one untimed
OUTPUT_TAIL_LINES = 30  # of each mesh process's output, in the JSON when a check failed
MIB = 1024 * 1024
# NVML's view of the lent H200 (nvidia-smi there: "NVIDIA H200", 143771 MiB, SM 1980 MHz and memory
# 3201 MHz at most; an SXM board has 18 NVLink links), of a catalog A100, and of a GPU the catalog
# does not know (a workstation Ada board, no NVLink), so both of nvml_device_spec's branches run.
# Keys: tests/fakes/nvml.py.
FAKE_NVML_GPUS = (
    {"name": "NVIDIA H200", "uuid": "GPU-fake-h200-0", "memory_total": 143771 * MIB, "memory_used": 512 * MIB,
     "utilization_gpu": 0, "cc": (9, 0), "sm_clock_max": 1980, "mem_clock_max": 3201, "pcie_gen_max": 5,
     "pcie_width_max": 16, "nvlink": [True] * 18, "temperature": 31, "power_mw": 118_000},
    {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-fake-a100-1", "memory_total": 81920 * MIB, "memory_used": 0,
     "utilization_gpu": 0, "cc": (8, 0), "sm_clock_max": 1410, "mem_clock_max": 1593, "pcie_gen_max": 4,
     "pcie_width_max": 16, "nvlink": [True] * 12, "temperature": 29, "power_mw": 61_000},
    {"name": "NVIDIA RTX 6000 Ada Generation", "uuid": "GPU-fake-ada-2", "memory_total": 49140 * MIB,
     "memory_used": 0, "utilization_gpu": 0, "cc": (8, 9), "sm_clock_max": 2505, "mem_clock_max": 10001,
     "pcie_gen_max": 4, "pcie_width_max": 16, "nvlink": [], "temperature": 30, "power_mw": 25_000},
)


# -- (a) the NVML probe ----------------------------------------------------------------------------


def load_fake_nvml(path: Path):
    """The fake pynvml over FAKE_NVML_GPUS, its module loaded from `path` (sys.path untouched)."""
    spec = importlib.util.spec_from_file_location("accelmesh_fake_nvml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeNvml([dict(gpu) for gpu in FAKE_NVML_GPUS])


@dataclasses.dataclass
class ProbedGpu:
    gpu: NvmlGpu | None  # what NVML said
    spec: DeviceSpec  # what the worker registers
    sample: DeviceSample
    in_catalog: bool
    facts: dict = dataclasses.field(default_factory=dict)  # what the later steps learn about it

    @property
    def dispatch_can_plan(self) -> bool:
        """The dispatcher prices a device by its peak rate at the rule's dtype (falling back to its
        other rates) and refuses one without any (dispatch_svc/planner/throughput.py)."""
        return max(self.spec.performance.peak_tflops.values(), default=0.0) > 0

    def record(self) -> dict:
        performance, spec, sample = self.spec.performance, self.spec, self.sample
        return {
            "nvml": {**dataclasses.asdict(self.gpu), "pcie_gbps": self.gpu.pcie_gbps} if self.gpu else None,
            "spec": {
                "id": spec.id, "type": spec.type, "platform": spec.platform, "kind": spec.kind,
                "capabilities": sorted(spec.capabilities), "compute_capability": spec.compute_capability,
                "execution_device": spec.execution_device, "emulated": spec.emulated, "in_catalog": self.in_catalog,
                "performance": {"peak_tflops": dict(performance.peak_tflops), "memory_bytes": performance.memory_bytes,
                                "memory_bandwidth_gbps": performance.memory_bandwidth_gbps,
                                "interconnect": performance.interconnect,
                                "interconnect_bandwidth_gbps": performance.interconnect_bandwidth_gbps},
            },
            "sample": {"memory_total_bytes": sample.memory_total_bytes, "memory_used_bytes": sample.memory_used_bytes,
                       "utilization": sample.utilization, "temperature_c": sample.temperature_c,
                       "power_w": sample.power_w},
            "dispatch_can_plan": self.dispatch_can_plan,
            **self.facts,
        }


def probe_gpus(driver, node_ip: str) -> list[ProbedGpu]:
    """Every GPU the worker's NVML probe finds through `driver` (None: pynvml, the real driver)."""
    catalog = load_catalog()
    raw = {gpu.index: gpu for gpu in probe_nvml(driver)}
    found = nvml_devices(NodeContext(node_ip, (), catalog, time.time(), drivers={"nvml": driver}))
    return [ProbedGpu(raw.get(spec.local_index), spec, sample, find_by_kind(spec.kind, catalog) is not None)
            for spec, sample in found]


# -- (b) the mesh and the compile service ----------------------------------------------------------


def worker_env(mode: str) -> dict[str, str]:
    """The worker's JAX (and the baseline child's): the GPU and the CPU, or the CPU alone."""
    if mode == CPU:
        return {"JAX_PLATFORMS": "cpu"}
    # cuda named, not left to discovery: a CUDA plugin that fails to start stops the worker with
    # its reason instead of leaving it on the CPU. GPU_ENVIRONMENT, what the worker sets itself:
    # CUDA numbers GPUs as NVML does, and no preallocation (the worker and the baseline share the GPU).
    return {**GPU_ENVIRONMENT, "JAX_PLATFORMS": "cuda,cpu", "ACCELMESH_WORKER_NVML": "1"}


def start_mesh(data_dir: Path, mode: str, emulate: str) -> EmbeddedMesh:
    """start_embedded_mesh's processes, the worker on the GPU (NVML on) or emulating `emulate`."""
    credentials = mesh_credentials(data_dir)
    mesh = EmbeddedMesh(data_dir, start_inventory(data_dir, credentials), credentials)
    try:
        mesh.compile = start_compile(data_dir, credentials)
        mesh.workers.append(start_worker(
            mesh.inventory.address, mesh.compile.address, credentials, devices=1,
            emulate=(emulate,) if mode == CPU else (), nvml=mode == GPU, artifact_dir=data_dir / "worker-artifacts",
            env=worker_env(mode)))
        mesh.dispatch = start_dispatch(data_dir, mesh.inventory.address, mesh.compile.address, credentials)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def mesh_device(device) -> dict:
    return {"id": device.id, "type": device.type, "platform": PLATFORM_FROM_PROTO.get(device.platform, "?"),
            "kind": device.kind, "emulated": device.emulated, "execution_device": device.execution_device,
            "capabilities": sorted(device.capabilities),
            "peak_tflops": dict(device.performance.peak_tflops), "memory_bytes": device.performance.memory_bytes}


def compile_targets(stub, targets: Sequence, rows: int, timeout_s: float) -> tuple[compile_pb.CompileResponse, float]:
    started = time.perf_counter()
    response = stub.Compile(compile_pb.CompileRequest(program=PROGRAM, targets=list(targets), batch_sizes=[rows]),
                            timeout=timeout_s)
    return response, time.perf_counter() - started


def artifact_record(artifact) -> dict:
    return {"format": build_pb2.ArtifactFormat.Name(artifact.format).removeprefix("ARTIFACT_FORMAT_").lower(),
            "batch_size": artifact.batch_size, "platform": artifact.platform, "size_bytes": artifact.size_bytes,
            "build_seconds": round(artifact.build_seconds, 3), "cache_hit": artifact.cache_hit}


def build_record(build) -> dict:
    return {"target_type": build.target_type, "rule": build.rule.name,
            "compute_dtype": build.rule.build.compute_dtype, "matmul_precision": build.rule.build.matmul_precision,
            "tolerance": build.rule.build.tolerance, "xla_options": dict(build.rule.build.xla_options),
            "device_ids": list(build.device_ids), "portable": artifact_record(build.portable),
            "executables": [artifact_record(a) for a in build.executables],
            # A local backend gets executables; the GPU's (the compile service runs on the CPU) the
            # portable StableHLO alone, which the worker compiles for its device.
            "worker_finishes_compile": not build.executables}


# -- (c) the job and its reference -----------------------------------------------------------------


def run_job(client: MeshClient, tokens: np.ndarray, filter_text: str, timeout_s: float,
            data_path: str) -> tuple[dict, np.ndarray | None]:
    """One job on `data_path`; its wall time counts the client's puts and fetches of the direct path."""
    started = time.perf_counter()
    try:
        result = client.run(PROGRAM, {"tokens": tokens}, parameter_seed=PARAMETER_SEED, filter=filter_text,
                            timeout=timeout_s, data_path=data_path)
    except grpc.RpcError as exc:
        return {"ok": False, "asked_data_path": data_path, "error": f"{exc.code().name}: {exc.details()}"}, None
    wall = time.perf_counter() - started
    job = result.job
    ok = job.state == job_pb2.JOB_STATE_SUCCEEDED and "logits" in result.outputs
    record = {
        "ok": ok, "job_id": job.job_id, "state": job_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower(),
        "error": job.error, "wall_seconds": round(wall, 4), "measured_seconds": round(job.measured_seconds, 4),
        # Which path the bytes took (JobResult.data_path) and, on the direct one, how many went each
        # way (object_client.SHARED, .STREAMED), beside the tensors' own sizes.
        "asked_data_path": data_path, "data_path": result.data_path, "moved_bytes": dict(result.moved_bytes),
        "input_bytes": tokens.nbytes, "output_bytes": sum(v.nbytes for v in result.outputs.values()),
        "predicted_seconds": round(job.plan.predicted_seconds, 6),
        "targets": [{"target_type": t.target_type, "rule": t.rule, "compute_dtype": t.compute_dtype,
                     "device_ids": list(t.device_ids), "rate_source": t.rate_source} for t in job.plan.targets],
        "shards": [{"index": s.index, "device_id": s.device_id, "rule": s.rule, "rows": s.rows,
                    "attempts": s.attempts, "failures": list(s.failures), "queue_seconds": round(s.queue_seconds, 4),
                    "load_seconds": round(s.load_seconds, 4), "execute_seconds": round(s.execute_seconds, 4),
                    "total_seconds": round(s.total_seconds, 4)} for s in job.shards],
    }
    return record, result.outputs.get("logits") if ok else None


def compare(outputs: np.ndarray, reference: np.ndarray, tolerance: float) -> dict:
    """Max abs error and max abs error over the reference's largest magnitude (the demo's measure,
    which the rules' tolerances bound)."""
    if outputs.shape != reference.shape:
        return {"ok": False, "error": f"shape {list(outputs.shape)}, the reference's {list(reference.shape)}"}
    finite = bool(np.all(np.isfinite(outputs)))
    max_abs = float(np.max(np.abs(outputs.astype(np.float64) - reference)))
    relative = max_abs / float(np.max(np.abs(reference)))
    return {"ok": finite and relative <= tolerance, "max_abs_error": max_abs, "relative_error": relative,
            "tolerance": tolerance, "all_finite": finite}


def per_device_throughput(job: dict) -> dict:
    devices: dict[str, dict] = {}
    for shard in job["shards"]:
        d = devices.setdefault(shard["device_id"], {"rows": 0, "execute_seconds": 0.0, "shard_seconds": 0.0})
        d["rows"] += shard["rows"]
        d["execute_seconds"] += shard["execute_seconds"]
        d["shard_seconds"] += shard["total_seconds"] - shard["queue_seconds"]
    for d in devices.values():
        d["rows_per_s_execute"] = round(d["rows"] / d["execute_seconds"], 1) if d["execute_seconds"] > 0 else None
        d["rows_per_s_shard"] = round(d["rows"] / d["shard_seconds"], 1) if d["shard_seconds"] > 0 else None
    return devices


# -- (d) the baseline: the artifact on the device in a child process -------------------------------


def fetch_inputs(stub, portable, timeout_s: float) -> tuple[bytes, list[np.ndarray]]:
    """The portable artifact (checked against the digest Compile announced, as a worker checks it)
    and the program's initial parameters, in the program's order."""
    data = b"".join(part.chunk for part in stub.FetchArtifact(compile_pb.FetchArtifactRequest(key=portable.key),
                                                                timeout=timeout_s))
    if hashlib.sha256(data).hexdigest() != portable.digest:
        raise AccelmeshError(f"artifact {portable.key} does not hash to the digest Compile announced")
    parameters = TensorCollector("parameter").collect(stub.FetchParameters(
        compile_pb.FetchParametersRequest(program=PROGRAM, seed=PARAMETER_SEED), timeout=timeout_s))
    return data, list(parameters.values())


def run_baseline(folder: Path, build, execution_device: str, arguments: list[np.ndarray], data: bytes, mode: str,
                 timeout_s: float) -> tuple[dict, np.ndarray | None]:
    (folder / "artifact.bin").write_bytes(data)
    (folder / "build.pb").write_bytes(build.rule.build.SerializeToString())
    np.savez(folder / "arguments.npz", *arguments)
    command = [sys.executable, str(Path(__file__).resolve()), "--role", "device", "--folder", str(folder),
               "--execution-device", execution_device]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **worker_env(mode)})
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer in {timeout_s:.0f} s"}, None
    if done.returncode != 0:
        return {"ok": False, "error": f"exit {done.returncode}", "output_tail": done.stderr.splitlines()[-20:]}, None
    record = json.loads(done.stdout)
    with np.load(folder / "outputs.npz") as outputs:
        return {"ok": True, **record}, outputs["arr_0"]


def device_role(folder: Path, execution_device: str) -> dict:
    """The child: compile and time the artifact on one device of this process, as the worker does."""
    import jaxlib

    from accelmesh.artifacts import compile_portable, load_portable
    from accelmesh.runtime.programs import build_options_from_proto

    backend, _, index = execution_device.partition(":")
    device = next(d for d in jax.devices(backend) if d.id == int(index))
    options = build_options_from_proto(build_pb2.BuildOptions.FromString((folder / "build.pb").read_bytes()))
    with np.load(folder / "arguments.npz") as stored:
        arguments = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    started = time.perf_counter()
    compiled = compile_portable(load_portable((folder / "artifact.bin").read_bytes()), options, *arguments,
                                device=device)
    compile_s = time.perf_counter() - started

    def call() -> list[np.ndarray]:
        outputs = jax.block_until_ready(compiled(*jax.device_put(arguments, device)))
        return [np.asarray(leaf) for leaf in jax.tree.leaves(outputs)]

    outputs = call()
    seconds = []
    for _ in range(BASELINE_CALLS):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    np.savez(folder / "outputs.npz", *outputs)
    best = min(seconds)
    rows = arguments[-1].shape[0]
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "jax_devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
            "device": f"{device.platform}:{device.id} {device.device_kind}", "compile_seconds": round(compile_s, 3),
            "call_seconds_min": round(best, 5), "call_seconds": [round(s, 5) for s in seconds],
            "rows": rows, "rows_per_s": round(rows / best, 1)}


# -- the run ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str  # GPU or CPU
    rows: int
    budget_s: float  # the whole check
    emulate: str  # CPU: the catalog profile the worker emulates
    fake_nvml: Path  # CPU: the fake pynvml's file
    started: float = dataclasses.field(default_factory=time.monotonic)

    def left_s(self) -> float:
        """What is left of the budget: the timeout of the next call (at least a second)."""
        return max(1.0, self.started + self.budget_s - time.monotonic())

    @property
    def job_filter(self) -> str:
        if self.mode == GPU:
            return 'platform = "cuda" AND emulated = false'
        return f'type = "{self.emulate}" AND emulated = true'


def machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
            "jax": jax.__version__, "grpc": grpc.__version__, "numpy": np.__version__}


def run_check(settings: Settings) -> dict:
    started = time.perf_counter()
    mode = settings.mode
    result: dict = {"failures": [], "notes": []}
    progress(f"(a) NVML probe through {'the real driver (pynvml)' if mode == GPU else settings.fake_nvml}")
    probed: list[ProbedGpu] = []
    if mode == GPU:
        guarded(result, lambda: probed.extend(probe_gpus(None, NODE_IP)))
    else:
        guarded(result, lambda: probed.extend(probe_gpus(load_fake_nvml(settings.fake_nvml), FAKE_NODE_IP)))
    if not probed:
        result["failures"].append("NVML found no NVIDIA GPU (no driver, or no GPU visible to this process)")
    else:
        with tempfile.TemporaryDirectory(prefix="accelmesh-gpu-check-") as tmp:
            guarded(result, lambda: check_mesh(result, settings, probed, Path(tmp)))
    result["notes"] += diagnose(probed)
    nvml = {"driver": "pynvml (the real driver)" if mode == GPU else f"fake: {settings.fake_nvml}",
            "node_ip": NODE_IP if mode == GPU else FAKE_NODE_IP, "gpus": [g.record() for g in probed],
            "ok": bool(probed)}
    return {
        "benchmark": "gpu_check", "mode": mode, "emulated": mode == CPU,
        "mode_description": (
            "real NVIDIA GPU: NVML on its driver, the worker running the job on the GPU" if mode == GPU else
            f"CPU only, no GPU used: NVML probed through the fake table of {settings.fake_nvml}, the job on a "
            f"CPU device emulating {settings.emulate} (listed emulated)"),
        "ok": not result["failures"], "failures": result.pop("failures"), "notes": result.pop("notes"),
        "summary": summary(nvml, result),
        "machine": machine(),
        "setup": {"program": PROGRAM, "rows": settings.rows, "parameter_seed": PARAMETER_SEED,
                  "budget_s": settings.budget_s, "job_filter": settings.job_filter,
                  "security": "mutual TLS + bearer tokens on every hop (the embedded mesh's own CA)",
                  "processes": "inventory, compile, one worker, dispatch (python -m ...) on loopback; "
                               "JAX_PLATFORMS=cpu in all but the worker and the baseline's child",
                  "worker_env": worker_env(mode)},
        "nvml": nvml,
        **result,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def guarded(result: dict, step) -> None:
    """Run `step`; anything it raises is a failure in the JSON: the one run on a GPU machine must
    say how far it got."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 (whatever it is, it is reported with its traceback)
        result["failures"].append(f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc().splitlines()[-40:]


def check_mesh(result: dict, settings: Settings, probed: list[ProbedGpu], tmp: Path) -> None:
    progress("(b) starting inventory, compile, worker and dispatch (mutual TLS)")
    with start_mesh(tmp / "mesh", settings.mode, settings.emulate) as mesh:
        guarded(result, lambda: check_steps(result, settings, probed, mesh, tmp))
        if result["failures"]:
            processes = [mesh.inventory, mesh.compile, *mesh.workers, mesh.dispatch]
            result["process_output_tails"] = {p.name: p.tail(OUTPUT_TAIL_LINES).splitlines()
                                              for p in processes if p is not None}


def check_steps(result: dict, settings: Settings, probed: list[ProbedGpu], mesh: EmbeddedMesh, tmp: Path) -> None:
    failures, rows = result["failures"], settings.rows
    with open_channel(mesh.inventory.address, security=mesh.client) as channel:
        listed = list_all_devices(inventory_stub(channel), settings.job_filter)
    result["mesh_devices"] = [mesh_device(d) for d in listed]
    check_registration(settings.mode, probed, {d.id: d for d in listed}, failures)
    if not listed:
        failures.append(f"the inventory lists no device for the job ({settings.job_filter})")
        return

    progress("(b) Compile for the job's devices and the probed GPUs")
    with open_channel(mesh.compile.address, security=mesh.client) as channel:
        stub = compile_service_pb2_grpc.CompileServiceStub(channel)
        ids = {d.id for d in listed}
        targets = [*listed, *(device_to_proto(g.spec, g.sample) for g in probed if g.spec.id not in ids)]
        response, seconds = compile_targets(stub, targets, rows, settings.left_s())
        builds = {device_id: build for build in response.builds for device_id in build.device_ids}
        job_build = builds[listed[0].id]
        result["compile"] = {"rpc_seconds": round(seconds, 3), "job_target_type": job_build.target_type,
                             "builds": [build_record(b) for b in response.builds]}
        for gpu in probed:
            rule = builds[gpu.spec.id].rule
            gpu.facts.update(rule=rule.name, compute_dtype=rule.build.compute_dtype,
                             peak_tflops_at_rule_dtype=gpu.spec.performance.rate_tflops(rule.build.compute_dtype))
        data, parameters = fetch_inputs(stub, job_build.portable, settings.left_s())

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(rows, SEQ_LEN), dtype=np.int32)
    progress(f"(c) {PROGRAM} over {rows} rows on the direct data path, twice, then once on the relay path")
    with MeshClient(mesh.dispatch.address, security=mesh.client) as client:
        runs = [run_job(client, tokens, settings.job_filter, settings.left_s(), DIRECT) for _ in range(2)]
        relayed = run_job(client, tokens, settings.job_filter, settings.left_s(), RELAY)
    result["job"] = {"data_path": DIRECT, "runs": [record for record, _ in runs], "relay_run": relayed[0],
                     "ok": all(record["ok"] for record, _ in [*runs, relayed])}
    progress("(c) the CPU fp32 reference in this process")
    reference_started = time.perf_counter()
    (reference,) = reference_outputs(mesh.compile.address, PROGRAM, [tokens], parameter_seed=PARAMETER_SEED,
                                     security=mesh.client, chunk_rows=REFERENCE_CHUNK_ROWS)
    tolerance = job_build.rule.build.tolerance
    checked = [compare(outputs, reference, tolerance) if outputs is not None else {"ok": False, "error": "no outputs"}
               for _, outputs in [*runs, relayed]]
    result["accuracy"] = {
        "reference": "default-fp32 rule (highest matmul precision) run on this process's CPU (accelmesh/reference.py)",
        "reference_seconds": round(time.perf_counter() - reference_started, 3),
        "rule": job_build.rule.name, "compute_dtype": job_build.rule.build.compute_dtype, "tolerance": tolerance,
        "runs": checked[:-1], "relay_run": checked[-1], "ok": all(c["ok"] for c in checked)}
    for index, ((record, _), check) in enumerate(zip([*runs, relayed], checked), start=1):
        name = f"job run {index} ({record['asked_data_path']})"
        if not record["ok"]:
            failures.append(f"{name} failed: {record['error'] or record['state']}")
        elif not check["ok"]:
            failures.append(f"{name}: logits outside {job_build.rule.name}'s tolerance {tolerance:g} of "
                            "the CPU fp32 reference")

    device = listed[0].execution_device
    progress(f"(d) baseline: the {job_build.rule.name} artifact on {device} in a child process")
    baseline, outputs = run_baseline(tmp, job_build, device, [*parameters, tokens], data, settings.mode,
                                     settings.left_s())
    if outputs is not None:
        baseline["accuracy"] = compare(outputs, reference, tolerance)
        baseline["ok"] = baseline["accuracy"]["ok"]
    result["baseline"] = baseline
    if not baseline["ok"]:
        failures.append(f"baseline on {device} failed: "
                        f"{baseline.get('error') or 'outside the tolerance of the CPU fp32 reference'}")
    result["throughput"] = throughput(result["job"]["runs"][-1], result["job"]["relay_run"], rows, baseline)


def check_registration(mode: str, probed: list[ProbedGpu], listed: dict, failures: list[str]) -> None:
    """GPU: every GPU probed here is in the inventory as the worker registered it, the same."""
    for gpu in probed:
        if mode == CPU:
            gpu.facts["registered_by_worker"] = None  # its worker runs without NVML; the fake is this process's
            continue
        device = listed.get(gpu.spec.id)
        same = device is not None and (device.type, sorted(device.capabilities)) == (gpu.spec.type,
                                                                                    sorted(gpu.spec.capabilities))
        gpu.facts["registered_by_worker"] = same
        if not same:
            failures.append(f"{gpu.spec.id} ({gpu.spec.kind}) probed here is "
                            + ("not in the inventory" if device is None else "in the inventory with another type or "
                               "capabilities"))


def throughput(warm: dict, relayed: dict, rows: int, baseline: dict) -> dict:
    """The warm direct job's figures beside the bare device's, and the job's rows/s on each data
    path (the warm direct run's, the relay run's) as ratios to it."""
    if not warm["ok"]:
        return {"note": "the warm job failed: no figures of the mesh",
                "baseline_rows_per_s": baseline.get("rows_per_s")}
    devices = per_device_throughput(warm)
    base = baseline.get("rows_per_s") or 0
    by_path = {record["asked_data_path"]: {"job_rows_per_s": round(rows / record["wall_seconds"], 1),
                                           "ratio_job_over_baseline": ratio(rows / record["wall_seconds"], base)}
               for record in (warm, relayed) if record["ok"]}
    return {
        "run": "the second (warm) job, on the direct data path", "data_path": warm["data_path"],
        "moved_bytes": warm["moved_bytes"], "per_device": devices,
        "job_rows_per_s": by_path[DIRECT]["job_rows_per_s"], "baseline_rows_per_s": base or None,
        "ratio_device_execute_over_baseline": {d: ratio(v["rows_per_s_execute"] or 0, base)
                                               for d, v in devices.items()},
        "ratio_job_over_baseline": by_path[DIRECT]["ratio_job_over_baseline"],
        "by_data_path": by_path,
    }


def diagnose(probed: list[ProbedGpu]) -> list[str]:
    """What the probe alone says will stop a job, so the one run on a GPU machine says why."""
    return [f"{g.spec.id} ({g.spec.kind}) is not in the catalog and NVML states no peak rate, so the dispatcher "
            f"cannot price it and refuses to plan a job on it; an entry whose kind is {g.spec.kind!r} in "
            "accelmesh/hardware/catalog.toml would give it its rates"
            for g in probed if not g.dispatch_can_plan]


def summary(nvml: dict, result: dict) -> dict:
    builds = {b["target_type"]: b for b in result.get("compile", {}).get("builds", [])}
    build = builds.get(result.get("compile", {}).get("job_target_type"))
    runs = result.get("job", {}).get("runs", [])
    errors = [r["relative_error"] for r in result.get("accuracy", {}).get("runs", []) if "relative_error" in r]
    flow = result.get("throughput", {})
    return {
        "gpus_found": [f"{g['spec']['kind']} ({g['spec']['type']}, compute capability "
                       f"{g['spec']['compute_capability']}, {g['spec']['performance']['memory_bytes'] / 2**30:.1f} GiB)"
                       for g in nvml["gpus"]],
        "job_devices": [f"{d['id']} {d['type']}" + (" (emulated)" if d["emulated"] else "")
                        for d in result.get("mesh_devices", [])],
        "rule": build and build["rule"], "compute_dtype": build and build["compute_dtype"],
        "tolerance": build and build["tolerance"],
        "compile_seconds": build and round(build["portable"]["build_seconds"]
                                           + sum(a["build_seconds"] for a in build["executables"]), 3),
        "worker_finishes_compile": build and build["worker_finishes_compile"],
        "worker_load_seconds_first_run": max((s["load_seconds"] for s in runs[0].get("shards", [])), default=None)
        if runs else None,
        "jobs_succeeded": sum(r["ok"] for r in runs), "jobs_run": len(runs),
        "relay_job_succeeded": result.get("job", {}).get("relay_run", {}).get("ok"),
        "relative_error_max": max(errors, default=None),
        "within_tolerance": result.get("accuracy", {}).get("ok"),
        "device_rows_per_s_execute": {d: v["rows_per_s_execute"] for d, v in flow.get("per_device", {}).items()},
        "data_path": flow.get("data_path"), "moved_bytes": flow.get("moved_bytes"),
        "job_rows_per_s": flow.get("job_rows_per_s"),
        "job_rows_per_s_relay": flow.get("by_data_path", {}).get(RELAY, {}).get("job_rows_per_s"),
        "baseline_rows_per_s": result.get("baseline", {}).get("rows_per_s"),
        "ratio_job_over_baseline": flow.get("ratio_job_over_baseline"),
        "ratio_job_over_baseline_relay": flow.get("by_data_path", {}).get(RELAY, {}).get("ratio_job_over_baseline"),
        "baseline_within_tolerance": result.get("baseline", {}).get("ok"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="no GPU: the fake NVML table and a worker emulating --emulate on the CPU")
    parser.add_argument("--rows", type=int, default=0,
                        help=f"token sequences in the job (default {DEFAULT_ROWS[GPU]}, --cpu {DEFAULT_ROWS[CPU]})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds the whole check may take (default {DEFAULT_BUDGET_S:.0f}); each call "
                             "gets what is left")
    parser.add_argument("--emulate", default=DEFAULT_EMULATE, help="--cpu: the catalog profile the worker emulates")
    parser.add_argument("--fake-nvml", type=Path, default=ROOT / "tests" / "fakes" / "nvml.py",
                        help="--cpu: the file of the table-driven fake pynvml")
    parser.add_argument("--role", choices=("check", "device"), default="check", help="internal: the baseline's child")
    parser.add_argument("--folder", type=Path, help="internal: the baseline's files")
    parser.add_argument("--execution-device", default="", help="internal: the baseline's device")
    args = parser.parse_args(argv)
    if args.role == "device":
        json.dump(device_role(args.folder, args.execution_device), sys.stdout)
        return 0
    if args.rows < 0:
        parser.error("--rows must be positive")
    # The CPU host: this process (its reference is CPU fp32) and the inventory, compile service and
    # dispatcher started from it, whose environment they inherit; the worker's is worker_env's.
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    mode = CPU if args.cpu else GPU
    if mode == CPU and not args.fake_nvml.is_file():
        parser.error(f"--fake-nvml {args.fake_nvml}: no such file (the repository's is tests/fakes/nvml.py)")
    result = run_check(Settings(mode, args.rows or DEFAULT_ROWS[mode], args.timeout, args.emulate, args.fake_nvml))
    json.dump(result, sys.stdout, indent=2)
    print()
    for failure in result["failures"]:
        progress(f"FAILED: {failure}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
