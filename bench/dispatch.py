"""Dispatch benchmark: what the mesh adds per shard and per byte, and what its planner buys and costs.

    .venv/bin/python bench/dispatch.py [--quick] [--no-ray] [--only verification|large-direct]

Prints one JSON document on stdout (progress on stderr). Every figure comes from this run, and
each is set beside a baseline measured in the same run (STYLE rule 12):

(a) per_shard_overhead: the embedded mesh as real processes (inventory, compile, one worker with
    2 CPU devices emulating V100s, dispatch) on loopback. A dispatcher started with
    ACCELMESH_MAX_SHARD_BYTES=32 KiB cuts a job of K x rows_per_shard rows into K shards (the
    planner caps a shard at max_shard_bytes // row bytes), and `max_devices=1` puts them all on one
    device, which runs them one after another, so per-shard time is not hidden by parallelism.
    After a warm-up job (artifacts compiled, fetched and loaded), the shards' ShardRecord
    (total, queue, load, execute seconds as the dispatcher saw them) and job wall / K are set
    against the same compiled function called in this process: jax.jit of the program with the
    device's rule applied, its XLA options, at the same batch size, input put on the device,
    block_until_ready, outputs back to numpy (parameters stay resident). Two finer baselines
    split the remainder: one shard sent by the dispatcher's own GrpcWorkers.execute from this
    process (no job around it, so one ExecuteMany call per shard; every input in full, and again
    with the parameters held by the worker as the dispatcher sends an inference job's shards), and
    one bare grpcio bidirectional
    stream call of the full request's size to a plain echo process (the floor any streaming RPC
    pays here).
(b) streaming: a 256 MiB `identity` job (float32 rows of 4 KiB) client -> dispatch -> worker ->
    dispatch -> client through a dispatcher with default settings, against a bare grpcio pipeline
    of the same shape in separate processes (this file run as `--role relay` and `--role sink`:
    the relay forwards the client's stream to the sink, the sink echoes it, the relay streams the
    echo back) with the same 1 MiB chunks and 16 MiB message limits. MB/s = input bytes / wall
    time (each arm carries the input there and back). The arms alternate. The dispatcher's peak
    RSS during the job (VmHWM, reset before it through /proc/<pid>/clear_refs) and sampled
    VmRSS / RssAnon / RssFile, at 64 MiB and at 256 MiB, show whether memory follows the input;
    CPU seconds per process show where the time goes. Then 32 MiB and 128 MiB jobs through a third
    dispatcher whose in-flight budget is 8 MiB: do they finish, and does the peak stay put?
(c) gavel_weighted_vs_equal and (d) pai_planning_cost: bench/planning.py's own functions, run
    here (see that file); skipped with a note when ../shared/data is absent.
(e) security: the mesh above runs as in production, mutual TLS + bearer tokens on every hop. A
    second mesh of the same processes, started insecure (plaintext, no authentication), runs the
    same per-shard overhead jobs (each program on both meshes, the order swapped per program) and
    is a third arm of the streaming job (streaming.mesh_plaintext, alternating with the other
    two); `security` sets each figure TLS beside plaintext with their ratio, and
    summary.security_cost gives overhead ms/shard, streaming MB/s and dispatcher peak RSS both
    ways. The bare-gRPC baselines are plaintext, as before.
(f) ray: when Ray is installed (`pip install -e '.[bench]'`; else the JSON's `ray` says how, and
    `--no-ray` leaves it out), the same shapes through a local Ray started by bench/ray_baseline.py:
    one actor per worker device (WORKER_DEVICES), each holding a jax.jit of the program the mesh
    runs on its CPU device, parameters put there once, compiled before timing. Per shard: the
    per-shard jobs' inputs in the same K shards, submitted all to one actor then fetched together
    (async; one device, as max_devices=1) and one at a time, ms per shard = run wall / K beside the
    mesh's job wall / K; interleaved with the mesh arms (TLS, plaintext, Ray, then reversed for the
    next program). Streaming: the same 256 MiB in 8 MiB pieces, all submitted round-robin over the
    actors and each result copied into one output as it is fetched, a fourth arm of the rotation.
    `ray` holds the figures and mesh / Ray ratios (per-shard cost: below 1 is cheaper than Ray;
    MB/s: above 1 is faster), summary.vs_ray the compact view with the bare-gRPC floors beside.
    Ray's idle processes share the machine during the mesh arms too, as the meshes share it
    during Ray's.
(g) streaming.host_fresh_memory: how fast this machine gives a process memory it touches for the
    first time, right after a free and after a few idle seconds (common.fresh_memory). Every arm
    writes its output into fresh memory, and the mesh's processes their shards' buffers too; on a
    virtual machine that hands free pages back to its host, memory touched after a pause costs
    about fifty times more, so read the streaming figures beside it.
(h) verification: the cost of spot checks (ACCELMESH_VERIFY_FRACTION; spec.verify_fraction here).
    A mesh of its own: inventory, compile and two workers on different node addresses
    (127.0.0.1 and 127.0.0.2, one emulated V100 each, so a sampled shard can run again on the other
    node), one dispatcher with ACCELMESH_MAX_SHARD_BYTES=32 KiB. mlp_classifier jobs of K shards of
    128 rows at fractions 0, 0.05 and 0.2, rotated so each fraction runs as often after each other;
    job wall per shard, the shards verified (from the record), and throughput as a ratio to
    fraction 0 measured in the same rotation. `--only verification` runs this section alone.
(i) large_direct_job: a DATA_PATH_DIRECT `identity` job of 1 GiB in and out (`--quick`: 128 MiB)
    through the default dispatcher, twice (the first on fresh memory everywhere). The
    dispatcher's peak RSS over idle (VmHWM, as in (b)) is set against the issue's 64 MiB, and the
    worker store's peak, sampled every 10 ms as the allocated bytes of its segment files, against
    the store's bound. `--only large-direct` runs this section alone.
The per-shard jobs of (a) and the streaming job of (b) also run with DATA_PATH_DIRECT (the
`tls-direct` arms: the client puts to and fetches from the worker's store, the dispatcher sends
descriptors), beside the relayed ones and Ray in the same rotation.
Compare ratios across machines, not milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

# bench/common.py: this file runs from bench/, which Python puts first on sys.path
from common import fresh_memory, tls_vs_plaintext

# bench/ray_baseline.py: Ray is imported there only when a baseline starts, so the bare roles stay bare
from ray_baseline import (
    ABSENT_NOTE,
    STREAM_PIECE_BYTES,
    RayBaseline,
    measure_per_shard,
    object_store_bytes,
    ray_version,
)

from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, channel_options

# The relay and sink roles run this file as bare gRPC processes: the mesh, jax and the planner
# are imported only by the benchmark role (in run_benchmark), so those processes stay bare.

MIB = 1024 * 1024
CHUNK_BYTES = 1 * MIB  # MeshClient's and the dispatcher's default chunk; the bare pipeline uses it too
MAX_MESSAGE_BYTES = DEFAULT_MAX_MESSAGE_BYTES  # the mesh's limit on every hop; the bare pipeline's too
SMALL_SHARD_BYTES = 32 * 1024  # ACCELMESH_MAX_SHARD_BYTES of the per-shard dispatcher
WORKER_DEVICES = 2
EMULATE = ("v100-32gb", "v100-32gb")  # fp32 rule: identity stays bit-exact, the local baseline is fp32 too
OVERHEAD_PROGRAMS = (("identity", 8), ("mlp_classifier", 128))  # (program, rows per shard): 32 KiB of input each
STREAM_PROGRAM = "identity"
BIT_EXACT_PROGRAMS = ("identity",)  # the Ray arm's results must equal these bit for bit; the rest within 1e-5
STAGE_MESSAGES = ("queued", "loading", "running", "done")  # ExecuteResponse.stage, one message each
MEMORY_PROBE_BYTES = 64 * MIB  # a smaller job first, so peak RSS is seen against input size
STREAM_TIMEOUT_S = 120.0
# A dispatcher whose in-flight budget is far below the job: its memory should follow the budget.
BOUNDED_ENV = {"ACCELMESH_INFLIGHT_BYTES": 8 * MIB, "ACCELMESH_MAX_SHARD_BYTES": 2 * MIB}
BOUNDED_INPUT_BYTES = (32 * MIB, 128 * MIB)  # in this order: the peak after the larger one is the test
BOUNDED_TIMEOUT_S = 30.0  # a few seconds of work here: a job still running by then has stalled
OVERHEAD_GOAL_MS = 5.0
STREAM_GOAL_RATIO = 0.5  # mesh MB/s over bare MB/s
PIPE_SERVICE = "bench.dispatch.Pipe"
PIPE_METHOD = f"/{PIPE_SERVICE}/Stream"
READY = re.compile(r"bench-dispatch: (?P<role>\w+) listening on (?P<address>\S+)")
RPC_TIMEOUT_S = 300.0
RELAY_FLOOR_CALLS = 5  # pipelined relay calls of K shards per program and mesh, after one warm-up
RSS_SAMPLE_S = 0.01
LARGE_DIRECT_GROWTH_LIMIT = 64 * MIB  # the dispatcher's peak RSS over idle for the large direct job, at most
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Plan:
    shards: int  # K: shards of each per-shard job
    shard_jobs: int  # timed K-shard jobs per program (their shards pooled)
    one_shard_jobs: int  # timed one-shard jobs per program: the per-job fixed cost
    local_calls: int
    direct_calls: int
    floor_calls: int
    stream_bytes: int
    stream_reps: int  # timed runs per arm, alternating
    pai_runs: int
    large_direct_bytes: int = 1024 * MIB  # the one direct job whose dispatcher and store memory is followed


FULL = Plan(shards=200, shard_jobs=3, one_shard_jobs=9, local_calls=2000, direct_calls=300, floor_calls=300,
            stream_bytes=256 * MIB, stream_reps=3, pai_runs=25)
QUICK = Plan(shards=40, shard_jobs=1, one_shard_jobs=3, local_calls=300, direct_calls=40, floor_calls=40,
             stream_bytes=256 * MIB, stream_reps=1, pai_runs=4, large_direct_bytes=128 * MIB)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- statistics (same conventions as bench/inventory.py and bench/compile.py) ---------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was really measured."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def summary_ms(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": round(percentile(ms, 50), 3), "p95_ms": round(percentile(ms, 95), 3),
            "min_ms": round(min(ms), 3), "mean_ms": round(sum(ms) / len(ms), 3), "n": len(ms)}


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 else None


def time_calls(call: Callable[[], object], n: int, warmup: int = 5) -> list[float]:
    """Wall seconds of `n` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


