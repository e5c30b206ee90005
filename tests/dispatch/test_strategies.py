"""The job lifecycle and its strategies in this process, against a fake `Mesh`: combining,
retries, a shard that fails everywhere, cancellation, the in-flight budget, inputs that end
early, a bug in a shard, training steps, and a pipeline's micro-batches through its stages. No processes and no sockets: the fake
runs each shard with numpy and can be told to fail or to hold a shard until the test lets go."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.hardware.catalog import resolve_type
from accelmesh.programs import LayerInfo, OutputSpec, Program, TensorSpec
from dispatch_svc import delivery
from dispatch_svc import records as m
from dispatch_svc.device_queues import ShardFailed
from dispatch_svc.interface import ArtifactRef, Build, JobDevice, RuleChoice, ScoredStatus, Scoring, ShardOutput
from dispatch_svc.jobs import JobBook
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.runner import JobRunner
from dispatch_svc.training import TrainingOptions, minibatches

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


class FakeMesh:
    """The Mesh port over in-process devices of two catalog types, one build per type.

    `fail[device_id] = n` fails that device's next n attempts; `crash` makes every attempt raise
    a bug; with `hold` set, each attempt waits (cancellable) until the test sets `let_go`."""

    def __init__(self, program: Program, types=("v100-32gb", "v100-32gb", "a100-80gb")):
        self.program = program
        self.devices = [JobDevice(resolve_type(t).device_spec("10.0.0.1", i), "10.0.0.1:50070")
                        for i, t in enumerate(types)]
        self.fail: dict[str, int] = {}
        self.crash = False
        self.hold = False
        self.started, self.let_go = threading.Event(), threading.Event()
        self.reserved: dict[str, list] = {}
        self.released: list[str] = []
        self.attempts: list[tuple[str, int, int]] = []  # (device id, shard index, attempt)
        self._lock = threading.Lock()
        self._running_bytes = 0
        self.peak_running_bytes = 0

    def candidate_devices(self, constraints):
        return [d for d in self.devices if not constraints.filter or constraints.filter in d.spec.type]

    def refresh(self, devices):
        return list(devices)

    def describe_program(self, name, version):
        if name != self.program.name:
            raise errors.NotFound(f"program {name!r} is not registered")
        return self.program

    def compile(self, program, devices, batch_sizes):
        builds = {}
        for d in devices:
            key = f"cuda:{d.spec.type}[]"
            ids = builds[key].device_ids + (d.id,) if key in builds else (d.id,)
            builds[key] = Build(key, "cuda-fp32", "fp32", None, ids, ArtifactRef(f"p-{key}", "d", "stablehlo", 0),
                                {b: ArtifactRef(f"e{b}-{key}", "d", "executable", b) for b in batch_sizes})
        return list(builds.values())

    def fetch_parameters(self, program, seed):
        return [BIAS] if program is AFFINE else [np.zeros(4, np.float32)]

    def reserve(self, job_id, claims, ttl_s):
        self.reserved[job_id] = list(claims)

    def release(self, job_id):
        self.released.append(job_id)

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None):
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
                raise ShardFailed("UNAVAILABLE: the worker went away")
            return ShardOutput(self.run(dict(arrays)), 0.0, 0.0, 0.001, "executable")
        finally:
            with self._lock:
                self._running_bytes -= nbytes

    def run(self, a: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.program is AFFINE:
            return [2 * a["x"] + a["b"], a["x"].sum(axis=0)]
        err = a["x"] @ a["w"] - a["y"]
        return [(2 * a["x"].T @ err / len(err)).astype(np.float32), np.float32(np.mean(err ** 2))]


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


def runner_for(mesh: FakeMesh, tmp_path, *, max_shard_bytes=1024, inflight_bytes=1 << 20) -> JobRunner:
    return JobRunner(mesh, JobBook(tmp_path, retention_s=3600), ThroughputModel(),
                     max_shard_bytes=max_shard_bytes, inflight_bytes=inflight_bytes)


def run(runner: JobRunner, spec: m.JobSpec, feed: Feed) -> m.JobRecord:
    job, live = runner.start(spec)
    runner.run(job, live, feed, background=False)
    return runner.book.get(job.job_id)


def result(runner: JobRunner, job: m.JobRecord, name: str) -> np.ndarray:
    return next(e for e in runner.book.results.entries(job.job_id) if e.name == name).read()


X = np.random.default_rng(0).normal(size=(200, 4)).astype(np.float32)


def test_inference_concatenates_in_row_order_and_sums_across_devices(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    np.testing.assert_allclose(result(runner, job, "s"), X.sum(axis=0), rtol=1e-5)
    assert len(job.shards) > len(mesh.devices) and all(s.done and s.attempts == 1 for s in job.shards)
    assert {s.device_id for s in job.shards} == {d.id for d in mesh.devices}
    assert sorted(d for d, _ in mesh.reserved[job.job_id]) == sorted(d.id for d in mesh.devices)
    assert mesh.released == [job.job_id]


def test_a_failed_shard_is_retried_on_another_device_of_its_type_and_recorded(tmp_path):
    mesh = FakeMesh(AFFINE)
    first_v100 = mesh.devices[0].id
    mesh.fail[first_v100] = 1
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    (retried,) = [s for s in job.shards if s.attempts > 1]
    assert retried.device_id == mesh.devices[1].id  # the other V100: it has the artifact
    assert retried.failures == [f"{first_v100}: UNAVAILABLE: the worker went away"]
    assert first_v100 not in {d for d, _, a in mesh.attempts if a > 1}  # a failed device gets no more
    events = [e.type for e in runner.book.events(job.job_id)]
    assert events.count(m.SHARD_RETRIED) == 1 and events[-1] == m.SUCCEEDED


def test_a_shard_that_fails_on_every_device_fails_the_job_naming_every_cause(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.fail = {d.id: 100 for d in mesh.devices}
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.FAILED
    # Every device failed its first shard, so the first shard to run out of devices ends the job.
    assert re.fullmatch(r"shard \d+ could not run: 10\.0\.0\.1/cuda:\d: UNAVAILABLE: the worker went away"
                        r"; no other device can take it", job.error), job.error
    assert {d for d, _, _ in mesh.attempts} == {d.id for d in mesh.devices}
    assert mesh.released == [job.job_id]


def test_a_cancel_while_shards_run_stops_the_job_and_releases_its_devices(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.hold = True
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    runner.run(job, live, Feed([X]))  # shards collected in the background
    assert mesh.started.wait(WAIT_S)
    runner.cancel(job.job_id)
    assert live.done.wait(WAIT_S)
    ended = runner.book.get(job.job_id)
    assert ended.state == m.CANCELLED and mesh.released == [job.job_id]
    assert not all(s.done for s in ended.shards)
    attempts = len(mesh.attempts)
    mesh.let_go.set()
    assert len(mesh.attempts) == attempts  # the pool is closed: nothing more runs


def test_the_in_flight_budget_bounds_the_shard_inputs_held_at_once(tmp_path):
    mesh = FakeMesh(AFFINE)
    shard_bytes = 8 * 4 * 4  # max_shard_bytes below: 8 rows of 4 float32
    runner = runner_for(mesh, tmp_path, max_shard_bytes=shard_bytes, inflight_bytes=2 * shard_bytes)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X], block_rows=8))
    assert job.state == m.SUCCEEDED and len(job.shards) >= 25 and all(s.rows <= 8 for s in job.shards)
    assert 0 < mesh.peak_running_bytes <= 2 * shard_bytes
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)


def test_inputs_that_end_early_are_refused_in_the_callers_thread_and_fail_the_job(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    with pytest.raises(errors.InvalidArgument, match="ended after 160 of the 200 rows"):
        runner.run(job, live, Feed([X], end_early=160))
    assert runner.book.get(job.job_id).state == m.FAILED and mesh.released == [job.job_id]


def test_a_bug_in_the_shard_path_fails_the_job_and_is_not_taken_for_a_cancel(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.crash = True
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.FAILED and "a bug in the shard path" in job.error


def test_no_matching_device_fails_before_anything_is_reserved(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X], constraints=m.Constraints(filter="tpu")))
    with pytest.raises(errors.FailedPrecondition, match="no device can run affine@1"):
        runner.run(job, live, Feed([X]))
    assert mesh.reserved == {} and runner.book.get(job.job_id).state == m.FAILED


def test_training_steps_equal_sgd_on_each_full_mini_batch(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0, 0.0], np.float32)).astype(np.float32)
    options = TrainingOptions(epochs=3, batch_size=40, learning_rate=0.05, momentum=0.5, shuffle_seed=2)
    mesh = FakeMesh(LINREG)
    mesh.fail[mesh.devices[2].id] = 1  # one step's shard is retried: the step must not change
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=options), Feed([x, y]))
    assert job.state == m.SUCCEEDED

    w, optimizer, losses = np.zeros(4, np.float32), options.optimizer(), []
    for batch in minibatches(96, 40, 3, 2):
        bx, by = x[batch.indices], y[batch.indices]
        err = bx @ w - by
        losses.append(float(np.mean(err ** 2)))
        (w,) = optimizer.step([w], [(2 * bx.T @ err / len(err)).astype(np.float32)])
    np.testing.assert_allclose(result(runner, job, "w"), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result(runner, job, "losses"), losses, rtol=1e-5)
    assert len(losses) == 9 and losses[-1] < losses[0]


# -- the pipeline strategy ---------------------------------------------------------------------

LAYERS = 4
CHAIN = Program(
    name="chain", version="1", kind="model", description="four layers, each adds its own vector",
    parameters=tuple(TensorSpec(f"layer_{i}/k", "float32", (4,)) for i in range(LAYERS)),
    inputs=(TensorSpec("x", "float32", (None, 4)),), outputs=(OutputSpec("y", "float32", (None, 4), "concat"),),
    digest="c1",
    layers=tuple(LayerInfo(f"layer_{i}", "dense", i, {"k": (4,)}, 4, 16, 8.0, 32.0, 16) for i in range(LAYERS)))
KS = [np.full(4, 10.0 ** i, np.float32) for i in range(LAYERS)]


class FakePipelineMesh(FakeMesh):
    """Adds what placement asks (rules, scores) and stage builds; a stage adds its layers' vectors.
    `order` lists (micro-batch, stage) as each stage's run ends."""

    def __init__(self):
        super().__init__(CHAIN, types=("v100-32gb", "a100-80gb"))
        self.order: list[tuple[int, int]] = []
        self.stages: dict[str, int] = {}  # stage program name -> stage position by first layer

    def explain_rule(self, device):
        return RuleChoice(f"cuda:{device.spec.type}[]", "cuda-fp32", "fp32")

    def score_devices(self, kind, precision, intensity, weights, constraints, device_ids=()):
        assert sorted(device_ids) == sorted(d.id for d in self.devices)  # the refreshed candidates
        status = ScoredStatus(1.0, 10.0, 30 * 10**9, 0.0, 0.0)
        return Scoring({d.id: status for d in self.devices}, (0.5, 0.25, 0.25), "test weights")

    def compile_stage(self, program, devices, first, count, batch_sizes=()):
        stage = Program(name=f"chain[{first}:{first + count}]", version="1", kind="function", description="",
                        parameters=program.parameters[first: first + count], inputs=program.inputs,
                        outputs=program.outputs, digest=f"s{first}")
        return stage, self.compile(stage, devices, batch_sizes)

    def fetch_parameters(self, program, seed):
        return list(KS)

    def run(self, a):
        return [a["x"] + sum(v for name, v in a.items() if name.endswith("/k"))]

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None):
        out = super().execute(job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys)
        with self._lock:
            self.order.append(divmod(shard_index, self.stage_count))
        return out


