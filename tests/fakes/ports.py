"""The in-process fakes of the dispatcher's ports (ports.py: Inventory, Compiler, Workers) the
strategy tests run jobs against, and what they share: the programs the fake workers run with
numpy, an input feed, and the calls that start a job and read its results. A module of its own so
that several test modules use one set of fakes (tests/worker does the same)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from accelmesh import errors
from accelmesh.hardware.catalog import resolve_type
from accelmesh.programs import LayerInfo, OutputSpec, Program, TensorSpec
from accelmesh.runtime.tensors import TensorCollector, split
from dispatch_svc.dataplane.device_queues import ShardFailed
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.jobs.training_options import TrainingOptions, minibatches
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.ports import ArtifactRef, Build, JobDevice, RuleChoice, ScoredStatus, Scoring, ShardOutput

WAIT_S = 30.0
AFFINE = Program(
    name="affine", version="1", kind="function", description="y = 2x + b, s = the sum of x's rows",
    parameters=(TensorSpec("b", "float32", (4,)),), inputs=(TensorSpec("x", "float32", (None, 4)),),
    outputs=(OutputSpec("y", "float32", (None, 4), "concat"), OutputSpec("s", "float32", (4,), "sum")), digest="a1")
LINREG = Program(
    name="linreg_step", version="1", kind="training_step", description="squared error of x @ w against y",
    parameters=(TensorSpec("w", "float32", (4,)),),
    inputs=(TensorSpec("x", "float32", (None, 4)), TensorSpec("y", "float32", (None,))),
    outputs=(OutputSpec("grad/w", "float32", (4,), "mean"), OutputSpec("loss", "float32", (), "mean")), digest="l1")
BIAS = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def delivered(outputs: list, place_outputs) -> list:
    """`outputs` as a worker's answer leaves GrpcWorkers: sent in chunks (small ones, so a tensor takes
    several) into a TensorCollector with the shard's `place_outputs`."""
    collector = TensorCollector("output", place_outputs)
    for index, value in enumerate(outputs):
        header, chunks = split(f"output_{index}", value, 24)
        collector.header(header)
        for chunk in chunks:
            collector.chunk(chunk)
    return list(collector.results().values())


def fake_devices(types, nodes: int = 1) -> list[JobDevice]:
    """One device of each type, dealt in turn to `nodes` nodes (10.0.0.1, 10.0.0.2, ...)."""
    ips = [f"10.0.0.{k % nodes + 1}" for k in range(len(types))]
    return [JobDevice(resolve_type(t).device_spec(ip, i), f"{ip}:50070") for i, (t, ip) in enumerate(zip(types, ips))]


class FakeInventory:
    """The Inventory port over the test's devices: every reservation granted and noted."""

    def __init__(self, devices: list[JobDevice]):
        self.devices = devices
        self.reserved: dict[str, list] = {}
        self.released: list[str] = []
        self.renewed: list[str] = []
        self.suspects: dict[str, str] = {}  # node address -> reason (mark_suspect)
        self.lost: set[str] = set()  # device ids the inventory holds lost (lost_devices)

    def mark_suspect(self, address, reason):
        self.suspects.setdefault(address, reason)

    def candidate_devices(self, constraints):
        return [d for d in self.devices if not constraints.filter or constraints.filter in d.spec.type]

    def refresh(self, devices):
        return list(devices)

    def reserve(self, job_id, claims, ttl_s):
        if not claims:  # as the inventory's ReserveDevices refuses it
            raise errors.InvalidArgument("claims is empty; list at least one device to reserve", field="claims")
        self.reserved[job_id] = list(claims)

    def renew(self, job_id, device_ids, ttl_s, timeout_s):
        self.renewed.append(job_id)

    def release(self, job_id):
        self.released.append(job_id)

    def pool_state(self):
        return tuple(sorted(self.reserved))

    def reserved_device_ids(self):
        return frozenset(device for claims in self.reserved.values() for device, _ in claims)

    def lost_devices(self, device_ids):
        return frozenset(self.lost & set(device_ids))


class FakeCompiler:
    """The Compiler port for one program: one build per device type."""

    def __init__(self, program: Program):
        self.program = program

    def describe_program(self, name, version):
        if name != self.program.name:
            raise errors.NotFound(f"program {name!r} is not registered")
        return self.program

    def compile(self, program, devices, batch_sizes, precision=""):
        builds = {}
        for d in devices:
            key = f"cuda:{d.spec.type}[]"
            ids = builds[key].device_ids + (d.id,) if key in builds else (d.id,)
            builds[key] = Build(key, "cuda-fp32", "fp32", None, ids, ArtifactRef(f"p-{key}", "d", "stablehlo", 0),
                                {b: ArtifactRef(f"e{b}-{key}", "d", "executable", b) for b in batch_sizes})
        return list(builds.values())

    def fetch_parameters(self, program, seed):
        return [BIAS] if program is AFFINE else [np.zeros(4, np.float32)]