# -- /proc: memory and CPU of the processes under test --------------------------------------------


def proc_status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, our own processes); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Largest VmRSS / RssAnon / RssFile of a process seen while running, polled every 10 ms."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, pid: int):
        self.pid = pid
        self.peak_kib = dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        status = proc_status_kib(self.pid)
        for key in self.FIELDS:
            self.peak_kib[key] = max(self.peak_kib[key], status.get(key, 0))

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self._sample()


class StoreSampler(RssSampler):
    """Largest total of a worker's store segments seen while running (their allocated bytes: the
    objects' and the pooled ones', which count in the store's bound alike), polled every 10 ms."""

    def __init__(self, pid: int, root: str = "/dev/shm"):
        super().__init__(pid)
        from worker_svc.segments import SEGMENT_PREFIX

        self.root, self.prefix, self.peak_bytes = root, f"{SEGMENT_PREFIX}{pid}-", 0

    def _sample(self) -> None:
        total = 0
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(self.prefix):
                    with contextlib.suppress(FileNotFoundError):  # freed while listed
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
        self.peak_bytes = max(self.peak_bytes, total)


def bench_large_direct(mesh: Mesh, plan: Plan) -> dict:
    """DATA_PATH_DIRECT jobs of plan.large_direct_bytes in and out through the default dispatcher,
    twice (the first takes fresh memory everywhere, the second finds the store's pool and the
    allocators warm): the dispatcher's peak RSS over idle, and the worker store's peak against its bound."""
    from accelmesh.client import MeshClient
    from compile_svc.programs.builtin import IDENTITY_WIDTH
    from worker_svc.config import WorkerConfig

    rows = plan.large_direct_bytes // (IDENTITY_WIDTH * 4)
    data = np.random.default_rng(13).standard_normal((rows, IDENTITY_WIDTH), dtype=np.float32)
    bound = WorkerConfig.store_bytes  # the bench's worker runs with the default (ACCELMESH_WORKER_STORE_BYTES unset)
    runs = []
    with MeshClient(mesh.default.address, security=mesh.client, chunk_bytes=CHUNK_BYTES,
                    max_message_bytes=MAX_MESSAGE_BYTES) as client:
        client.run(STREAM_PROGRAM, {"x": data[:1024]}, timeout=STREAM_TIMEOUT_S, data_path="direct")  # warm
        for label in ("first", "again"):
            progress(f"large direct job ({label}): {data.nbytes // MIB} MiB in and out, the dispatcher's and the "
                     "store's memory")
            with StoreSampler(mesh.worker.process.pid) as store:
                run = mesh_stream(mesh.default, mesh.worker, client, data, timeout_s=10 * STREAM_TIMEOUT_S,
                                  data_path="direct")
            runs.append({
                "run": label, "seconds": round(run["seconds"], 3), "mb_per_s": mbps(data.nbytes, run["seconds"]),
                "equal": run["equal"], "shards": run["shards"], "devices": run["devices"],
                "cpu_s": {k: round(v, 3) for k, v in run["cpu_s"].items()},
                "dispatcher_memory": run["dispatch_memory"], "worker_memory": run["worker_memory"],
                "worker_store_sampled_peak_bytes": store.peak_bytes})
    growth = max(r["dispatcher_memory"]["rise_bytes"] for r in runs)
    store_peak = max(r["worker_store_sampled_peak_bytes"] for r in runs)
    return {
        "program": STREAM_PROGRAM, "input_bytes": data.nbytes, "output_bytes": data.nbytes,
        "mb_per_s_definition": "input bytes / 1e6 / wall seconds of the whole call (the same bytes also come back)",
        "runs": runs,
        "equal": all(r["equal"] for r in runs),
        "bytes_moved_by_the_client_so_far": dict(client._direct.objects.moved_bytes),
        "dispatcher_max_growth_bytes": growth,
        "dispatcher_growth_limit_bytes": LARGE_DIRECT_GROWTH_LIMIT,
        "dispatcher_growth_within_limit": growth < LARGE_DIRECT_GROWTH_LIMIT,
        "worker_store": {"bound_bytes": bound, "sampled_peak_bytes": store_peak, "within_bound": store_peak <= bound,
                         "ratio_peak_over_input": ratio(store_peak, data.nbytes),
                         "sampled": f"segment files {store.prefix}* under {store.root}, allocated bytes, "
                                    f"every {RSS_SAMPLE_S * 1e3:.0f} ms (a shorter peak may be missed)"},
    }


# -- the bare pipeline: relay and sink processes ---------------------------------------------------