def test_a_pipeline_runs_every_micro_batch_through_the_stages_in_order_and_retries_a_stage(tmp_path):
    mesh = FakePipelineMesh()
    mesh.fail[mesh.devices[1].id] = 1  # its first stage run fails once: retried on the other device
    runner = runner_for(mesh, tmp_path)
    x = np.random.default_rng(3).normal(size=(40, 4)).astype(np.float32)
    placement = m.PlacementSpec(strategy="ranked", device_count=2, micro_batch_rows=8)
    spec = spec_for(CHAIN, [x], placement=placement)
    _, plan, _, _ = runner.plan(spec)
    mesh.stage_count = stages = len(plan.placement.stages)
    assert stages >= 2 and {s.device_id for s in plan.placement.stages} == {d.id for d in mesh.devices}
    job = run(runner, spec, Feed([x]))
    assert job.state == m.SUCCEEDED, job.error
    np.testing.assert_allclose(result(runner, job, "y"), x + sum(KS), rtol=1e-6)
    done = mesh.order
    assert sorted(done) == [(b, s) for b in range(5) for s in range(stages)]
    for b in range(5):  # a micro-batch leaves each stage before it enters the next
        assert [done.index((b, s)) for s in range(stages)] == sorted(done.index((b, s)) for s in range(stages))
    retried = [s for s in job.shards if s.attempts > 1]
    assert len(retried) == 1 and retried[0].failures[0].startswith(mesh.devices[1].id)
    assert sorted(d for d, _ in mesh.reserved[job.job_id]) == sorted(d.id for d in mesh.devices)
    assert mesh.released == [job.job_id]