class FakeWorkers:
    """The Workers port, running the program with numpy on the test's devices.

    `fail[device_id] = n` fails that device's next n attempts; `crash` makes every attempt raise
    a bug; with `hold` set, each attempt waits (cancellable) until the test sets `let_go`;
    `forge[device_id]` rewrites what that device returns, as a rogue or broken worker would.
    Outputs are answered as GrpcWorkers answers them: through the shard's `place_outputs`, so those
    it places are written where it says as their chunks arrive (`delivered`)."""

    def __init__(self, program: Program):
        self.program = program
        self.fail: dict[str, int] = {}
        self.forge: dict[str, Callable[[list[np.ndarray]], list[np.ndarray]]] = {}
        self.crash = False
        self.hold = False
        self.started, self.let_go = threading.Event(), threading.Event()
        self.refuse = ""  # set: every device refuses every shard with FAILED_PRECONDITION and this text
        self.attempts: list[tuple[str, int, int]] = []  # (device id, shard index, attempt)
        self.released: list[str] = []
        self.dropped: list[tuple[str, str]] = []  # (job id, device id) of drop_device calls
        self._lock = threading.Lock()
        self._running_bytes = 0
        self.peak_running_bytes = 0

    def release(self, job_id):
        self.released.append(job_id)

    def drop_device(self, job_id, device_id, cause):
        self.dropped.append((job_id, device_id))

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None,
                place_outputs=None, stored=None):
        nbytes = sum(a.nbytes for name, a in arrays if name in {i.name for i in self.program.inputs})
        with self._lock:
            self.attempts.append((device.id, shard_index, attempt))
            remaining = self.fail.get(device.id, 0)
            self.fail[device.id] = max(0, remaining - 1)
            self._running_bytes += nbytes
            self.peak_running_bytes = max(self.peak_running_bytes, self._running_bytes)
        try:
            if self.hold:
                self.started.set()
                while not self.let_go.wait(0.01):
                    if scope.cancelled.is_set():
                        raise ShardFailed("CANCELLED: the job was cancelled")
            if self.crash:
                raise RuntimeError("a bug in the shard path")
            if remaining:
                raise ShardFailed("UNAVAILABLE: the worker went away", "UNAVAILABLE")
            if self.refuse:  # what every worker answers when the artifact itself is broken
                raise ShardFailed(f"FAILED_PRECONDITION: {self.refuse}", "FAILED_PRECONDITION")
            outputs = self.run(dict(arrays))
            forge = self.forge.get(device.id)
            return ShardOutput(delivered(forge(outputs) if forge else outputs, place_outputs), 0.0, 0.0, 0.001,
                               "executable")
        finally:
            with self._lock:
                self._running_bytes -= nbytes

    def execute_group(self, calls, scope):
        """Each call as `execute` runs it, in turn, its ShardFailed given in its place (the port's contract)."""
        for c in calls:
            try:
                yield self.execute(c.job_id, c.shard_index, c.attempt, c.device, c.build, c.artifact, c.arrays,
                                   c.rows, scope, c.held_keys, c.place_outputs, c.stored)
            except ShardFailed as exc:
                yield exc

    def run(self, a: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.program is AFFINE:
            return [2 * a["x"] + a["b"], a["x"].sum(axis=0)]
        err = a["x"] @ a["w"] - a["y"]
        return [(2 * a["x"].T @ err / len(err)).astype(np.float32), np.float32(np.mean(err ** 2))]


class FakeMesh:
    """One in-process mesh as its three ports over the same devices of two catalog types: a test
    reaches the one it exercises (`inventory`, `compiler`, `workers`), and may give its own class
    of any of them."""

    def __init__(self, program: Program, types=("v100-32gb", "v100-32gb", "a100-80gb"), *,
                 inventory=FakeInventory, compiler=FakeCompiler, workers=FakeWorkers, nodes: int = 1):
        self.program = program
        self.devices = fake_devices(types, nodes)
        self.inventory = inventory(self.devices)
        self.compiler = compiler(program)
        self.workers = workers(program)


class Feed:
    def __init__(self, arrays: list[np.ndarray], block_rows: int = 16, end_early: int | None = None):
        self.arrays, self.block_rows, self.end_early = arrays, block_rows, end_early

    def parameters(self):
        return []

    def blocks(self):
        rows = self.arrays[0].shape[0] if self.end_early is None else self.end_early
        for first in range(0, rows, self.block_rows):
            yield first, [a[first: min(first + self.block_rows, rows)] for a in self.arrays]


def spec_for(program: Program, arrays, **fields) -> m.JobSpec:
    inputs = tuple(m.InputDecl(i.name, i.dtype, a.shape) for i, a in zip(program.inputs, arrays))
    return m.JobSpec(program=program.name, inputs=inputs, **fields)


def runner_for(mesh: FakeMesh, tmp_path, *, max_shard_bytes=1024, inflight_bytes=1 << 20, verify_fraction=0.0,
               **options) -> JobRunner:
    """A runner on the fake mesh's three ports and a job book in `tmp_path` (`options`: JobRunner's)."""
    return JobRunner(mesh.inventory, mesh.compiler, mesh.workers, JobBook(tmp_path, retention_s=3600),
                     ThroughputModel(), limits=Limits(max_shard_bytes, inflight_bytes, verify_fraction=verify_fraction),
                     **options)


def run(runner: JobRunner, spec: m.JobSpec, feed: Feed) -> m.JobRecord:
    job, live = runner.start(spec)
    runner.run(job, live, feed, background=False)
    return runner.book.get(job.job_id)


def result(runner: JobRunner, job: m.JobRecord, name: str) -> np.ndarray:
    return next(e for e in runner.book.results.entries(job.job_id) if e.name == name).read()


X = np.random.default_rng(0).normal(size=(200, 4)).astype(np.float32)


def linreg_data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """96 rows of x and y = x @ a fixed w, for LINREG."""
    x = np.random.default_rng(seed).normal(size=(96, 4)).astype(np.float32)
    return x, (x @ np.array([0.5, -1.0, 2.0, 0.0], np.float32)).astype(np.float32)


def linreg_sgd(x: np.ndarray, y: np.ndarray, options: TrainingOptions) -> tuple[np.ndarray, list[float]]:
    """What training LINREG should give: the optimizer on each full mini-batch, in one process."""
    w, optimizer, losses = np.zeros(4, np.float32), options.optimizer(), []
    for batch in minibatches(len(x), options.batch_size, options.epochs, options.shuffle_seed):
        bx, by = x[batch.indices], y[batch.indices]
        err = bx @ w - by
        losses.append(float(np.mean(err ** 2)))
        (w,) = optimizer.step([w], [(2 * bx.T @ err / len(err)).astype(np.float32)])
    return w, losses


# -- the pipeline strategy's fake --------------------------------------------------------------

LAYERS = 4
CHAIN = Program(
    name="chain", version="1", kind="model", description="four layers, each adds its own vector",
    parameters=tuple(TensorSpec(f"layer_{i}/k", "float32", (4,)) for i in range(LAYERS)),
    inputs=(TensorSpec("x", "float32", (None, 4)),), outputs=(OutputSpec("y", "float32", (None, 4), "concat"),),
    digest="c1",
    layers=tuple(LayerInfo(f"layer_{i}", "dense", i, {"k": (4,)}, 4, 16, 8.0, 32.0, 16) for i in range(LAYERS)))
KS = [np.full(4, 10.0 ** i, np.float32) for i in range(LAYERS)]


class FakePipelineInventory(FakeInventory):
    """Adds the scores placement asks for."""

    def score_devices(self, kind, precision, intensity, weights, constraints, device_ids=()):
        assert sorted(device_ids) == sorted(d.id for d in self.devices)  # the refreshed candidates
        status = ScoredStatus(1.0, 10.0, 30 * 10**9, 0.0, 0.0)
        return Scoring({d.id: status for d in self.devices}, (0.5, 0.25, 0.25), "test weights")


class FakePipelineCompiler(FakeCompiler):
    """Adds rules and stage builds."""

    def explain_rule(self, device, precision=""):
        return RuleChoice(f"cuda:{device.spec.type}[]", "cuda-fp32", "fp32")

    def compile_stage(self, program, devices, first, count, batch_sizes=(), backward=False, precision=""):
        stage = Program(name=f"chain[{first}:{first + count}]", version="1", kind="function", description="",
                        parameters=program.parameters[first: first + count], inputs=program.inputs,
                        outputs=program.outputs, digest=f"s{first}")
        return stage, self.compile(stage, devices, batch_sizes)

    def fetch_parameters(self, program, seed):
        return list(KS)


class FakePipelineWorkers(FakeWorkers):
    """A stage adds its layers' vectors. `order` lists (micro-batch, stage) as each stage's run
    ends; `stage_count` is set from the plan (a shard's index is micro-batch * stages + stage)."""

    def __init__(self, program: Program):
        super().__init__(program)
        self.order: list[tuple[int, int]] = []
        self.stage_count = 1

    def run(self, a):
        return [a["x"] + sum(v for name, v in a.items() if name.endswith("/k"))]

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None,
                place_outputs=None, stored=None):
        out = super().execute(job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys,
                              place_outputs)
        with self._lock:
            self.order.append(divmod(shard_index, self.stage_count))
        return out


def fake_pipeline_mesh() -> FakeMesh:
    """The pipeline strategy's fakes: CHAIN on a V100 and an A100."""
    return FakeMesh(CHAIN, types=("v100-32gb", "a100-80gb"), inventory=FakePipelineInventory,
                    compiler=FakePipelineCompiler, workers=FakePipelineWorkers)
