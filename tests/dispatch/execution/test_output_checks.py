"""A worker's outputs for a shard are checked against the program before anything combines them
(dispatch_svc.execution.output_checks.check_shard_outputs, called by JobContext.execute for every strategy).
A rogue or broken worker (the fake's `forge`) fails its shard, which is retried on another
device: the job succeeds with the right result when another device answers correctly, and fails
naming the mismatch when none does. Inference, training steps and pipeline stages."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.programs import OutputSpec, Program, TensorSpec
from dispatch_svc.dataplane.device_queues import ShardFailed
from dispatch_svc.execution.endings import TRANSIENT_ADVICE
from dispatch_svc.execution.output_checks import check_shard_outputs
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions

from fakes.ports import (
    AFFINE,
    BIAS,
    CHAIN,
    KS,
    LINREG,
    FakeMesh,
    Feed,
    X,
    fake_pipeline_mesh,
    linreg_data,
    linreg_sgd,
    result,
    runner_for,
    spec_for,
)

ROWS = r"\(\d+, 4\); the shard has (?P<rows>\d+) rows, so expected \((?P=rows), 4\)"  # a batched output
# How a forging worker rewrites the affine program's outputs [y (rows, 4), s (4,)], and the
# mismatch the check must name for it (after "shard N on DEVICE returned ").
INFERENCE_FORGERIES = {
    "too few rows": (lambda out: [out[0][: len(out[0]) // 2], out[1]], "output 'y' of shape " + ROWS),
    "too many rows": (lambda out: [np.concatenate([out[0], out[0]]), out[1]], "output 'y' of shape " + ROWS),
    "wrong dtype": (lambda out: [out[0].astype(np.float64), out[1]],
                    re.escape("output 'y' of dtype float64; affine@1 declares float32")),
    "wrong trailing shape": (lambda out: [out[0][:, :3], out[1]], r"output 'y' of shape \((?P<rows>\d+), 3\); "
                             r"the shard has (?P=rows) rows, so expected \((?P=rows), 4\)"),
    "wrong unbatched shape": (lambda out: [out[0], np.concatenate([out[1], out[1][:1]])],
                              re.escape("output 's' of shape (5,); affine@1 declares (4,)")),
    # y's rows are written in place as they arrive (JobOutputs.placer), wrong, before s is refused:
    # the shard's next attempt writes them again.
    "placed rows, then a wrong output": (lambda out: [np.full_like(out[0], -7.0), out[1][:3]],
                                         re.escape("output 's' of shape (3,); affine@1 declares (4,)")),
    "missing output": (lambda out: out[:1], re.escape("1 output; affine@1 returns 2 ('y', 's')")),
    "extra output": (lambda out: [*out, out[1]], re.escape("3 outputs; affine@1 returns 2 ('y', 's')")),
}


def run_job(runner, spec: m.JobSpec, feed: Feed) -> tuple[m.JobRecord, BaseException | None]:
    """The finished job and the exception it failed with (None if it succeeded)."""
    job, live = runner.start(spec)
    runner.run(job, live, feed, background=False)
    return runner.book.get(job.job_id), live.error


def assert_retried_after(job: m.JobRecord, device_id: str, mismatch: str) -> None:
    """Some shard failed on `device_id` for `mismatch`, and every shard finished elsewhere."""
    failures = [(s.index, f) for s in job.shards for f in s.failures]
    assert failures and all(s.done and s.device_id != device_id for s in job.shards)
    for index, failure in failures:
        assert re.fullmatch(f"{re.escape(device_id)}: shard {index} on {re.escape(device_id)} returned {mismatch}",
                            failure), failure


def assert_failed_naming(job: m.JobRecord, error: BaseException | None, mismatch: str) -> None:
    """The job failed as a shard that ran out of devices (not a job-level InvalidArgument), and
    its error names, for every device it gave up on, the shard that failed there and the mismatch.
    Which shard ran out first, and which shard each device failed last, depend on the order the
    shards' threads ran in: the error is read for its shape, not for one interleaving."""
    assert job.state == m.FAILED
    assert isinstance(error, errors.Unavailable), repr(error)
    head, _, reasons = job.error.partition(" could not run: ")
    assert re.fullmatch(r"shard \d+", head), job.error
    ending = f"; no other device can take it; {TRANSIENT_ADVICE}"
    assert reasons.endswith(ending), job.error
    per_device = re.split(r"; (?=10\.0\.0\.1/cuda:\d: )", reasons.removesuffix(ending))
    for reason in per_device:
        assert re.fullmatch(r"(?P<device>10\.0\.0\.1/cuda:\d): shard \d+ on (?P=device) returned " + mismatch,
                            reason), job.error