def test_a_run_hands_back_events_then_final_rows_in_order_then_folded_outputs_then_the_job(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    pieces = list(delivery.run(runner, job, live, Feed([X]), slab_bytes=64))
    assert isinstance(pieces[0], delivery.EventOut) and pieces[0].event.type == m.PLANNED
    assert isinstance(pieces[-1], delivery.JobOut) and pieces[-1].job.state == m.SUCCEEDED
    y = [p for p in pieces if isinstance(p, delivery.RowsOut) and p.entry.name == "y"]
    assert [p.first_row for p in y] == list(np.cumsum([0] + [len(p.rows) for p in y[:-1]]))  # in order, once
    np.testing.assert_array_equal(np.concatenate([p.rows for p in y]), 2 * X + BIAS)
    headers = [i for i, p in enumerate(pieces) if isinstance(p, delivery.TensorOut)]
    assert [pieces[i].entry.name for i in headers] == ["y", "s"]
    succeeded = next(i for i, p in enumerate(pieces) if isinstance(p, delivery.EventOut) and p.event.type == "succeeded")
    assert headers[1] > succeeded > pieces.index(y[0])  # the sum only once final; rows before the end
    (s,) = [p for p in pieces if isinstance(p, delivery.RowsOut) and p.entry.name == "s"]
    np.testing.assert_allclose(s.rows, X.sum(axis=0), rtol=1e-5)