def serve_role(role: str, listen: str, sink: str) -> None:
    """A plain grpcio server whose one stream-stream method echoes (sink) or forwards (relay).

    No serializers: messages stay the raw bytes the client sent, nothing is parsed or copied in
    Python beyond what grpcio itself does. Same thread pool size and limits as the mesh servers.
    """
    options = channel_options(MAX_MESSAGE_BYTES)
    if role == "sink":
        def stream(requests, context):
            yield from requests
    else:
        downstream = grpc.insecure_channel(sink, options=options).stream_stream(PIPE_METHOD)

        def stream(requests, context):
            yield from downstream(requests, timeout=RPC_TIMEOUT_S)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        PIPE_SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port(listen)
    server.start()
    print(f"bench-dispatch: {role} listening on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()


@dataclass
class RoleProcess:
    role: str
    process: subprocess.Popen
    address: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_role(role: str, *args: str) -> RoleProcess:
    process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", role, *args],
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = READY.search(line)
    if match is None:
        process.kill()
        process.wait()
        raise RuntimeError(f"the {role} process did not start (exit code {process.returncode}): {line!r}")
    return RoleProcess(role, process, match["address"])


def pipe_stub(address: str):
    return grpc.insecure_channel(address, options=channel_options(MAX_MESSAGE_BYTES)).stream_stream(PIPE_METHOD)


def bare_stream(pipe, data: np.ndarray) -> tuple[float, bool]:
    """One pass of `data` through the bare pipeline in CHUNK_BYTES messages; (seconds, echo equal)."""
    flat = memoryview(data.reshape(-1).view(np.uint8))
    received = bytearray(len(flat))

    def requests() -> Iterator[bytes]:
        for offset in range(0, len(flat), CHUNK_BYTES):
            yield flat[offset: offset + CHUNK_BYTES].tobytes()

    start = time.perf_counter()
    position = 0
    for message in pipe(requests(), timeout=RPC_TIMEOUT_S):
        received[position: position + len(message)] = message
        position += len(message)
    seconds = time.perf_counter() - start
    return seconds, position == len(flat) and received == flat


# -- the mesh ---------------------------------------------------------------------------------------


@dataclass
class Mesh:
    inventory: object
    compile: object
    worker: object
    small_shards: object  # dispatch with ACCELMESH_MAX_SHARD_BYTES=SMALL_SHARD_BYTES
    default: object  # dispatch with its defaults
    bounded: object  # dispatch with BOUNDED_ENV: a small in-flight budget
    credentials: object | None  # MeshCredentials: mutual TLS on every hop, as in production; None: plaintext
    workdir: Path  # the mesh's state (and the bench's own artifact store for it)

    @property
    def secure(self) -> bool:
        return self.credentials is not None

    @property
    def label(self) -> str:
        return "tls" if self.secure else "plaintext"

    @property
    def client(self):
        """The bench process calls as the local operator, with the client certificate (or in plaintext)."""
        from accelmesh.security.config import INSECURE

        return self.credentials.client() if self.secure else INSECURE

    def service(self, role):
        """What a process of `role` in this mesh connects with: its certificate, or plaintext."""
        from accelmesh.security.config import INSECURE

        return self.credentials.service(role) if self.secure else INSECURE


def report_if_ended(process, failing: bool) -> None:
    """When the benchmark fails, say which mesh process had ended, with its last output lines."""
    code = process.process.poll()
    if failing and code is not None:
        tail = "\n  ".join(process.output[-10:])
        progress(f"{process.name} (pid {process.process.pid}) had ended with code {code}; its last lines:\n  {tail}")


def start_mesh(stack: ExitStack, workdir: Path, secure: bool = True) -> Mesh:
    """The embedded mesh's processes, with three dispatchers configured through their environment.
    `secure=False`: the same processes in plaintext without authentication (ACCELMESH_INSECURE=1)."""
    from accelmesh.embedded import mesh_credentials, service_env, start_compile, start_inventory, start_worker
    from accelmesh.runtime.launcher import start_service
    from accelmesh.security.identity import Role

    workdir.mkdir(parents=True, exist_ok=True)
    credentials = mesh_credentials(workdir) if secure else None

    def started(process):
        stack.callback(process.terminate)
        stack.push(lambda *exc: report_if_ended(process, exc[0] is not None))
        return process

    def dispatch(name: str, env: dict[str, str]):
        args = ["--listen", "127.0.0.1:0", "--inventory", inventory.address, "--compile", compile_.address,
                "--data-dir", str(workdir / name)]
        return started(start_service(name, "dispatch_svc", args, env={**service_env(credentials, Role.DISPATCH),
                                                                       **env}))

    inventory = started(start_inventory(workdir, credentials))
    compile_ = started(start_compile(workdir, credentials))
    worker = started(start_worker(inventory.address, compile_.address, credentials, devices=WORKER_DEVICES,
                                  emulate=EMULATE, artifact_dir=workdir / "worker-artifacts"))
    small = dispatch("dispatch-small-shards", {"ACCELMESH_MAX_SHARD_BYTES": str(SMALL_SHARD_BYTES)})
    default = dispatch("dispatch-default", {})
    bounded = dispatch("dispatch-bounded", {k: str(v) for k, v in BOUNDED_ENV.items()})
    return Mesh(inventory, compile_, worker, small, default, bounded, credentials, workdir)


# -- (a) per-shard overhead ------------------------------------------------------------------------


def local_call(program, rule, params: list[np.ndarray], x: np.ndarray, device) -> Callable[[], list[np.ndarray]]:
    """The program as the worker's rule builds it, compiled here for `x`'s shape; one call of it."""
    import jax

    from accelmesh.artifacts import xla_compiler_options
    from compile_svc.lowering import apply_build_options

    resident = [jax.device_put(p, device) for p in params]
    compiled = jax.jit(apply_build_options(program, rule.build)).lower(
        *resident, jax.device_put(x, device)).compile(compiler_options=xla_compiler_options(rule.build))

    def call() -> list[np.ndarray]:
        outputs = jax.block_until_ready(compiled(*resident, jax.device_put(x, device)))
        return [np.asarray(o) for o in outputs]

    return call


def worker_style_call(data: bytes, arrays: list[np.ndarray], device) -> Callable[[], list[np.ndarray]]:
    """The worker's own artifact loaded here and called as the worker calls it: every input
    (parameters too) put on the device, block_until_ready, outputs back to numpy."""
    import jax

    from accelmesh.artifacts import load_executable

    loaded = load_executable(data, device=device)

    def call() -> list[np.ndarray]:
        outputs = jax.block_until_ready(loaded(*jax.device_put(list(arrays), device)))
        return [np.asarray(o) for o in jax.tree.leaves(outputs)]

    return call


def overhead_inputs(program, rows_per_shard: int, plan: Plan) -> tuple[np.ndarray, list[np.ndarray]]:
    """A per-shard job's input (K shards of rows_per_shard rows) and the program's parameters: the
    same arrays for every arm."""
    width = program.inputs[0].shape[1]
    x = np.random.default_rng(7).standard_normal((plan.shards * rows_per_shard, width)).astype(np.float32)
    return x, [np.asarray(p) for p in program.init_params(0)] if program.parameters else []


def bench_overhead(mesh: Mesh, name: str, rows_per_shard: int, plan: Plan, floor_pipe, relay_pipe,
                   data_path: str = "relay") -> dict:
    import jax

    from accelmesh.client import MeshClient
    from accelmesh.security.identity import Role
    from compile_svc.programs import default_registry
    from compile_svc.rules import load_rules
    from dispatch_svc.clients.compiler import GrpcCompiler
    from dispatch_svc.clients.inventory import GrpcInventory
    from dispatch_svc.dataplane.device_queues import CancelScope
    from dispatch_svc.dataplane.workers import GrpcWorkers
    from dispatch_svc.jobs import records as m
    from dispatch_svc.ports import JobDevice
    from worker_svc.artifacts import ArtifactStore

    program = default_registry().get(name)
    x, params = overhead_inputs(program, rows_per_shard, plan)
    one = x[:rows_per_shard]
    with MeshClient(mesh.small_shards.address, security=mesh.client) as client:
        label = mesh.label if data_path == "relay" else f"{mesh.label}-{data_path}"
        progress(f"overhead {name} ({label}): warm-up job of {plan.shards} shards")
        client.run(name, {"x": x}, max_devices=1, timeout=RPC_TIMEOUT_S, data_path=data_path)
        one_walls = []
        for _ in range(plan.one_shard_jobs):
            start = time.perf_counter()
            client.run(name, {"x": one}, max_devices=1, timeout=RPC_TIMEOUT_S, data_path=data_path)
            one_walls.append(time.perf_counter() - start)
        walls, records, outputs = [], [], None
        for job in range(plan.shard_jobs):
            start = time.perf_counter()
            result = client.run(name, {"x": x}, max_devices=1, timeout=RPC_TIMEOUT_S, data_path=data_path)
            walls.append(time.perf_counter() - start)
            records.extend(result.job.shards)
            outputs = next(iter(result.outputs.values()))
            progress(f"overhead {name} ({label}): job {job + 1}: "
                     f"{len(result.job.shards)} shards in {walls[-1]:.2f} s")
    shards_per_job = len(records) // plan.shard_jobs
    devices = sorted({r.device_id for r in records})
    target_types = sorted({r.target_type for r in records})
    rules = sorted({r.rule for r in records})

    # The dispatcher's call to the worker on its own: GrpcWorkers.execute from here, same device and
    # artifact, with the dispatcher's certificate (the worker's ExecuteMany is the dispatcher's to
    # call); one shard at a time, so each is an ExecuteMany call of its own (a stream closes once idle).
    security = mesh.service(Role.DISPATCH)
    inventory = GrpcInventory(mesh.inventory.address, security, max_message_bytes=MAX_MESSAGE_BYTES)
    compiler = GrpcCompiler(mesh.compile.address, security, max_message_bytes=MAX_MESSAGE_BYTES)
    workers = GrpcWorkers(security, max_message_bytes=MAX_MESSAGE_BYTES, chunk_bytes=CHUNK_BYTES)
    try:
        candidates = inventory.candidate_devices(m.Constraints(max_devices=1))
        described = compiler.describe_program(name, "")
        (build,) = compiler.compile(described, candidates, [rows_per_shard])
        device = JobDevice(candidates[0].spec, candidates[0].node_address, build.target_type)
        shipped = compiler.fetch_parameters(described, 0) if described.parameters else []
        arrays = [*zip((p.name for p in described.parameters), shipped), ("x", one)]
        artifact = build.executables.get(rows_per_shard, build.portable)
        direct = time_calls(lambda: workers.execute("bench-direct", 0, 1, device, build, artifact, arrays,
                                                      rows_per_shard, CancelScope()), plan.direct_calls)
        # As the dispatcher sends an inference job's shards: parameters held by the worker, by key.
        keys = {p.name: f"params:{p.name}" for p in described.parameters}
        direct_held = time_calls(lambda: workers.execute("bench-direct-held", 0, 1, device, build, artifact, arrays,
                                                           rows_per_shard, CancelScope(), held_keys=keys),
                                 plan.direct_calls)
    finally:
        for client in (workers, compiler, inventory):
            client.close()
    store = ArtifactStore(mesh.workdir / "bench-artifacts", mesh.compile.address, mesh.service(Role.WORKER),
                          max_message_bytes=MAX_MESSAGE_BYTES)
    try:
        artifact_bytes = store.get(artifact.key, artifact.digest)
    finally:
        store.close()
    # The floor of any bidirectional stream call here: as many messages of the same sizes as the
    # Execute request (a shard header, then a tensor header and its chunks per array), echoed.
    def tensor_messages(array: np.ndarray) -> list[bytes]:
        data = array.tobytes()
        return [b"t" * 64, *(data[i: i + CHUNK_BYTES] for i in range(0, max(1, len(data)), CHUNK_BYTES))]

    messages = [b"h" * 200, *(m for _, array in arrays for m in tensor_messages(array))]
    floor = time_calls(lambda: list(floor_pipe(iter(messages), timeout=RPC_TIMEOUT_S)), plan.floor_calls)
    # An inference shard as the dispatcher sends it: the parameters as references to the worker's
    # held copies (a small message each), the data input in full.
    held_messages = [messages[0], *(b"r" * 64 for _ in described.parameters), *tensor_messages(one)]
    relay_floor = pipelined_relay_floor(relay_pipe, held_messages, plan)
    outputs_per_shard = len(program.outputs)

    rule = load_rules().match(device.spec)
    jax_device = jax.devices("cpu")[0]
    call = local_call(program, rule, params, one, jax_device)
    local = time_calls(call, plan.local_calls, warmup=20)
    same_artifact = (time_calls(worker_style_call(artifact_bytes, [a for _, a in arrays], jax_device),
                                plan.local_calls, warmup=20) if artifact.format == "executable" else None)
    expected = np.asarray(jax.jit(program.fn)(*params, x)[0])  # the whole job on one device
    local_p50 = percentile(local, 50)

    total = [r.total_seconds for r in records]
    rest = [r.total_seconds - r.queue_seconds - r.load_seconds - r.execute_seconds for r in records]
    shard = summary_ms(total)
    wall_per_shard = sum(walls) / (len(walls) * shards_per_job)
    one_p50 = percentile(one_walls, 50)
    marginal = (percentile(walls, 50) - one_p50) / (shards_per_job - 1) if shards_per_job > 1 else None
    overhead_ms = wall_per_shard * 1e3 - local_p50 * 1e3
    latency_ms = shard["p50_ms"] - local_p50 * 1e3
    return {
        "program": name,
        "mesh_security": mesh.label,  # tls: mutual TLS + bearer token on every hop; plaintext: neither
        "data_path": data_path,  # relay: the rows through the dispatcher; direct: client <-> worker stores
        "rows_per_shard": rows_per_shard,
        "input_bytes_per_shard": one.nbytes,
        "parameter_bytes_per_shard": sum(p.nbytes for p in params),
        "shards_per_job": shards_per_job,
        "timed_jobs": len(walls),
        "how_shard_count_was_obtained": (
            f"dispatcher started with ACCELMESH_MAX_SHARD_BYTES={SMALL_SHARD_BYTES}: the planner caps a shard at "
            f"{SMALL_SHARD_BYTES} // {one.nbytes // rows_per_shard} row bytes = {rows_per_shard} rows, and the job "
            f"has {len(x)} rows; max_devices=1 puts every shard on one device"),
        "devices": devices, "target_types": target_types, "rules": rules,
        "results_match_local": bool(outputs is not None and np.allclose(outputs, expected, rtol=1e-5, atol=1e-5)),
        "mesh_shard_total": shard,
        "components_p50_ms": {
            "queue": round(percentile([r.queue_seconds for r in records], 50) * 1e3, 3),
            "load": round(percentile([r.load_seconds for r in records], 50) * 1e3, 3),
            "execute": round(percentile([r.execute_seconds for r in records], 50) * 1e3, 3),
            "rest_rpc_and_transport": round(percentile(rest, 50) * 1e3, 3),
        },
        "local_execute": summary_ms(local),
        "local_worker_artifact_called_like_the_worker": summary_ms(same_artifact) if same_artifact else None,
        "ratio_worker_execute_over_local_worker_artifact_p50": (ratio(
            percentile([r.execute_seconds for r in records], 50), percentile(same_artifact, 50))
            if same_artifact else None),
        "artifact_format": artifact.format,
        "direct_execute_device": device.id,
        "direct_execute_rpc": summary_ms(direct),
        "direct_execute_rpc_parameters_held": summary_ms(direct_held),
        "ratio_direct_held_over_direct_p50": ratio(percentile(direct_held, 50), percentile(direct, 50)),
        "bare_stream_call": summary_ms(floor),
        "pipelined_relay_floor": relay_floor,
        "execute_call_messages": {
            "requests": len(messages),
            "responses": len(STAGE_MESSAGES) + 2 * outputs_per_shard + 1,
            "of_which_stage_messages": len(STAGE_MESSAGES),
            "bare_stream_call_echoes": len(messages),
            "note": "responses: one per stage (" + ", ".join(STAGE_MESSAGES) + "), a header and one chunk per "
                    "output, the timings; GrpcWorkers.execute reads only the tensors and the timings",
        },
        "job_wall_per_shard_ms": round(wall_per_shard * 1e3, 3),
        "one_shard_job_wall": summary_ms(one_walls),
        "marginal_ms_per_shard": round(marginal * 1e3, 3) if marginal is not None else None,
        # What the job pays a shard beyond the device's own work: job wall / K less the local call.
        "overhead_ms_per_shard": round(overhead_ms, 3),
        # One shard's time from sending to answer less the local call: with several shards in flight
        # on a device's stream it includes the wait behind them, so it is a latency, not a cost.
        "shard_latency_over_local_ms": round(latency_ms, 3),
        "ratio_shard_total_over_local_p50": ratio(shard["p50_ms"], local_p50 * 1e3),
        "ratio_shard_total_over_direct_execute_p50": ratio(shard["p50_ms"], percentile(direct, 50) * 1e3),
        "ratio_direct_execute_over_bare_stream_p50": ratio(percentile(direct, 50), percentile(floor, 50)),
        "goal_ms": OVERHEAD_GOAL_MS,
        "meets_goal": overhead_ms < OVERHEAD_GOAL_MS,
    }


def pipelined_relay_floor(relay_pipe, messages: list[bytes], plan: Plan) -> dict:
    """The floor of a two-hop path that pipelines K shards on one call, as the mesh does (client ->
    relay -> sink echo -> relay -> client, bare grpcio in plaintext): ms per shard = call wall / K,
    with each shard sent as the messages the dispatcher sends a worker for it (`messages`), and
    again as one message of the same bytes. Python gRPC's cost here is per message more than per
    byte, so the two say how much of the mesh's per-shard figure is its messages' count."""
    one = b"".join(messages)

    def shards(per_shard: list[bytes]) -> Iterator[bytes]:
        for _ in range(plan.shards):
            yield from per_shard

    def ms_per_shard(per_shard: list[bytes]) -> dict:
        seconds = time_calls(lambda: list(relay_pipe(shards(per_shard), timeout=RPC_TIMEOUT_S)),
                             RELAY_FLOOR_CALLS, warmup=1)
        return summary_ms([s / plan.shards for s in seconds])

    return {
        "shards_per_call": plan.shards,
        "execute_messages_per_shard": len(messages),
        "as_execute_messages_ms_per_shard": ms_per_shard(messages),
        "as_one_message_ms_per_shard": ms_per_shard([one]),
    }


def message_cost(overhead: dict) -> dict:
    """What one more message on a stream costs here, from the two bare floors: mlp_classifier's
    Execute request carries its 6 parameter tensors as 12 more messages than identity's."""
    (small, _), (large, _) = OVERHEAD_PROGRAMS
    a, b = overhead[small], overhead[large]
    extra = b["execute_call_messages"]["requests"] - a["execute_call_messages"]["requests"]
    per_message = (b["bare_stream_call"]["p50_ms"] - a["bare_stream_call"]["p50_ms"]) / (2 * extra)
    more_kib = (b["input_bytes_per_shard"] + b["parameter_bytes_per_shard"] - a["input_bytes_per_shard"]) // 1024
    return {
        "bare_ms_per_message_each_way": round(per_message, 3),
        "method": f"({large} bare_stream_call p50 - {small} bare_stream_call p50) / (2 x {extra} extra messages, "
                  f"echoed); includes the ~{more_kib} KiB more payload",
        "estimated_ms_per_shard_for_stage_messages": round(per_message * len(STAGE_MESSAGES), 3),
        f"estimated_ms_per_shard_for_{large}_parameter_messages": round(per_message * extra, 3),
    }


# -- (b) streaming -----------------------------------------------------------------------------------


def mesh_stream(dispatch, worker, client, data: np.ndarray, timeout_s: float = STREAM_TIMEOUT_S,
                data_path: str = "relay") -> dict:
    """One RunJob of `data` through `dispatch`, with its memory and CPU accounted."""
    dispatch_pid, worker_pid = dispatch.process.pid, worker.process.pid
    before = {"dispatch": proc_status_kib(dispatch_pid)["VmRSS"], "worker": proc_status_kib(worker_pid)["VmRSS"]}
    reset = reset_peak_rss(dispatch_pid) and reset_peak_rss(worker_pid)
    cpu = {"client": time.process_time(), "dispatch": cpu_seconds(dispatch_pid), "worker": cpu_seconds(worker_pid)}
    with RssSampler(dispatch_pid) as dispatch_rss, RssSampler(worker_pid) as worker_rss:
        start = time.perf_counter()
        result = client.run(STREAM_PROGRAM, {"x": data}, timeout=timeout_s, data_path=data_path)
        seconds = time.perf_counter() - start
    cpu = {"client": time.process_time() - cpu["client"], "dispatch": cpu_seconds(dispatch_pid) - cpu["dispatch"],
           "worker": cpu_seconds(worker_pid) - cpu["worker"]}

    def memory(pid: int, rss_before_kib: int, sampled: RssSampler) -> dict:
        peak = proc_status_kib(pid)["VmHWM"] * 1024
        return {"input_bytes": data.nbytes, "rss_before_bytes": rss_before_kib * 1024, "peak_rss_bytes_vmhwm": peak,
                "rise_bytes": peak - rss_before_kib * 1024,
                "ratio_rise_over_input": ratio(peak - rss_before_kib * 1024, data.nbytes),
                "sampled_peak_bytes": {k: v * 1024 for k, v in sampled.peak_kib.items()}}

    shards = result.job.shards
    return {
        "seconds": seconds,
        "data_path": data_path,
        "bytes_moved": dict(client._direct.objects.moved_bytes),  # so far, each way, by this client
        "equal": bool(np.array_equal(result.outputs["y"], data)),
        "cpu_s": cpu,
        "shards": len(shards),
        "shard_rows": sorted({s.rows for s in shards}),
        "devices": len({s.device_id for s in shards}),
        "load_s_total": sum(s.load_seconds for s in shards),
        "execute_s_total": sum(s.execute_seconds for s in shards),
        "shard_total_s_total": sum(s.total_seconds for s in shards),
        "dispatch_memory": memory(dispatch_pid, before["dispatch"], dispatch_rss),
        "worker_memory": memory(worker_pid, before["worker"], worker_rss),
        "vmhwm_reset": reset,
    }


def bare_run(pipe, relay: RoleProcess, sink: RoleProcess, data: np.ndarray) -> dict:
    cpu = {"client": time.process_time(), "relay": cpu_seconds(relay.pid), "sink": cpu_seconds(sink.pid)}
    seconds, equal = bare_stream(pipe, data)
    cpu = {"client": time.process_time() - cpu["client"], "relay": cpu_seconds(relay.pid) - cpu["relay"],
           "sink": cpu_seconds(sink.pid) - cpu["sink"]}
    return {"seconds": seconds, "equal": equal, "cpu_s": cpu}


def mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e6 / seconds, 1)


