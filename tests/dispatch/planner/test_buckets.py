"""Bucketed shard sizes under load: 100 jobs of one program and input size, with device speeds
that drift job to job, run through the job runner against the fake mesh (tests/fakes/ports.py), ask the
compile service for a handful of executable sizes per target type, not one per rate-driven row
count; every job's concatenated, summed and averaged outputs stay exact.

The bound: a job's row counts are its bucket ladder's rungs plus at most one tail (rows % unit),
and the ladder depends on the job's rows and largest shard alone (dispatch_svc.planner.buckets),
so however the measured rates move, every job of one input size draws on the same
BUCKET_RUNGS + 1 = 6 sizes; data_parallel compiles the sizes a plan uses for every target type.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions
from dispatch_svc.planner import BUCKET_RUNGS, PlannedDevice, bucket_ladder, plan_shards

from fakes.ports import (
    AFFINE,
    BIAS,
    LINREG,
    FakeCompiler,
    FakeMesh,
    FakeWorkers,
    Feed,
    linreg_data,
    linreg_sgd,
    result,
    run,
    runner_for,
    spec_for,
)

JOBS = 100
TYPES = ("v100-32gb", "v100-32gb", "a100-80gb", "t4")
ROWS = 200
MAX_SHARD_BYTES = 1024  # 64 rows of AFFINE's 4 float32: ladder unit 4, rungs 4..64, no tail
SIZE_BOUND = BUCKET_RUNGS + 1
# Integer-valued rows: every partial sum is exact, so the folded "s" must have the batch's bits.
X = np.random.default_rng(8).integers(-100, 100, size=(ROWS, 4)).astype(np.float32)


def type_key(device) -> str:
    return f"cuda:{device.spec.type}[]"  # the fake mesh's target type key


def rows_by_device(plan: m.Plan) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for shard in plan.shards:
        totals[shard.device_id] = totals.get(shard.device_id, 0) + shard.rows
    return tuple(sorted(totals.items()))


class DriftingCompiler(FakeCompiler):
    """Every Compile call's executable sizes are recorded per target type."""

    def __init__(self, program):
        super().__init__(program)
        self.executables: dict[str, set[int]] = {}  # target type -> batch sizes asked for

    def compile(self, program, devices, batch_sizes, precision=""):
        builds = super().compile(program, devices, batch_sizes, precision)
        for build in builds:
            self.executables.setdefault(build.target_type, set()).update(batch_sizes)
        return builds


class DriftingWorkers(FakeWorkers):
    """Each target type's speed (`speed`, set by DriftingMesh) is reported as the shard's execute
    seconds, so the throughput model follows it."""

    speed: dict[str, float]

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None,
                place_outputs=None, stored=None):
        out = super().execute(job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys,
                              place_outputs)
        assert artifact.format == "executable" and artifact.batch_size == rows  # a compiled size, never a fallback
        return dataclasses.replace(out, execute_seconds=rows / self.speed[build.target_type])


class DriftingMesh(FakeMesh):
    """Each target type's speed takes a seeded random walk between jobs (a busy neighbour, a
    thermal throttle)."""

    def __init__(self, program, seed: int):
        super().__init__(program, types=TYPES, compiler=DriftingCompiler, workers=DriftingWorkers)
        self._rng = random.Random(seed)
        self.speed = self.workers.speed = {type_key(d): 1000.0 for d in self.devices}
        self.executables = self.compiler.executables

    def drift(self) -> None:
        for key in self.speed:
            self.speed[key] = min(1e5, max(10.0, self.speed[key] * self._rng.uniform(0.3, 3.0)))


