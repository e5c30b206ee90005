"""Predicted against measured time on a job's records: every shard carries the seconds its plan
predicted and the seconds it took, every data-parallel job its measured makespan beside the
plan's, through the job book's JSON and the protos; and each finished shard is a sample of the
throughput model's fit, which plans the next job. In process against the fake mesh; measured
values are checked for presence and consistency only, never for how fast this machine is."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dispatch_svc.api.translate import job_to_proto
from dispatch_svc.jobs import codec as job_codec
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions

from fakes.ports import AFFINE, LINREG, FakeMesh, Feed, X, linreg_data, run, runner_for, spec_for


def test_every_shard_of_an_inference_job_records_its_prediction_and_the_job_its_measured_makespan(tmp_path):
    runner = runner_for(FakeMesh(AFFINE), tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED
    planned = {s.index: s for s in job.plan.shards}
    cost = {t.target_type: t for t in job.plan.targets}
    for shard in job.shards:
        target = cost[shard.target_type]
        assert shard.predicted_seconds == pytest.approx(target.fixed_seconds + shard.rows / target.rows_per_second)
        assert shard.predicted_seconds == pytest.approx(planned[shard.index].predicted_seconds)
        assert shard.predicted_seconds > 0 and shard.total_seconds > 0
    # The makespan spans every shard's own time, from the first start to the last end.
    assert job.measured_seconds >= max(s.total_seconds for s in job.shards) > 0
    assert job.plan.predicted_seconds > 0


def test_the_records_predictions_and_measurements_reach_the_protos_and_survive_the_job_book(tmp_path):
    runner = runner_for(FakeMesh(AFFINE), tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    msg = job_to_proto(job)
    assert msg.measured_seconds == job.measured_seconds > 0
    assert [s.predicted_seconds for s in msg.shards] == [s.predicted_seconds for s in job.shards]
    assert [(t.fixed_seconds, t.rate_samples, t.residual_seconds) for t in msg.plan.targets] == [
        (t.fixed_seconds, t.rate_samples, t.residual_seconds) for t in job.plan.targets]
    assert job_to_proto(job, with_shards=False).measured_seconds == job.measured_seconds  # ListJobs too
    again = job_codec.record_from(json.loads(job_codec.record_text(job)))
    assert again == job
    # A record written before these fields reads with them at 0.
    old = json.loads(job_codec.record_text(job))
    del old["measured_seconds"]
    for shard in old["shards"]:
        del shard["predicted_seconds"]
    for target in old["plan"]["targets"]:
        for name in ("fixed_seconds", "rate_samples", "residual_seconds"):
            del target[name]
    read = job_codec.record_from(old)
    assert read.measured_seconds == 0.0 and {s.predicted_seconds for s in read.shards} == {0.0}
    assert {t.fixed_seconds for t in read.plan.targets} == {0.0}


def test_finished_shards_are_the_fits_samples_and_plan_the_next_job(tmp_path):
    mesh = FakeMesh(AFFINE)
    runner = runner_for(mesh, tmp_path)
    warming = run(runner, spec_for(AFFINE, [X]), Feed([X]))  # a device's first run of an artifact is not fitted
    assert all(runner.throughput.measured("affine@1", t.target_type) is None for t in warming.plan.targets)
    first = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert {t.rate_source for t in first.plan.targets} == {"catalog"}
    per_type: dict[str, int] = {}
    for shard in first.shards:
        per_type[shard.target_type] = per_type.get(shard.target_type, 0) + 1
    for target_type, count in per_type.items():
        fit = runner.throughput.measured("affine@1", target_type)
        assert fit is not None and fit.samples == count and fit.fixed_seconds >= 0 and fit.rows_per_second > 0
    second = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    measured = [t for t in second.plan.targets if t.rate_source == "measured"]
    assert measured and all(t.rate_samples == per_type[t.target_type] for t in measured)


def test_a_training_job_measures_its_steps_against_the_predicted_step(tmp_path):
    x, y = linreg_data()
    options = TrainingOptions(epochs=2, batch_size=32, learning_rate=0.05, momentum=0.0, shuffle_seed=0)
    runner = runner_for(FakeMesh(LINREG), tmp_path)
    job = run(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=options), Feed([x, y]))
    assert job.state == m.SUCCEEDED
    assert job.plan.predicted_seconds > 0 and job.measured_seconds > 0
    assert all(s.predicted_seconds > 0 and s.total_seconds > 0 for s in job.shards)
    assert np.isfinite(job.losses).all()