@pytest.mark.parametrize("forgery", INFERENCE_FORGERIES)
def test_inference_retries_a_shard_a_worker_answered_wrongly_and_combines_only_right_outputs(tmp_path, forgery):
    forge, mismatch = INFERENCE_FORGERIES[forgery]
    mesh = FakeMesh(AFFINE)
    rogue = mesh.devices[0].id
    mesh.workers.forge[rogue] = forge
    runner = runner_for(mesh, tmp_path)
    job, error = run_job(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED and error is None, job.error
    y = result(runner, job, "y")
    assert y.shape == X.shape and y.dtype == np.float32  # nothing forged grew or retyped the result
    np.testing.assert_array_equal(y, 2 * X + BIAS)
    np.testing.assert_allclose(result(runner, job, "s"), X.sum(axis=0), rtol=1e-5)
    assert_retried_after(job, rogue, mismatch)
    assert m.SHARD_RETRIED in [e.type for e in runner.book.events(job.job_id)]


@pytest.mark.parametrize("forgery", INFERENCE_FORGERIES)
def test_inference_fails_naming_the_mismatch_when_every_worker_answers_wrongly(tmp_path, forgery):
    forge, mismatch = INFERENCE_FORGERIES[forgery]
    mesh = FakeMesh(AFFINE)
    mesh.workers.forge = {d.id: forge for d in mesh.devices}
    runner = runner_for(mesh, tmp_path)
    job, error = run_job(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert_failed_naming(job, error, mismatch)
    assert len({d for d, _, _ in mesh.workers.attempts}) == len(mesh.devices)  # retried on every device first


# The training step's outputs [grad/w (4,), loss ()] are unbatched: their shapes are the program's.
TRAINING_FORGERIES = {
    "wrong gradient shape": (lambda out: [out[0][:3], out[1]],
                             re.escape("output 'grad/w' of shape (3,); linreg_step@1 declares (4,)")),
    "wrong loss dtype": (lambda out: [out[0], np.float64(out[1])],
                         re.escape("output 'loss' of dtype float64; linreg_step@1 declares float32")),
    "missing loss": (lambda out: out[:1], re.escape("1 output; linreg_step@1 returns 2 ('grad/w', 'loss')")),
}
TRAINING = TrainingOptions(epochs=2, batch_size=40, learning_rate=0.05, momentum=0.5, shuffle_seed=2)


@pytest.mark.parametrize("forgery", TRAINING_FORGERIES)
def test_a_training_step_retries_a_shard_a_worker_answered_wrongly_and_trains_as_sgd(tmp_path, forgery):
    forge, mismatch = TRAINING_FORGERIES[forgery]
    x, y = linreg_data()
    mesh = FakeMesh(LINREG)
    rogue = mesh.devices[2].id
    mesh.workers.forge[rogue] = forge
    runner = runner_for(mesh, tmp_path)
    job, error = run_job(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=TRAINING), Feed([x, y]))
    assert job.state == m.SUCCEEDED and error is None, job.error
    w, losses = linreg_sgd(x, y, TRAINING)
    np.testing.assert_allclose(result(runner, job, "w"), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result(runner, job, "losses"), losses, rtol=1e-5)
    assert_retried_after(job, rogue, mismatch)


def test_training_fails_naming_the_mismatch_when_every_worker_answers_wrongly(tmp_path):
    forge, mismatch = TRAINING_FORGERIES["wrong gradient shape"]
    x, y = linreg_data()
    mesh = FakeMesh(LINREG)
    mesh.workers.forge = {d.id: forge for d in mesh.devices}
    runner = runner_for(mesh, tmp_path)
    job, error = run_job(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=TRAINING), Feed([x, y]))
    assert_failed_naming(job, error, mismatch)
    assert job.losses == []  # no step took a forged gradient


def pipeline_job(tmp_path, rogues) -> tuple[fake_pipeline_mesh, object, m.JobSpec, np.ndarray]:
    """A two-device pipeline of the chain model whose `rogues` (device positions) cut the last row
    off every activation they return."""
    mesh = fake_pipeline_mesh()
    mesh.workers.forge = {mesh.devices[i].id: (lambda out: [out[0][:-1]]) for i in rogues}
    runner = runner_for(mesh, tmp_path)
    x = np.random.default_rng(3).normal(size=(40, 4)).astype(np.float32)
    spec = spec_for(CHAIN, [x], placement=m.PlacementSpec(strategy="ranked", device_count=2, micro_batch_rows=8))
    _, plan, _, _ = runner.plan(spec)
    mesh.workers.stage_count = len(plan.placement.stages)
    assert mesh.workers.stage_count >= 2
    return mesh, runner, spec, x


PIPELINE_MISMATCH = r"output 'y' of shape \(7, 4\); the shard has 8 rows, so expected \(8, 4\)"


def test_a_pipeline_stage_a_worker_answered_wrongly_is_retried_on_the_other_device(tmp_path):
    mesh, runner, spec, x = pipeline_job(tmp_path, rogues=[1])
    job, error = run_job(runner, spec, Feed([x]))
    assert job.state == m.SUCCEEDED and error is None, job.error
    np.testing.assert_allclose(result(runner, job, "y"), x + sum(KS), rtol=1e-6)
    assert_retried_after(job, mesh.devices[1].id, PIPELINE_MISMATCH)


def test_a_pipeline_fails_naming_the_mismatch_when_every_worker_answers_wrongly(tmp_path):
    _, runner, spec, x = pipeline_job(tmp_path, rogues=[0, 1])
    job, error = run_job(runner, spec, Feed([x]))
    assert_failed_naming(job, error, PIPELINE_MISMATCH)


# -- the check itself --------------------------------------------------------------------------

LOGITS = Program(name="mlp", version="1", kind="function", description="", parameters=(),
                 inputs=(TensorSpec("x", "float32", (None, 64)),),
                 outputs=(OutputSpec("logits", "bfloat16", (None, 10)), OutputSpec("n", "int32", (), "sum")),
                 digest="m1")


def test_the_check_names_the_shard_the_device_the_output_and_expected_against_got():
    with pytest.raises(ShardFailed) as caught:
        check_shard_outputs(LOGITS, [np.zeros((2048, 10), ml_dtypes.bfloat16), np.int32(0)], 3, "10.0.0.2/cuda:0",
                            4096)
    assert caught.value.cause == ("shard 3 on 10.0.0.2/cuda:0 returned output 'logits' of shape (2048, 10); "
                                  "the shard has 4096 rows, so expected (4096, 10)")


def test_the_check_passes_outputs_of_the_declared_dtypes_and_shapes():
    check_shard_outputs(LOGITS, [np.zeros((4096, 10), ml_dtypes.bfloat16), np.int32(7)], 3, "10.0.0.2/cuda:0", 4096)