def test_a_hundred_jobs_under_drifting_rates_build_a_handful_of_sizes_per_target_type(tmp_path):
    mesh = DriftingMesh(AFFINE, seed=1)
    runner = runner_for(mesh, tmp_path, max_shard_bytes=MAX_SHARD_BYTES)
    ladder = bucket_ladder(ROWS, MAX_SHARD_BYTES // 16)
    splits, free_sizes = set(), set()
    for _ in range(JOBS):
        mesh.drift()
        job = run(runner, spec_for(AFFINE, [X]), Feed([X], block_rows=24))
        assert job.state == m.SUCCEEDED, job.error
        np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
        assert result(runner, job, "s").tobytes() == X.sum(axis=0).tobytes()
        assert {s.rows for s in job.plan.shards} <= set(ladder.sizes)
        splits.add(rows_by_device(job.plan))
        # What the same rates would have asked for unbucketed: the sizes the problem was made of
        # (a type the plan left out had too slow a rate for a unit: it stands in as nearly idle).
        rate = {t.target_type: t.rows_per_second for t in job.plan.targets}
        pool = [PlannedDevice(d.id, key, rate.get(key, 1e-9)) for d in mesh.devices if (key := type_key(d))]
        free_sizes |= {s.rows for s in plan_shards(ROWS, pool, max_shard_rows=64, exact=True).shards}

    assert len(splits) >= 20  # the rates really moved the plans
    assert set(mesh.executables) == {type_key(d) for d in mesh.devices}
    for target_type, sizes in mesh.executables.items():
        assert sizes <= set(ladder.sizes) and len(sizes) <= SIZE_BOUND, (target_type, sorted(sizes))
    assert len(free_sizes) > 3 * SIZE_BOUND, sorted(free_sizes)


def test_planning_a_hundred_jobs_under_varied_rates_asks_for_the_same_few_sizes(tmp_path):
    """PlanJob's path (nothing runs): rates recorded straight into the throughput model."""
    mesh = DriftingMesh(AFFINE, seed=2)
    runner = runner_for(mesh, tmp_path, max_shard_bytes=4096)  # 256-row shards: unit 16
    rng = random.Random(3)
    rows = 1000  # rungs 16..256 and a tail of 8: every size the ladder has
    x = np.zeros((rows, 4), np.float32)
    splits = set()
    for _ in range(JOBS):
        for key in mesh.speed:
            runner.throughput.record(AFFINE.ref, key, rows=rng.randint(1, 500), seconds=rng.uniform(0.01, 2.0))
        _, plan, _, _ = runner.plan(spec_for(AFFINE, [x]))
        assert sum(s.rows for s in plan.shards) == rows
        splits.add(rows_by_device(plan))
    assert len(splits) >= 50
    ladder = bucket_ladder(rows, 256)
    assert ladder.tail and len(ladder.sizes) == SIZE_BOUND
    for sizes in mesh.executables.values():
        assert sizes <= set(ladder.sizes) and len(sizes) <= SIZE_BOUND


def test_training_over_bucketed_shards_equals_sgd_on_each_full_mini_batch(tmp_path):
    x, y = linreg_data()
    options = TrainingOptions(epochs=2, batch_size=48, learning_rate=0.05, momentum=0.5, shuffle_seed=4)
    mesh = DriftingMesh(LINREG, seed=5)
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=options), Feed([x, y]))
    assert job.state == m.SUCCEEDED, job.error
    assert {s.rows for s in job.plan.shards} <= set(bucket_ladder(48).sizes)  # 48 rows: unit 3, rungs 3..48
    w, losses = linreg_sgd(x, y, options)
    np.testing.assert_allclose(result(runner, job, "w"), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result(runner, job, "losses"), losses, rtol=1e-5)


def _plan_at(rates: dict[str, float], batch: int) -> m.Plan:
    """A training plan's full-batch split over one device per target type at these rates."""
    devices = [PlannedDevice(f"10.0.0.1/cuda:{i}", target, rate) for i, (target, rate) in enumerate(rates.items())]
    split = plan_shards(batch, devices, exact=True, bucket_rungs=BUCKET_RUNGS)
    targets = tuple(m.TargetPlan(d.target_type, "rule", "float32", "key", (d.device_id,), d.rows_per_second, "measured")
                    for d in devices)
    shards = tuple(m.ShardPlan(s.index, s.device_id, s.target_type, s.first_row, s.rows, s.predicted_seconds)
                   for s in split.shards)
    return m.Plan(targets, shards, split.predicted_seconds, split.equal_split_predicted_seconds)


def test_the_last_partial_mini_batch_takes_its_sizes_from_its_own_ladder_whatever_the_rates():
    """301 rows in batches of 64 leave a last batch of 45 in every epoch: under any rates it is
    cut into sizes of the 45-row ladder only, covering its rows once, so 100 training jobs of this
    shape need no more executables for it than the ladder has sizes."""
    from dispatch_svc.execution.strategies.training import plan_rows

    rng = random.Random(11)
    last, seen = 301 % 64, set()
    for _ in range(100):
        plan = _plan_at({"a": rng.uniform(1, 100), "b": rng.uniform(1, 100), "c": rng.uniform(1, 100)}, 64)
        split = plan_rows(plan, last)
        assert [first for first, _, _ in split] == list(np.cumsum([0] + [n for _, n, _ in split])[:-1])
        assert sum(n for _, n, _ in split) == last
        seen |= {n for _, n, _ in split}
        assert plan_rows(plan, 64) == [(s.first_row, s.rows, s.device_id) for s in plan.shards]
    assert seen <= set(bucket_ladder(last, None, BUCKET_RUNGS).sizes), seen