def cpu_per_wall(runs: list[dict]) -> dict:
    """CPU seconds each process spent per wall second (2.0 = both cores; one Python process's
    threads share one GIL, so about 1.0 is its ceiling for Python code)."""
    wall = sum(r["seconds"] for r in runs)
    return {k: round(sum(r["cpu_s"][k] for r in runs) / wall, 2) for k in runs[0]["cpu_s"]}


def bench_bounded(mesh: Mesh, data: np.ndarray) -> dict:
    """Jobs 4x and 16x the dispatcher's in-flight budget: do they finish, and does the peak stay put
    as the job grows (bounded) or grow with it?"""
    from accelmesh.client import MeshClient

    shard_rows = BOUNDED_ENV["ACCELMESH_MAX_SHARD_BYTES"] // data[0].nbytes
    out = {"dispatcher_env": BOUNDED_ENV, "timeout_s": BOUNDED_TIMEOUT_S, "jobs": []}
    with MeshClient(mesh.bounded.address, security=mesh.client, chunk_bytes=CHUNK_BYTES,
                    max_message_bytes=MAX_MESSAGE_BYTES) as client:
        client.run(STREAM_PROGRAM, {"x": data[:shard_rows]}, timeout=STREAM_TIMEOUT_S)  # one shard: warm
        for size in BOUNDED_INPUT_BYTES:
            job = data[: size // data[0].nbytes]
            progress(f"streaming: {size // MIB} MiB through a dispatcher with an "
                     f"{BOUNDED_ENV['ACCELMESH_INFLIGHT_BYTES'] // MIB} MiB in-flight budget")
            start = time.perf_counter()
            try:
                run = mesh_stream(mesh.bounded, mesh.worker, client, job, BOUNDED_TIMEOUT_S)
            except grpc.RpcError as exc:
                out["jobs"].append({"input_bytes": size, "completed": False,
                                    "error": f"{exc.code().name} after {time.perf_counter() - start:.1f} s"})
                break
            memory = run["dispatch_memory"]
            out["jobs"].append({
                "input_bytes": size, "completed": run["equal"], "seconds": round(run["seconds"], 3),
                "shards": run["shards"], "mb_per_s": mbps(size, run["seconds"]),
                **{k: memory[k] for k in ("rss_before_bytes", "peak_rss_bytes_vmhwm", "rise_bytes",
                                          "ratio_rise_over_input")},
                "ratio_rise_over_inflight_budget": ratio(memory["rise_bytes"], BOUNDED_ENV["ACCELMESH_INFLIGHT_BYTES"]),
            })
    jobs = out["jobs"]
    out["completed"] = len(jobs) == len(BOUNDED_INPUT_BYTES) and all(j["completed"] for j in jobs)
    if out["completed"]:
        out["peak_growth_bytes_from_smaller_to_larger_job"] = (jobs[-1]["peak_rss_bytes_vmhwm"]
                                                               - jobs[0]["peak_rss_bytes_vmhwm"])
        out["input_growth_bytes"] = jobs[-1]["input_bytes"] - jobs[0]["input_bytes"]
    return out


def stream_arms(meshes: list[Mesh], relay: RoleProcess, sink: RoleProcess, plan: Plan, data: np.ndarray,
                shard_rows: int, ray: RayBaseline | None) -> tuple[dict[str, list[dict]], dict, dict[str, dict]]:
    """Warm-ups, the memory probe on each mesh, then plan.stream_reps runs of every arm (each mesh's
    default dispatcher, the bare pipeline, Ray when given), the order rotated each rep so drift hits
    all arms alike. Returns (runs by arm, the bare warm-up run, the probe run by arm); a mesh's arm
    is its label, Ray's "ray"."""
    from accelmesh.client import MeshClient

    pipe = pipe_stub(relay.address)
    probe = data[: MEMORY_PROBE_BYTES // data[0].nbytes]
    with ExitStack() as stack:
        clients = [(mesh, stack.enter_context(MeshClient(mesh.default.address, security=mesh.client,
                                                         chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES)))
                   for mesh in meshes]
        progress(f"streaming: warm-up, one {shard_rows}-row shard through each mesh, "
                 f"{data.nbytes // MIB} MiB through the bare pipeline")
        for _, client in clients:
            # builds and loads the artifact
            client.run(STREAM_PROGRAM, {"x": data[:shard_rows]}, timeout=STREAM_TIMEOUT_S)
        first, first_client = clients[0]
        first_client.run(STREAM_PROGRAM, {"x": data[:shard_rows]}, timeout=STREAM_TIMEOUT_S, data_path="direct")
        warm_bare = bare_run(pipe, relay, sink, data)
        if ray is not None:
            progress(f"streaming: warm-up, {data.nbytes // MIB} MiB through Ray")
            ray.stream(STREAM_PROGRAM, data)
        progress(f"streaming: {probe.nbytes // MIB} MiB through each mesh (memory against input size)")
        probes = {mesh.label: mesh_stream(mesh.default, mesh.worker, client, probe) for mesh, client in clients}
        direct_label = f"{first.label}-direct"
        probes[direct_label] = mesh_stream(first.default, first.worker, first_client, probe, data_path="direct")

        def mesh_arm(mesh: Mesh, client) -> tuple[str, Callable[[], dict]]:
            return mesh.label, lambda: mesh_stream(mesh.default, mesh.worker, client, data)

        arms = [*(mesh_arm(mesh, client) for mesh, client in clients),
                (direct_label, lambda: mesh_stream(first.default, first.worker, first_client, data,
                                                   data_path="direct")),
                ("bare", lambda: bare_run(pipe, relay, sink, data))]
        if ray is not None:
            arms.append(("ray", lambda: ray.stream(STREAM_PROGRAM, data)))
        runs: dict[str, list[dict]] = {arm: [] for arm, _ in arms}
        for rep in range(plan.stream_reps):
            turn = rep % len(arms)
            for arm, run in arms[turn:] + arms[:turn]:
                runs[arm].append(run())
                progress(f"streaming: {arm} {mbps(data.nbytes, runs[arm][-1]['seconds'])} MB/s")
    return runs, warm_bare, probes


def mesh_arm_summary(runs: list[dict], data: np.ndarray) -> dict:
    mb_per_s = [mbps(data.nbytes, r["seconds"]) for r in runs]
    first = runs[0]
    return {
        "mb_per_s": mb_per_s, "mb_per_s_p50": percentile(mb_per_s, 50),
        "results_equal_input": all(r["equal"] for r in runs),
        "shards": first["shards"], "shard_rows": first["shard_rows"], "devices": first["devices"],
        "worker_execute_s_per_run": round(percentile([r["execute_s_total"] for r in runs], 50), 3),
        "artifact_load_s_per_run": round(percentile([r["load_s_total"] for r in runs], 50), 3),
        # Sum of the shards' Execute calls over (devices x wall): near 1 means every device's
        # thread was inside an Execute call all along, so those calls, not input ingest, set the pace.
        "device_threads_busy_fraction": ratio(sum(r["shard_total_s_total"] for r in runs),
                                              sum(r["devices"] * r["seconds"] for r in runs)),
        "cpu_s_per_wall_s": cpu_per_wall(runs),
        "cpu_s_per_run_p50": {k: round(percentile([r["cpu_s"][k] for r in runs], 50), 2) for k in first["cpu_s"]},
    }


def dispatcher_memory(probe: dict, runs: list[dict], data: np.ndarray, inflight_bytes: int) -> dict:
    first = runs[0]  # the first full-size job: later ones start from a heap the allocator kept
    peak = max(r["dispatch_memory"]["peak_rss_bytes_vmhwm"] for r in runs)
    rise = max(r["dispatch_memory"]["rise_bytes"] for r in runs)
    return {
        "peak_rss_bytes_vmhwm": peak,
        "ratio_peak_rss_over_input": ratio(peak, data.nbytes),
        # The issue's bound: peak under idle RSS plus twice the in-flight budget, for every full-size job.
        "idle_rss_bytes": first["dispatch_memory"]["rss_before_bytes"],
        "max_rise_bytes": rise,
        "inflight_budget_bytes": inflight_bytes,
        "ratio_max_rise_over_inflight_budget": ratio(rise, inflight_bytes),
        "rise_under_twice_inflight_budget": rise < 2 * inflight_bytes,
        "vmhwm_reset_before_each_job": probe["vmhwm_reset"] and all(r["vmhwm_reset"] for r in runs),
        "by_input_size": [probe["dispatch_memory"], first["dispatch_memory"]],
        "rise_exceeds_input": first["dispatch_memory"]["rise_bytes"] >= data.nbytes,
        "note": "VmHWM reset through /proc/<pid>/clear_refs before each job; rise = peak - RSS before the job; "
                "RssAnon is the process's own heap, RssFile its file-backed pages (libraries, mapped files)",
    }


def bench_streaming(mesh: Mesh, plain: Mesh, relay: RoleProcess, sink: RoleProcess, plan: Plan,
                    ray: RayBaseline | None) -> tuple[dict, list[dict]]:
    """`mesh` (TLS) is the one measured; `plain`, the same mesh in plaintext, is a third arm (mesh_plaintext)
    and Ray, when given, a fourth. Returns (the streaming section, Ray's runs: empty without Ray)."""
    from accelmesh.security.identity import Role
    from compile_svc.programs.builtin import IDENTITY_WIDTH
    from dispatch_svc.config import DispatchConfig

    defaults = DispatchConfig(security=mesh.service(Role.DISPATCH))  # the default dispatcher's settings
    row_bytes = IDENTITY_WIDTH * 4
    shard_rows = defaults.max_shard_bytes // row_bytes
    rows = plan.stream_bytes // row_bytes
    data = np.random.default_rng(11).standard_normal((rows, IDENTITY_WIDTH)).astype(np.float32)
    runs, warm_bare, probes = stream_arms([mesh, plain], relay, sink, plan, data, shard_rows, ray)
    progress("streaming: how fast this machine hands out fresh memory, at once and after an idle pause")
    host_memory = fresh_memory(plan.stream_bytes)
    mesh_runs, plain_runs, bare_runs = runs[mesh.label], runs[plain.label], runs["bare"]
    mesh_p50, bare_p50 = (percentile([mbps(data.nbytes, r["seconds"]) for r in arm], 50)
                          for arm in (mesh_runs, bare_runs))
    return {
        "program": STREAM_PROGRAM,
        "input_bytes": data.nbytes, "output_bytes": data.nbytes,
        "chunk_bytes": CHUNK_BYTES, "max_message_bytes": MAX_MESSAGE_BYTES,
        "dispatcher_settings": {"max_shard_bytes": defaults.max_shard_bytes, "inflight_bytes": defaults.inflight_bytes,
                                "chunk_bytes": defaults.chunk_bytes, "source": "defaults (no ACCELMESH_* set)"},
        "mesh_shape": "MeshClient.run -> dispatch RunJob -> worker ExecuteMany per device, "
                      "shards in turn (both devices) -> back",
        "bare_shape": "client -> relay process -> sink process (echo) -> relay -> client; grpcio generic "
                      "stream-stream handlers, raw bytes messages",
        "mb_per_s_definition": "input bytes / 1e6 / wall seconds of the whole call (the same bytes also come back)",
        "mesh": mesh_arm_summary(mesh_runs, data),
        "bare": {
            "mb_per_s": [mbps(data.nbytes, r["seconds"]) for r in bare_runs], "mb_per_s_p50": bare_p50,
            "warmup_mb_per_s": mbps(data.nbytes, warm_bare["seconds"]),
            "echo_equal_input": all(r["equal"] for r in bare_runs),
            "cpu_s_per_wall_s": cpu_per_wall(bare_runs),
        },
        "ratio_mesh_over_bare_p50": ratio(mesh_p50, bare_p50),
        "goal_ratio": STREAM_GOAL_RATIO,
        "meets_goal": mesh_p50 >= STREAM_GOAL_RATIO * bare_p50,
        "dispatcher_memory": dispatcher_memory(probes[mesh.label], mesh_runs, data, defaults.inflight_bytes),
        "worker_memory": {"by_input_size": [probes[mesh.label]["worker_memory"], mesh_runs[0]["worker_memory"]]},
        "small_inflight_budget": bench_bounded(mesh, data),
        "host_fresh_memory": {
            **host_memory,
            "note": "MB/s writing a block just allocated: right after freeing one (recycled) and after idle_s "
                    "seconds with it freed (after_idle). Far apart on a virtual machine whose balloon reports free "
                    "pages to its host; then memory touched after a pause (each run's output, a shard's buffers) "
                    "costs that much more on every arm, and the streaming figures vary with it",
        },
        "mesh_direct": {
            "shape": "the same job through the TLS mesh with DATA_PATH_DIRECT: MeshClient.run puts each shard's rows "
                     "into the worker's object store (shared memory: this process is on the worker's host), the "
                     "dispatcher sends descriptors, the client fetches the outputs from the store; its runs "
                     "alternating with the other arms",
            **mesh_arm_summary(runs[f"{mesh.label}-direct"], data),
            "dispatcher_memory": dispatcher_memory(probes[f"{mesh.label}-direct"], runs[f"{mesh.label}-direct"], data,
                                                   defaults.inflight_bytes),
            "bytes_moved_by_the_client_so_far": runs[f"{mesh.label}-direct"][-1]["bytes_moved"],
        },
        "mesh_plaintext": {
            "shape": "the same job through a second mesh of the same processes started insecure (plaintext, no "
                     "authentication), its runs alternating with the mesh and bare arms above",
            **mesh_arm_summary(plain_runs, data),
            "dispatcher_memory": dispatcher_memory(probes[plain.label], plain_runs, data, defaults.inflight_bytes),
        },
    }, runs.get("ray", [])


# -- (e) security: the same figures through a plaintext mesh ------------------------------------------


def bench_overhead_arms(meshes: list[Mesh], plan: Plan, floor_pipe, relay_pipe,
                        ray: RayBaseline | None) -> dict[str, dict]:
    """bench_overhead of every program on each mesh, and the Ray arm's per-shard runs when `ray` is
    given, by arm (the mesh's label, "ray"); the order is reversed for the next program (TLS,
    plaintext, Ray, then Ray, plaintext, TLS) so drift on a shared machine hits every arm alike."""
    def mesh_arm(mesh: Mesh) -> tuple[str, Callable[[str, int], dict]]:
        return mesh.label, lambda name, rows: bench_overhead(mesh, name, rows, plan, floor_pipe, relay_pipe)

    arms = [mesh_arm(mesh) for mesh in meshes]
    # The first (TLS) mesh again with DATA_PATH_DIRECT: the rows into the worker's store and back.
    arms.insert(1, (f"{meshes[0].label}-direct", lambda name, rows: bench_overhead(
        meshes[0], name, rows, plan, floor_pipe, relay_pipe, data_path="direct")))
    if ray is not None:
        arms.append(("ray", lambda name, rows: bench_ray_overhead(ray, name, rows, plan)))
    out: dict[str, dict] = {label: {} for label, _ in arms}
    for index, (name, rows) in enumerate(OVERHEAD_PROGRAMS):
        for label, arm in arms if index % 2 == 0 else arms[::-1]:
            out[label][name] = arm(name, rows)
    return out


def security_section(overhead: dict, plain_overhead: dict, stream: dict) -> dict:
    """What mutual TLS + bearer tokens cost: each figure through the TLS mesh and the plaintext one."""
    plain_stream = stream["mesh_plaintext"]

    def per_program(tls: dict, plain: dict) -> dict:
        return {
            "overhead_ms_per_shard": tls_vs_plaintext(tls["overhead_ms_per_shard"], plain["overhead_ms_per_shard"]),
            "shard_total_p50_ms": tls_vs_plaintext(tls["mesh_shard_total"]["p50_ms"],
                                                   plain["mesh_shard_total"]["p50_ms"]),
            "tls_minus_plaintext_shard_total_p50_ms": round(tls["mesh_shard_total"]["p50_ms"]
                                                            - plain["mesh_shard_total"]["p50_ms"], 3),
            "job_wall_per_shard_ms": tls_vs_plaintext(tls["job_wall_per_shard_ms"], plain["job_wall_per_shard_ms"]),
            "direct_execute_rpc_p50_ms": tls_vs_plaintext(tls["direct_execute_rpc"]["p50_ms"],
                                                          plain["direct_execute_rpc"]["p50_ms"]),
            "results_match_local": tls["results_match_local"] and plain["results_match_local"],
        }

    return {
        "how": "a second mesh of the same processes (inventory, compile, worker, 3 dispatchers) started insecure "
               "(ACCELMESH_INSECURE=1: plaintext, no authentication) beside the TLS one; per-shard overhead runs "
               "each program on both (order swapped per program), the streaming job alternates with the TLS mesh "
               "and the bare pipeline; the bare baselines are plaintext in both",
        "per_shard_overhead": {name: per_program(overhead[name], plain_overhead[name]) for name in overhead},
        "streaming": {
            "mb_per_s_p50": tls_vs_plaintext(stream["mesh"]["mb_per_s_p50"], plain_stream["mb_per_s_p50"]),
            "dispatcher_peak_rss_bytes": tls_vs_plaintext(stream["dispatcher_memory"]["peak_rss_bytes_vmhwm"],
                                                          plain_stream["dispatcher_memory"]["peak_rss_bytes_vmhwm"]),
            "cpu_s_per_run_p50": {k: tls_vs_plaintext(v, plain_stream["cpu_s_per_run_p50"][k])
                                  for k, v in stream["mesh"]["cpu_s_per_run_p50"].items()},
            "results_equal_input": stream["mesh"]["results_equal_input"] and plain_stream["results_equal_input"],
        },
        "per_shard_overhead_plaintext": plain_overhead,
    }


# -- (f) Ray: the same shapes through Ray actors (bench/ray_baseline.py) ------------------------------


def start_ray(stack: ExitStack, plan: Plan) -> RayBaseline:
    """A local Ray with an actor per worker device, every program of the run jitted and compiled in each
    for the shapes it will see (a per-shard job's shard, a stream's piece); shut down by `stack`."""
    from compile_svc.programs import default_registry
    from compile_svc.programs.builtin import IDENTITY_WIDTH

    registry = default_registry()
    progress(f"ray: starting a local Ray with {WORKER_DEVICES} actors")
    ray = stack.enter_context(RayBaseline(WORKER_DEVICES, object_store_bytes(plan.stream_bytes)))
    examples: dict[str, list[np.ndarray]] = {}
    for name, rows in OVERHEAD_PROGRAMS:
        spec = registry.get(name).inputs[0]
        examples.setdefault(name, []).append(np.zeros((rows, spec.shape[1]), spec.dtype))
    piece_rows = STREAM_PIECE_BYTES // (IDENTITY_WIDTH * 4)
    examples.setdefault(STREAM_PROGRAM, []).append(np.zeros((piece_rows, IDENTITY_WIDTH), np.float32))
    for name, arrays in examples.items():
        program = registry.get(name)
        params = [np.asarray(p) for p in program.init_params(0)] if program.parameters else []
        ray.load(name, program.fn, params, arrays)
    return ray


def bench_ray_overhead(ray: RayBaseline, name: str, rows_per_shard: int, plan: Plan) -> dict:
    """The per-shard job's input through Ray: K shard tasks, plan.shard_jobs timed runs of each way."""
    import jax

    from compile_svc.programs import default_registry

    program = default_registry().get(name)
    x, params = overhead_inputs(program, rows_per_shard, plan)
    expected = np.asarray(jax.jit(program.fn)(*params, x)[0])
    progress(f"overhead {name} (ray): {plan.shards} shard tasks, async and one at a time")
    out = measure_per_shard(ray, name, x, rows_per_shard, plan.shard_jobs, expected, name in BIT_EXACT_PROGRAMS)
    progress(f"overhead {name} (ray): {out['async_one_device_ms_per_shard']} ms a shard async, "
             f"{out['one_at_a_time_ms_per_shard']} ms one at a time")
    return out


def ray_section(ray: RayBaseline, overhead: dict[str, dict], stream: dict, ray_runs: list[dict]) -> dict:
    """Ray's figures beside the mesh's from the same run, as mesh / Ray ratios: per-shard cost (job wall
    per shard against Ray's async ms per shard; below 1 is cheaper) and streaming MB/s (above 1 is
    faster), through the TLS mesh and the plaintext one, with the bare-gRPC floors beside them."""
    labels = ("tls", "tls-direct", "plaintext")

    def per_program(name: str) -> dict:
        figures = overhead["ray"][name]
        async_ms = figures["async_one_device_ms_per_shard"]
        mesh_ms = {label: overhead[label][name]["job_wall_per_shard_ms"] for label in labels}
        return {
            **figures,
            "mesh_job_wall_per_shard_ms": mesh_ms,
            "ratio_mesh_over_ray_async": {label: ratio(ms, async_ms) for label, ms in mesh_ms.items()},
            "ratio_mesh_over_ray_one_at_a_time": {label: ratio(ms, figures["one_at_a_time_ms_per_shard"])
                                                  for label, ms in mesh_ms.items()},
            "bare_stream_call_p50_ms": overhead["tls"][name]["bare_stream_call"]["p50_ms"],
            "pipelined_relay_floor_p50_ms": {
                how: overhead["tls"][name]["pipelined_relay_floor"][f"as_{how}_ms_per_shard"]["p50_ms"]
                for how in ("execute_messages", "one_message")},
        }

    mb_per_s = [mbps(stream["input_bytes"], r["seconds"]) for r in ray_runs]
    ray_p50 = percentile(mb_per_s, 50)
    mesh_p50 = {"tls": stream["mesh"]["mb_per_s_p50"], "tls-direct": stream["mesh_direct"]["mb_per_s_p50"],
                "plaintext": stream["mesh_plaintext"]["mb_per_s_p50"]}
    return {
        "version": ray.version,
        "auth_mode": ray.auth_mode,
        "actors": len(ray.actors),
        "object_store_bytes": ray.store_bytes,
        "how": "a local Ray (address='local', no dashboard) with one actor per worker device (num_cpus=1 each), "
               "each holding a jax.jit of the program the mesh runs on its CPU device, parameters put there once; "
               "compiled and warmed before timing; runs interleaved with the mesh arms",
        "per_shard": {
            "shape": "the per-shard jobs' input cut into the same K shards: async = submit every shard task to one "
                     "actor (one device, as the mesh's max_devices=1), then ray.get them all; one_at_a_time = "
                     "submit, get, repeat; async_spread_over_devices = async round-robin over every actor, for "
                     "context; ms per shard = mean run wall / K, as the mesh's job_wall_per_shard_ms",
            "programs": {name: per_program(name) for name in overhead["ray"]},
        },
        "streaming": {
            "shape": f"the streaming job's input in {STREAM_PIECE_BYTES // MIB} MiB pieces, every piece submitted "
                     "round-robin over the actors, then each result fetched in order into one output array "
                     "(driver -> object store -> actor -> object store -> driver)",
            "piece_bytes": STREAM_PIECE_BYTES,
            "pieces": ray_runs[0]["pieces"],
            "mb_per_s": mb_per_s, "mb_per_s_p50": ray_p50,
            "results_equal_input": all(r["equal"] for r in ray_runs),
            "mesh_mb_per_s_p50": mesh_p50,
            "ratio_mesh_over_ray_p50": {label: ratio(mb, ray_p50) for label, mb in mesh_p50.items()},
            "bare_mb_per_s_p50": stream["bare"]["mb_per_s_p50"],
        },
    }


def why_no_ray(wanted: bool, version: str | None) -> dict | None:
    """What the JSON says in Ray's place when it is not measured; None when it will be."""
    if not wanted:
        return {"skipped": "--no-ray was given"}
    if version is None:
        return {"absent": f"ray is not installed: {ABSENT_NOTE}"}
    return None


def ray_summary(section: dict) -> dict:
    """The Ray comparison in a few lines: each mesh figure, Ray's, their ratio and the bare-gRPC floor."""
    if "version" not in section:
        return section  # absent or skipped: the reason
    stream = section["streaming"]
    per_shard = {name: {
        "mesh": p["mesh_job_wall_per_shard_ms"]["tls"], "mesh_plaintext": p["mesh_job_wall_per_shard_ms"]["plaintext"],
        "mesh_direct": p["mesh_job_wall_per_shard_ms"]["tls-direct"],
        "ray_async": p["async_one_device_ms_per_shard"], "ray_one_at_a_time": p["one_at_a_time_ms_per_shard"],
        "ratio_mesh_over_ray_async": p["ratio_mesh_over_ray_async"]["tls"],
        "ratio_mesh_direct_over_ray_async": p["ratio_mesh_over_ray_async"]["tls-direct"],
        "ratio_mesh_plaintext_over_ray_async": p["ratio_mesh_over_ray_async"]["plaintext"],
        "bare_grpc_call_floor": p["bare_stream_call_p50_ms"],
        "bare_pipelined_relay_floor": p["pipelined_relay_floor_p50_ms"],
    } for name, p in section["per_shard"]["programs"].items()}
    return {
        "ray_version": section["version"],
        "per_shard_ms": per_shard,
        "stream_mb_per_s": {
            "mesh": stream["mesh_mb_per_s_p50"]["tls"], "mesh_plaintext": stream["mesh_mb_per_s_p50"]["plaintext"],
            "mesh_direct": stream["mesh_mb_per_s_p50"]["tls-direct"],
            "ray": stream["mb_per_s_p50"],
            "ratio_mesh_over_ray": stream["ratio_mesh_over_ray_p50"]["tls"],
            "ratio_mesh_direct_over_ray": stream["ratio_mesh_over_ray_p50"]["tls-direct"],
            "ratio_mesh_plaintext_over_ray": stream["ratio_mesh_over_ray_p50"]["plaintext"],
            "bare_grpc_floor": stream["bare_mb_per_s_p50"],
        },
        "mesh_per_shard_at_most_ray_async": {name: p["ratio_mesh_over_ray_async"] is not None
                                             and p["ratio_mesh_over_ray_async"] <= 1 for name, p in per_shard.items()},
        "mesh_stream_at_least_ray": (stream["ratio_mesh_over_ray_p50"]["tls"] or 0) >= 1,
        "mesh_direct_per_shard_at_most_ray_async": {
            name: p["ratio_mesh_direct_over_ray_async"] is not None and p["ratio_mesh_direct_over_ray_async"] <= 1
            for name, p in per_shard.items()},
        "mesh_direct_stream_at_least_ray": (stream["ratio_mesh_over_ray_p50"]["tls-direct"] or 0) >= 1,
        "ray_results_equal_local": (all(p["results_match_local"] for p in section["per_shard"]["programs"].values())
                                    and stream["results_equal_input"]),
    }


# -- (c, d) planning: bench/planning.py's functions --------------------------------------------------


def bench_planning(plan: Plan) -> dict:
    import planning  # the sibling script: this file runs from bench/, which Python puts first on sys.path

    from compile_svc.rules import load_rules

    rules = load_rules()
    out: dict = {}
    if planning.GAVEL_CSV.exists():
        progress("planning: gavel job types on K80 + P100 + V100")
        gavel = planning.bench_gavel(rules)
        out["gavel_weighted_vs_equal"] = {
            **{k: v for k, v in gavel.items() if k != "per_job_type"},
            "ratio_equal_over_weighted_per_job_type": {job: v["ratio_equal_over_weighted"]
                                                      for job, v in gavel["per_job_type"].items()},
        }
        out["gavel_skipped_reason"] = None
    else:
        out["gavel_weighted_vs_equal"] = None
        out["gavel_skipped_reason"] = planning.skipped(planning.GAVEL_CSV, "gavel_weighted_vs_equal")
    if planning.PAI_CSV.exists():
        progress("planning: one job over the PAI inventory")
        pai = planning.bench_pai(rules, plan.pai_runs)
        out["pai_planning_cost"] = {**pai, "gpu_nodes": pai_gpu_nodes(planning)}
        out["pai_skipped_reason"] = None
    else:
        out["pai_planning_cost"] = None
        out["pai_skipped_reason"] = planning.skipped(planning.PAI_CSV, "pai_planning_cost")
    return out


def pai_gpu_nodes(planning) -> int:
    import csv

    with planning.PAI_CSV.open(newline="") as handle:
        return sum(1 for row in csv.DictReader(handle)
                   if row["gpu_type"].strip() in planning.PAI_TYPES and int(row["cap_gpu"]) > 0)


# -- (h) verification --------------------------------------------------------------------------------

VERIFY_FRACTIONS = (0.0, 0.05, 0.2)
VERIFY_NODE_IPS = ("127.0.0.1", "127.0.0.2")
VERIFY_ROWS_PER_SHARD = 128  # mlp_classifier: 32 KiB of input a shard


def start_verify_mesh(stack: ExitStack, workdir: Path):
    """Inventory, compile, a worker on each of VERIFY_NODE_IPS and one small-shard dispatcher;
    returns (dispatch address, client security)."""
    from accelmesh.embedded import mesh_credentials, service_env, start_compile, start_inventory, start_worker
    from accelmesh.runtime.launcher import start_service
    from accelmesh.security.identity import Role

    workdir.mkdir(parents=True, exist_ok=True)
    credentials = mesh_credentials(workdir)

    def started(process):
        stack.callback(process.terminate)
        stack.push(lambda *exc: report_if_ended(process, exc[0] is not None))
        return process

    inventory = started(start_inventory(workdir, credentials))
    compile_ = started(start_compile(workdir, credentials))
    for ip in VERIFY_NODE_IPS:
        # The inventory registers a node only for a worker whose certificate names its address.
        tls = credentials.issue(Role.WORKER, f"node-{ip}", [ip]).tls
        started(start_worker(inventory.address, compile_.address, credentials, devices=1, emulate=EMULATE[:1],
                             listen=f"{ip}:0", artifact_dir=workdir / f"artifacts-{ip}", name=f"worker-{ip}",
                             nvml=False, env={"ACCELMESH_CERT_FILE": str(tls.cert_file),
                                              "ACCELMESH_KEY_FILE": str(tls.key_file)}))
    dispatch = started(start_service("dispatch-verify", "dispatch_svc", [
        "--listen", "127.0.0.1:0", "--inventory", inventory.address, "--compile", compile_.address,
        "--data-dir", str(workdir / "dispatch")],
        env={**service_env(credentials, Role.DISPATCH), "ACCELMESH_MAX_SHARD_BYTES": str(SMALL_SHARD_BYTES)}))
    return dispatch.address, credentials.client()


def bench_verification(stack: ExitStack, workdir: Path, plan: Plan) -> dict:
    from accelmesh.client import MeshClient

    address, security = start_verify_mesh(stack, workdir)
    x = np.random.default_rng(3).standard_normal((plan.shards * VERIFY_ROWS_PER_SHARD, 64)).astype(np.float32)
    runs: dict[float, list[dict]] = {f: [] for f in VERIFY_FRACTIONS}
    with MeshClient(address, security=security) as client:
        def job(fraction: float) -> dict:
            started = time.perf_counter()
            result = client.run("mlp_classifier", {"x": x}, verify_fraction=fraction, timeout=RPC_TIMEOUT_S)
            wall = time.perf_counter() - started
            shards = result.job.shards
            return {"wall_s": wall, "shards": len(shards), "state": result.job.state,
                    "verified": sum(s.HasField("verification") and s.verification.outcome == 1 for s in shards),
                    "nodes": len({s.device_id.split("/")[0] for s in shards})}

        progress("verification: warm-up job (artifacts compiled, fetched and loaded on both nodes)")
        job(1.0)
        for rep in range(plan.shard_jobs):
            order = VERIFY_FRACTIONS if rep % 2 == 0 else tuple(reversed(VERIFY_FRACTIONS))
            for fraction in order:
                progress(f"verification: fraction {fraction}, run {rep + 1} of {plan.shard_jobs}")
                runs[fraction].append(job(fraction))
    base = percentile([r["wall_s"] for r in runs[0.0]], 50)
    out: dict = {"program": "mlp_classifier", "rows_per_shard": VERIFY_ROWS_PER_SHARD, "nodes": len(VERIFY_NODE_IPS),
                 "runs_per_fraction": plan.shard_jobs, "fractions": {}}
    for fraction, rs in runs.items():
        wall = percentile([r["wall_s"] for r in rs], 50)
        shards = rs[0]["shards"]
        out["fractions"][str(fraction)] = {
            "shards": shards, "shards_verified": [r["verified"] for r in rs],
            "nodes_used": rs[0]["nodes"], "all_succeeded": all(r["state"] == 4 for r in rs),
            "job_wall_ms_p50": round(wall * 1e3, 2), "ms_per_shard_p50": round(wall * 1e3 / shards, 3),
            "throughput_ratio_to_fraction_0": ratio(base, wall),
        }
    return out


# -- main ----------------------------------------------------------------------------------------------


def machine() -> dict:
    import jax

    return {
        "cores": os.cpu_count(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(), "grpc": grpc.__version__, "jax": jax.__version__,
        "numpy": np.__version__, "ray": ray_version(), "platform": platform.platform(),
        "otel_env": sorted(k for k in os.environ if k.startswith("OTEL_")),
        "accelmesh_env": sorted(k for k in os.environ if k.startswith("ACCELMESH_")),  # inherited by the mesh
    }


def summary(result: dict) -> dict:
    overhead = result["per_shard_overhead"]
    stream = result["streaming"]
    bounded = stream["small_inflight_budget"]
    gavel = result["gavel_weighted_vs_equal"]
    pai = result["pai_planning_cost"]
    security = result["security"]
    return {
        "overhead_ms_per_shard": {name: o["overhead_ms_per_shard"] for name, o in overhead.items()},
        "overhead_goal_ms": OVERHEAD_GOAL_MS,
        "overhead_meets_goal": {name: o["meets_goal"] for name, o in overhead.items()},
        "stream_mb_per_s": {"mesh": stream["mesh"]["mb_per_s_p50"], "bare": stream["bare"]["mb_per_s_p50"]},
        "stream_ratio_mesh_over_bare": stream["ratio_mesh_over_bare_p50"],
        "stream_goal_ratio": STREAM_GOAL_RATIO,
        "stream_meets_goal": stream["meets_goal"],
        "host_fresh_memory_mb_per_s": {k: stream["host_fresh_memory"][k]
                                       for k in ("recycled_mb_per_s", "after_idle_mb_per_s")},
        "dispatcher_peak_rss_bytes": stream["dispatcher_memory"]["peak_rss_bytes_vmhwm"],
        "stream_input_bytes": stream["input_bytes"],
        "dispatcher_rise_exceeds_input": stream["dispatcher_memory"]["rise_exceeds_input"],
        "dispatcher_idle_rss_bytes": stream["dispatcher_memory"]["idle_rss_bytes"],
        "dispatcher_max_rise_over_inflight_budget": stream["dispatcher_memory"]["ratio_max_rise_over_inflight_budget"],
        "dispatcher_rise_under_twice_inflight_budget": stream["dispatcher_memory"]["rise_under_twice_inflight_budget"],
        "job_over_inflight_budget_completes": bounded["completed"],
        "small_budget_peak_growth_bytes": bounded.get("peak_growth_bytes_from_smaller_to_larger_job"),
        "small_budget_input_growth_bytes": bounded.get("input_growth_bytes"),
        "grpc_ms_per_message_each_way": result["grpc_message_cost"]["bare_ms_per_message_each_way"],
        "gavel_geomean_ratio_equal_over_weighted": gavel["geomean_ratio_equal_over_weighted"] if gavel else None,
        "pai_plan_one_job_p50_ms": ({name: v["throughput_and_plan"]["p50_ms"] for name, v in pai["variants"].items()}
                                    if pai else None),
        "pai_devices": pai["devices"] if pai else None,
        "security_cost": {
            "overhead_ms_per_shard": {name: o["overhead_ms_per_shard"]
                                      for name, o in security["per_shard_overhead"].items()},
            "stream_mb_per_s": security["streaming"]["mb_per_s_p50"],
            "dispatcher_peak_rss_bytes": security["streaming"]["dispatcher_peak_rss_bytes"],
        },
        "vs_ray": ray_summary(result["ray"]),
        "large_direct_job": large_direct_summary(result["large_direct_job"]),
        "verification_cost": verification_summary(result["verification"]),
    }


def large_direct_summary(large: dict) -> dict:
    return {"input_bytes": large["input_bytes"], "mb_per_s": {r["run"]: r["mb_per_s"] for r in large["runs"]},
            "dispatcher_growth_bytes": large["dispatcher_max_growth_bytes"],
            "dispatcher_growth_within_64_mib": large["dispatcher_growth_within_limit"],
            "worker_store_peak_bytes": large["worker_store"]["sampled_peak_bytes"],
            "worker_store_bound_bytes": large["worker_store"]["bound_bytes"],
            "worker_store_within_bound": large["worker_store"]["within_bound"]}


def verification_summary(verification: dict) -> dict:
    return {fraction: {"ms_per_shard_p50": v["ms_per_shard_p50"],
                       "throughput_ratio_to_fraction_0": v["throughput_ratio_to_fraction_0"]}
            for fraction, v in verification["fractions"].items()}


def run_benchmark(plan: Plan, mode: str, with_ray: bool) -> dict:
    """`with_ray`: measure Ray too when it is installed (otherwise the JSON says how to install it)."""
    started = time.perf_counter()
    result: dict = {"benchmark": "dispatch", "mode": mode, "machine": machine()}
    ray_absent = why_no_ray(with_ray, result["machine"]["ray"])
    if ray_absent:
        progress(f"ray: {next(iter(ray_absent.values()))}")
    # Processes stop (the stack) before their folder goes.
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-dispatch-") as tmp, ExitStack() as stack:
        progress("starting inventory, compile, worker, three dispatchers, sink and relay; "
                 "the same mesh again in plaintext")
        mesh = start_mesh(stack, Path(tmp) / "tls")
        plain = start_mesh(stack, Path(tmp) / "plaintext", secure=False)
        sink = start_role("sink", "--listen", "127.0.0.1:0")
        stack.callback(sink.stop)
        relay = start_role("relay", "--listen", "127.0.0.1:0", "--sink", sink.address)
        stack.callback(relay.stop)
        ray = start_ray(stack, plan) if ray_absent is None else None
        result["setup"] = {
            "worker": {"cpu_devices": WORKER_DEVICES, "emulate": list(EMULATE)},
            "dispatchers": {"per_shard_overhead": {"ACCELMESH_MAX_SHARD_BYTES": SMALL_SHARD_BYTES},
                            "streaming": "defaults", "small_inflight_budget": BOUNDED_ENV},
            "processes": "inventory, compile, worker, 3 x dispatch (python -m ...), sink and relay "
                         "(this file, --role), all on loopback; the bench process is the client",
            "security": "mutual TLS + bearer tokens on every mesh hop; a second mesh of the same processes runs "
                        "in plaintext without authentication for the security section",
            "ray": (f"a local Ray {ray.version} with {len(ray.actors)} actors, one per worker device, running the "
                    "same programs on the same inputs, interleaved with the mesh arms" if ray else ray_absent),
        }
        floor_pipe = pipe_stub(sink.address)
        overhead = bench_overhead_arms([mesh, plain], plan, floor_pipe, pipe_stub(relay.address), ray)
        result["per_shard_overhead"] = overhead[mesh.label]
        result["grpc_message_cost"] = message_cost(result["per_shard_overhead"])
        result["streaming"], ray_runs = bench_streaming(mesh, plain, relay, sink, plan, ray)
        result["large_direct_job"] = bench_large_direct(mesh, plan)
        result["security"] = security_section(overhead[mesh.label], overhead[plain.label], result["streaming"])
        result["ray"] = ray_section(ray, overhead, result["streaming"], ray_runs) if ray else ray_absent
        result["verification"] = bench_verification(stack, Path(tmp) / "verification", plan)
    result.update(bench_planning(plan))
    result["summary"] = summary(result)
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def run_large_direct_only(plan: Plan, mode: str) -> dict:
    started = time.perf_counter()
    result: dict = {"benchmark": "dispatch", "mode": mode, "only": "large-direct", "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-large-") as tmp, ExitStack() as stack:
        result["large_direct_job"] = bench_large_direct(start_mesh(stack, Path(tmp)), plan)
    result["summary"] = {"large_direct_job": large_direct_summary(result["large_direct_job"])}
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def run_verification_only(plan: Plan, mode: str) -> dict:
    started = time.perf_counter()
    result: dict = {"benchmark": "dispatch", "mode": mode, "only": "verification", "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-verify-") as tmp, ExitStack() as stack:
        result["verification"] = bench_verification(stack, Path(tmp), plan)
    result["summary"] = {"verification_cost": verification_summary(result["verification"])}
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    parser.add_argument("--no-ray", action="store_true",
                        help="leave Ray out even when it is installed (it is measured beside the mesh by default)")
    parser.add_argument("--only", choices=("verification", "large-direct"), default="",
                        help="run one section alone (its own mesh): the rest of the JSON is left out")
    parser.add_argument("--role", choices=("bench", "relay", "sink"), default="bench",
                        help="internal: the bare pipeline's processes")
    parser.add_argument("--listen", default="127.0.0.1:0", help="relay and sink: where to serve")
    parser.add_argument("--sink", default="", help="relay: the sink's address")
    args = parser.parse_args(argv)
    if args.role != "bench":
        serve_role(args.role, args.listen, args.sink)
        return 0
    mode = "quick" if args.quick else "full"
    if args.only == "verification":
        result = run_verification_only(QUICK if args.quick else FULL, mode)
    elif args.only == "large-direct":
        result = run_large_direct_only(QUICK if args.quick else FULL, mode)
    else:
        result = run_benchmark(QUICK if args.quick else FULL, mode, with_ray=not args.no_ray)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
