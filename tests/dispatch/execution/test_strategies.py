"""The job lifecycle and its strategies in this process, against a fake `Mesh` (tests/fakes/ports.py):
combining, retries, a shard that fails everywhere, cancellation, the in-flight budget, inputs
that end early, a bug in a shard, training steps, and a pipeline's micro-batches through its
stages. No processes and no sockets: the fake runs each shard with numpy and can be told to fail
or to hold a shard until the test lets go."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.runtime.tensors import Placed
from dispatch_svc.api import delivery
from dispatch_svc.execution.endings import TRANSIENT_ADVICE
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions

from fakes.ports import (
    AFFINE,
    BIAS,
    CHAIN,
    KS,
    LINREG,
    WAIT_S,
    FakeInventory,
    FakeMesh,
    FakeWorkers,
    Feed,
    X,
    fake_pipeline_mesh,
    linreg_data,
    linreg_sgd,
    result,
    run,
    runner_for,
    spec_for,
)


def test_inference_concatenates_in_row_order_and_sums_across_devices(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    np.testing.assert_allclose(result(runner, job, "s"), X.sum(axis=0), rtol=1e-5)
    assert len(job.shards) > len(mesh.devices) and all(s.done and s.attempts == 1 for s in job.shards)
    assert {s.device_id for s in job.shards} == {d.id for d in mesh.devices}
    assert sorted(d for d, _ in mesh.inventory.reserved[job.job_id]) == sorted(d.id for d in mesh.devices)
    assert mesh.inventory.released == [job.job_id]


class RecordingWorkers(FakeWorkers):
    def __init__(self, program):
        super().__init__(program)
        self.answers = []  # per attempt: the type of each output as the strategy got it

    def execute(self, *args, **kwargs):
        out = super().execute(*args, **kwargs)
        self.answers.append([type(o) for o in out.outputs])
        return out


def test_inference_writes_concatenated_outputs_in_place_as_they_arrive_and_folds_the_rest(tmp_path):
    mesh = FakeMesh(AFFINE, workers=RecordingWorkers)
    mesh.workers.fail[mesh.devices[1].id] = 1  # a failed attempt, then its shard again elsewhere
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    np.testing.assert_allclose(result(runner, job, "s"), X.sum(axis=0), rtol=1e-5)
    # y went to its rows on disk (only what it was comes back), s is folded in memory.
    assert mesh.workers.answers == [[Placed, np.ndarray]] * len(job.shards)


def test_a_failed_shard_is_retried_on_another_device_of_its_type_and_recorded(tmp_path):
    mesh = FakeMesh(AFFINE)
    first_v100 = mesh.devices[0].id
    mesh.workers.fail[first_v100] = 1
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    (retried,) = [s for s in job.shards if s.attempts > 1]
    assert retried.device_id == mesh.devices[1].id  # the other V100: it has the artifact
    assert retried.failures == [f"{first_v100}: UNAVAILABLE: the worker went away"]
    assert first_v100 not in {d for d, _, a in mesh.workers.attempts if a > 1}  # a failed device gets no more
    events = [e.type for e in runner.book.events(job.job_id)]
    assert events.count(m.SHARD_RETRIED) == 1 and events[-1] == m.SUCCEEDED


def test_a_shard_that_fails_on_every_device_fails_the_job_naming_every_cause(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.workers.fail = {d.id: 100 for d in mesh.devices}
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.FAILED
    # Every device failed its first shard, so the first shard to run out of devices ends the job,
    # naming its own failures, or, when other shards took every device out before it was tried
    # anywhere, theirs.
    assert re.fullmatch(r"shard \d+ could not run: (10\.0\.0\.1/cuda:\d: UNAVAILABLE: the worker went away; )+"
                        r"no other device can take it; " + re.escape(TRANSIENT_ADVICE), job.error), job.error
    assert {d for d, _, _ in mesh.workers.attempts} == {d.id for d in mesh.devices}
    assert mesh.inventory.released == [job.job_id]


def test_a_job_failed_by_a_part_of_the_mesh_that_was_away_says_to_submit_it_again(tmp_path):
    """The chaos soak's jobs that failed on an UNAVAILABLE (a worker, an inventory replica or the
    database restarting) said what failed, and not that the same job may run if sent again."""
    mesh = FakeMesh(AFFINE)

    def refresh(devices):
        raise errors.Unavailable("inventory refresh: UNAVAILABLE: node 10.0.0.1:7000 did not answer DescribeNode")
    mesh.inventory.refresh = refresh
    job = failed_in_planning(runner_for(mesh, tmp_path), errors.Unavailable)
    assert job.state == m.FAILED
    assert job.error == ("inventory refresh: UNAVAILABLE: node 10.0.0.1:7000 did not answer DescribeNode; "
                         f"{TRANSIENT_ADVICE}")


def test_a_job_failed_by_its_own_fault_is_not_told_to_submit_again(tmp_path):
    mesh = FakeMesh(AFFINE)

    def refresh(devices):
        raise errors.FailedPrecondition("no device of type 'tpu-v5e' in the pool")
    mesh.inventory.refresh = refresh
    job = failed_in_planning(runner_for(mesh, tmp_path), errors.FailedPrecondition)
    assert job.state == m.FAILED and job.error == "no device of type 'tpu-v5e' in the pool"


def failed_in_planning(runner, kind: type[errors.AccelmeshError]) -> m.JobRecord:
    """The job of AFFINE over X, whose planning raised `kind` to the caller, as its book holds it."""
    job, live = runner.start(spec_for(AFFINE, [X]))
    with pytest.raises(kind):
        runner.run(job, live, Feed([X]), background=False)
    return runner.book.get(job.job_id)


def test_the_advice_to_submit_again_outlives_a_cause_cut_to_the_error_limit():
    from dispatch_svc.execution.endings import failure_message

    message = failure_message(errors.Unavailable("x" * 10_000), 4096)
    assert len(message.encode()) <= 4096 and message.endswith(f"; {TRANSIENT_ADVICE}")
    assert failure_message(errors.Unavailable("the replica stopped; submit it again"), 4096) == \
        "the replica stopped; submit it again"


def test_a_shard_refused_the_same_way_everywhere_fails_the_job_as_not_retryable(tmp_path):
    """An artifact that does not load fails identically on every device: the job says retrying
    will not help (FAILED_PRECONDITION), not that the devices were unavailable."""
    mesh = FakeMesh(AFFINE)
    mesh.workers.refuse = "the artifact did not load: unsupported instruction set"
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.FAILED
    assert re.fullmatch(r"shard \d+ failed the same way on every device tried \(10\.0\.0\.1/cuda:\d"
                        r"(, 10\.0\.0\.1/cuda:\d)*\): FAILED_PRECONDITION: the artifact did not load: "
                        r"unsupported instruction set; retrying will not help", job.error), job.error
    assert mesh.inventory.released == [job.job_id]


def test_a_cancel_while_shards_run_stops_the_job_and_releases_its_devices(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.workers.hold = True
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    runner.run(job, live, Feed([X]))  # shards collected in the background
    assert mesh.workers.started.wait(WAIT_S)
    runner.cancel(job.job_id)
    assert live.done.wait(WAIT_S)
    ended = runner.book.get(job.job_id)
    assert ended.state == m.CANCELLED and mesh.inventory.released == [job.job_id]
    assert not all(s.done for s in ended.shards)
    attempts = len(mesh.workers.attempts)
    mesh.workers.let_go.set()
    assert len(mesh.workers.attempts) == attempts  # the pool is closed: nothing more runs


def test_the_in_flight_budget_bounds_the_shard_inputs_held_at_once(tmp_path):
    mesh = FakeMesh(AFFINE)
    shard_bytes = 8 * 4 * 4  # max_shard_bytes below: 8 rows of 4 float32
    runner = runner_for(mesh, tmp_path, max_shard_bytes=shard_bytes, inflight_bytes=2 * shard_bytes)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X], block_rows=8))
    assert job.state == m.SUCCEEDED and len(job.shards) >= 25 and all(s.rows <= 8 for s in job.shards)
    assert 0 < mesh.workers.peak_running_bytes <= 2 * shard_bytes
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)


def test_inputs_that_end_early_are_refused_in_the_callers_thread_and_fail_the_job(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    with pytest.raises(errors.InvalidArgument, match="ended after 160 of the 200 rows"):
        runner.run(job, live, Feed([X], end_early=160))
    assert runner.book.get(job.job_id).state == m.FAILED and mesh.inventory.released == [job.job_id]


def test_a_bug_in_the_shard_path_fails_the_job_and_is_not_taken_for_a_cancel(tmp_path):
    mesh = FakeMesh(AFFINE)
    mesh.workers.crash = True
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.FAILED and "a bug in the shard path" in job.error


def test_no_matching_device_fails_before_anything_is_reserved(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X], constraints=m.Constraints(filter="tpu")))
    with pytest.raises(errors.FailedPrecondition, match="no device can run affine@1"):
        runner.run(job, live, Feed([X]))
    assert mesh.inventory.reserved == {} and runner.book.get(job.job_id).state == m.FAILED


class UnlistingInventory(FakeInventory):
    """An inventory that cannot be reached for the candidates."""

    def candidate_devices(self, constraints):
        raise errors.Unavailable("inventory at 127.0.0.1:1 is not answering")


@pytest.mark.parametrize("spec, raised, match", [
    (lambda: dataclasses.replace(spec_for(AFFINE, [X]), program="nope"), errors.NotFound, "'nope' is not registered"),
    (lambda: spec_for(AFFINE, [X[:, :3]]), errors.InvalidArgument, "'x'"),
    (lambda: spec_for(AFFINE, [X]), errors.Unavailable, "inventory at 127.0.0.1:1"),
], ids=["unknown program", "wrong input shape", "a sound job"])
def test_planning_asks_program_and_inventory_at_once_and_a_fault_of_the_job_is_still_told_first(
        tmp_path, spec, raised, match):
    """The program's description and the candidates are asked side by side (runtime/beside.py);
    with the inventory away, a job naming no program or the wrong inputs still hears its own fault."""
    mesh = FakeMesh(AFFINE, inventory=UnlistingInventory)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec())
    with pytest.raises(raised, match=match):
        runner.run(job, live, Feed([X]))
    assert mesh.inventory.reserved == {}


def test_training_steps_equal_sgd_on_each_full_mini_batch(tmp_path):
    x, y = linreg_data()
    options = TrainingOptions(epochs=3, batch_size=40, learning_rate=0.05, momentum=0.5, shuffle_seed=2)
    mesh = FakeMesh(LINREG)
    mesh.workers.fail[mesh.devices[2].id] = 1  # one step's shard is retried: the step must not change
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=options), Feed([x, y]))
    assert job.state == m.SUCCEEDED

    w, losses = linreg_sgd(x, y, options)
    np.testing.assert_allclose(result(runner, job, "w"), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result(runner, job, "losses"), losses, rtol=1e-5)
    assert len(losses) == 9 and losses[-1] < losses[0]


# -- the pipeline strategy ---------------------------------------------------------------------

def test_a_pipeline_runs_every_micro_batch_through_the_stages_in_order_and_retries_a_stage(tmp_path):
    mesh = fake_pipeline_mesh()
    mesh.workers.fail[mesh.devices[1].id] = 1  # its first stage run fails once: retried on the other device
    runner = runner_for(mesh, tmp_path)
    x = np.random.default_rng(3).normal(size=(40, 4)).astype(np.float32)
    placement = m.PlacementSpec(strategy="ranked", device_count=2, micro_batch_rows=8)
    spec = spec_for(CHAIN, [x], placement=placement)
    _, plan, _, _ = runner.plan(spec)
    mesh.workers.stage_count = stages = len(plan.placement.stages)
    assert stages >= 2 and {s.device_id for s in plan.placement.stages} == {d.id for d in mesh.devices}
    job = run(runner, spec, Feed([x]))
    assert job.state == m.SUCCEEDED, job.error
    np.testing.assert_allclose(result(runner, job, "y"), x + sum(KS), rtol=1e-6)
    done = mesh.workers.order
    assert sorted(done) == [(b, s) for b in range(5) for s in range(stages)]
    for b in range(5):  # a micro-batch leaves each stage before it enters the next
        assert [done.index((b, s)) for s in range(stages)] == sorted(done.index((b, s)) for s in range(stages))
    retried = [s for s in job.shards if s.attempts > 1]
    assert len(retried) == 1 and retried[0].failures[0].startswith(mesh.devices[1].id)
    assert sorted(d for d, _ in mesh.inventory.reserved[job.job_id]) == sorted(d.id for d in mesh.devices)
    assert mesh.inventory.released == [job.job_id]


def test_a_run_hands_back_events_then_final_rows_in_order_then_folded_outputs_then_the_job(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X]))
    # IDLE marks where the job had nothing more ready (RunJob sends a batch there): not a piece to send.
    pieces = [p for p in delivery.run(runner, job, live, Feed([X]), slab_bytes=64) if p is not delivery.IDLE]
    assert isinstance(pieces[0], delivery.EventOut) and pieces[0].event.type == m.PLANNED
    assert isinstance(pieces[-1], delivery.JobOut) and pieces[-1].job.state == m.SUCCEEDED
    y = [p for p in pieces if isinstance(p, delivery.RowsOut) and p.entry.name == "y"]
    assert [p.first_row for p in y] == list(np.cumsum([0] + [len(p.rows) for p in y[:-1]]))  # in order, once
    np.testing.assert_array_equal(np.concatenate([p.rows for p in y]), 2 * X + BIAS)
    headers = [i for i, p in enumerate(pieces) if isinstance(p, delivery.TensorOut)]
    assert [pieces[i].entry.name for i in headers] == ["y", "s"]
    succeeded = next(i for i, p in enumerate(pieces)
                     if isinstance(p, delivery.EventOut) and p.event.type == "succeeded")
    assert headers[1] > succeeded > pieces.index(y[0])  # the sum only once final; rows before the end
    (s,) = [p for p in pieces if isinstance(p, delivery.RowsOut) and p.entry.name == "s"]
    np.testing.assert_allclose(s.rows, X.sum(axis=0), rtol=1e-5)
