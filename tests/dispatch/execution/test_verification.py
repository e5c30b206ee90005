"""Spot checks of data-parallel inference (dispatch_svc.execution.verification and
strategies/verifier.py): which shards are sampled, when two runs agree, jobs on the fake mesh
whose nodes (10.0.0.1, .2, .3) include one that adds 1000 to half the rows it returns, and the
fraction and each shard's outcome as the spec, the job book and the proto carry them."""

from __future__ import annotations

import json
import math
import re
import threading

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.security.identity import Role
from dispatch_svc.api import translate as tr
from dispatch_svc.config import parse_args
from dispatch_svc.execution.strategies import data_parallel
from dispatch_svc.execution.verification import compare_outputs, sample_shards
from dispatch_svc.jobs import codec as job_codec
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions

from conftest import CREDENTIALS
from fakes.ports import (
    AFFINE,
    BIAS,
    LINREG,
    WAIT_S,
    FakeMesh,
    FakeWorkers,
    Feed,
    X,
    linreg_data,
    linreg_sgd,
    result,
    run,
    runner_for,
    spec_for,
)


def forge_half(outputs):
    y = outputs[0].copy()
    y[: len(y) // 2] += 1000.0
    return [y, *outputs[1:]]


@pytest.mark.parametrize(("shards", "fraction", "count"), [(20, 0.05, 1), (20, 0.2, 4), (7, 0.5, 4), (3, 1.0, 3),
                                                           (100, 0.001, 1), (5, 0.0, 0)])
def test_the_sample_holds_the_fraction_rounded_up_and_at_least_one_shard(shards, fraction, count):
    sample = sample_shards("job-a", shards, fraction)
    assert len(sample) == count and all(0 <= i < shards for i in sample)


def test_the_sample_is_the_same_for_one_job_id_and_differs_between_jobs():
    assert sample_shards("job-a", 1000, 0.1) == sample_shards("job-a", 1000, 0.1)
    assert sample_shards("job-a", 1000, 0.1) != sample_shards("job-b", 1000, 0.1)


def test_outputs_within_the_tolerance_match_and_a_forged_half_does_not():
    y = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)
    near = y * (1 + 1e-3)
    assert compare_outputs(["y"], [y], [near], 5e-2).matched
    assert not compare_outputs(["y"], [y], [near], 1e-5).matched  # an fp32 rule's tolerance is tighter
    forged = compare_outputs(["y"], [y], forge_half([y]), 5e-2)
    assert not forged.matched and forged.output == "y" and forged.error_ratio > 10


@pytest.mark.parametrize(("first", "second", "matched"), [
    ([1.0, np.nan], [1.0, np.nan], True),
    ([1.0, np.inf], [1.0, np.inf], True),
    ([1.0, np.nan], [1.0, 2.0], False),
    ([1.0, np.inf], [1.0, -np.inf], False),
    ([0.0, 0.0], [0.0, 1e-12], True),  # near zero: an absolute difference
])
def test_non_finite_values_must_sit_in_the_same_places(first, second, matched):
    comparison = compare_outputs(["y"], [np.array(first)], [np.array(second)], 1e-5)
    assert comparison.matched is matched


def test_outputs_of_different_shapes_never_match():
    assert compare_outputs(["y"], [np.zeros(3)], [np.zeros(4)], 1.0).error_ratio == math.inf


def test_with_three_nodes_a_forging_node_is_outvoted_marked_suspect_and_its_shards_run_elsewhere(tmp_path):
    mesh = FakeMesh(AFFINE, nodes=3)
    forger = mesh.devices[2]
    mesh.workers.forge[forger.id] = forge_half
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X], verify_fraction=1.0), Feed([X]))
    assert job.state == m.SUCCEEDED, job.error
    np.testing.assert_array_equal(result(runner, job, "y"), 2 * X + BIAS)
    assert list(mesh.inventory.suspects) == [forger.node_address]
    assert job.verify_fraction == 1.0
    assert all(s.verification is not None and s.verification.outcome == m.MATCHED for s in job.shards)
    assert all(s.device_id != forger.id and s.verification.verifier_node_address != forger.node_address
               for s in job.shards)
    events = runner.book.events(job.job_id)
    assert any(e.type == m.SHARD_VERIFIED and f"node {forger.node_address} is suspect" in e.message for e in events)


def test_a_fraction_of_zero_runs_every_shard_once_and_verifies_nothing(tmp_path):
    mesh = FakeMesh(AFFINE, nodes=3)
    mesh.workers.forge[mesh.devices[2].id] = forge_half
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X]), Feed([X]))
    assert job.state == m.SUCCEEDED and job.verify_fraction == 0.0
    assert len(mesh.workers.attempts) == len(job.shards)
    assert all(s.verification is None for s in job.shards) and not mesh.inventory.suspects


def test_the_dispatchers_floor_applies_when_the_spec_asks_for_less(tmp_path):
    mesh = FakeMesh(AFFINE, nodes=2)
    runner = runner_for(mesh, tmp_path, verify_fraction=1.0)
    job = run(runner, spec_for(AFFINE, [X], verify_fraction=0.1), Feed([X]))
    assert job.state == m.SUCCEEDED and job.verify_fraction == 1.0
    assert len(mesh.workers.attempts) == 2 * len(job.shards)  # each shard once more, on the other node
    assert all(s.verification.outcome == m.MATCHED for s in job.shards)


def test_a_shard_with_no_device_of_another_node_is_recorded_not_verifiable_and_stands(tmp_path):
    mesh = FakeMesh(AFFINE, nodes=1)
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X], verify_fraction=0.5), Feed([X]))
    assert job.state == m.SUCCEEDED, job.error
    sampled = sample_shards(job.job_id, len(job.shards), 0.5)
    assert {s.index for s in job.shards if s.verification is not None} == sampled
    assert all(s.verification.outcome == m.NOT_VERIFIABLE for s in job.shards if s.index in sampled)
    messages = [e.message for e in runner.book.events(job.job_id) if e.type == m.SHARD_VERIFIED]
    assert len(messages) == len(sampled) and all("no device of another node" in text for text in messages)


def test_two_nodes_that_disagree_with_no_third_are_both_suspect_and_the_job_fails(tmp_path):
    mesh = FakeMesh(AFFINE, types=("v100-32gb", "v100-32gb"), nodes=2)
    mesh.workers.forge[mesh.devices[1].id] = forge_half
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(AFFINE, [X], verify_fraction=1.0), Feed([X]))
    assert job.state == m.FAILED and "no third node could tell which is right" in job.error
    assert set(mesh.inventory.suspects) == {d.node_address for d in mesh.devices}



class _HeldSample(FakeWorkers):
    """Runs the sampled shard on device `forger` only once another shard has run on `other` (the
    forger too, by default)."""

    def __init__(self, program, forger: str, sampled: int, other: str = ""):
        super().__init__(program)
        self._forger, self._other, self._sampled = forger, other or forger, sampled
        self._other_ran = threading.Event()

    def execute(self, job_id, shard_index, attempt, device, build, *args, **kwargs):
        if device.id == self._forger and shard_index == self._sampled and attempt == 1:
            assert self._other_ran.wait(WAIT_S)
        out = super().execute(job_id, shard_index, attempt, device, build, *args, **kwargs)
        if device.id == self._other and shard_index != self._sampled:
            self._other_ran.set()
        return out


def test_a_forged_unsampled_shard_finished_before_its_node_was_found_out_fails_the_job(tmp_path, monkeypatch):
    probe = FakeMesh(AFFINE, nodes=3)
    planned = run(runner_for(probe, tmp_path / "probe"), spec_for(AFFINE, [X]), Feed([X])).plan
    forger = probe.devices[2].id
    on_forger = sorted(s.index for s in planned.shards if s.device_id == forger)
    assert len(on_forger) >= 2
    sampled = on_forger[-1]
    monkeypatch.setattr(data_parallel, "sample_shards", lambda job_id, count, fraction: frozenset({sampled}))
    mesh = FakeMesh(AFFINE, nodes=3, workers=lambda program: _HeldSample(program, forger, sampled))
    mesh.workers.forge[forger] = forge_half
    runner = runner_for(mesh, tmp_path / "job")
    job = run(runner, spec_for(AFFINE, [X], verify_fraction=0.01), Feed([X]))
    assert job.plan == planned
    assert job.state == m.FAILED and "were taken unverified from 10.0.0.3:50070" in job.error, job.error
    assert "run the job again" in job.error and list(mesh.inventory.suspects) == ["10.0.0.3:50070"]


TRAINING = TrainingOptions(epochs=2, batch_size=40, learning_rate=0.05, momentum=0.5, shuffle_seed=2)


def test_training_verifies_every_steps_shards_and_trains_as_sgd_despite_a_forging_node(tmp_path):
    x, y = linreg_data()
    mesh = FakeMesh(LINREG, nodes=3)
    forger = mesh.devices[2]
    mesh.workers.forge[forger.id] = forge_half
    runner = runner_for(mesh, tmp_path)
    job = run(runner, spec_for(LINREG, [x, y], kind=m.TRAINING, training=TRAINING, verify_fraction=1.0),
              Feed([x, y]))
    assert job.state == m.SUCCEEDED and job.verify_fraction == 1.0, job.error
    w, losses = linreg_sgd(x, y, TRAINING)
    np.testing.assert_allclose(result(runner, job, "w"), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result(runner, job, "losses"), losses, rtol=1e-5)
    assert list(mesh.inventory.suspects) == [forger.node_address]
    assert all(s.verification.outcome == m.MATCHED and s.device_id != forger.id for s in job.shards)


def test_a_training_step_with_unverified_gradients_from_a_node_found_wrong_fails_the_job(tmp_path, monkeypatch):
    types = ("v100-32gb",) * 6  # dealt to three nodes: the forger (10.0.0.3) gets devices 2 and 5
    x, y = linreg_data()
    spec = spec_for(LINREG, [x, y], kind=m.TRAINING, training=TRAINING, verify_fraction=0.5)
    probe = FakeMesh(LINREG, types, nodes=3)
    planned = run(runner_for(probe, tmp_path / "probe"), spec, Feed([x, y])).plan
    unsampled, sampled = (next(s.index for s in planned.shards if s.device_id == probe.devices[d].id) for d in (2, 5))
    # The forger's shard on device 5 is checked, and found out, once its unsampled one on device 2 was taken.
    monkeypatch.setattr(data_parallel, "sample_shards", lambda job_id, count, fraction: frozenset({sampled}))
    mesh = FakeMesh(LINREG, types, nodes=3,
                    workers=lambda program: _HeldSample(program, probe.devices[5].id, sampled, probe.devices[2].id))
    mesh.workers.forge = {mesh.devices[d].id: forge_half for d in (2, 5)}
    job = run(runner_for(mesh, tmp_path / "job"), spec, Feed([x, y]))
    assert job.plan == planned
    assert job.state == m.FAILED, job.error
    taken = re.match(r"shards ([\d, ]+) were taken unverified from 10\.0\.0\.3:50070, found returning wrong", job.error)
    assert taken and unsampled in {int(i) for i in taken.group(1).split(", ")}, job.error
    assert job.losses == []  # the first step's forged gradients were never applied


def test_a_shards_verification_round_trips_through_the_job_book_and_the_proto():
    verification = m.ShardVerification(m.MATCHED, "10.0.0.1:50070", "10.0.0.2/cuda:1", "10.0.0.2:50070", 0.25,
                                       "1e-05 of the outputs' largest magnitude")
    job = m.JobRecord("j1", m.JobSpec(program="affine", verify_fraction=0.5), verify_fraction=0.5,
                      shards=[m.ShardRecord(0, "10.0.0.1/cuda:0", "t", "r", 0, 4, verification=verification),
                              m.ShardRecord(1, "10.0.0.1/cuda:0", "t", "r", 4, 4)])
    again = job_codec.record_from(json.loads(job_codec.record_text(job)))
    assert again.shards == job.shards and again.verify_fraction == 0.5 and again.spec.verify_fraction == 0.5
    msg = tr.job_to_proto(again)
    assert msg.verify_fraction == 0.5 and msg.spec.verify_fraction == 0.5
    assert msg.shards[0].verification.outcome == job_pb.VERIFICATION_OUTCOME_MATCHED
    assert msg.shards[0].verification.verifier_device_id == "10.0.0.2/cuda:1"
    assert not msg.shards[1].HasField("verification")
    stored = json.loads(job_codec.record_text(job))
    del stored["shards"][0]["verification"], stored["verify_fraction"], stored["spec"]["verify_fraction"]
    assert job_codec.record_from(stored).shards[0].verification is None  # a record from before the field


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
def test_a_spec_fraction_outside_zero_to_one_is_refused_naming_the_field(value):
    with pytest.raises(errors.InvalidArgument, match="spec.verify_fraction is") as info:
        tr.spec_from_proto(job_pb.JobSpec(program="affine", verify_fraction=value))
    assert info.value.field == "spec.verify_fraction"


def test_the_dispatchers_floor_is_read_from_its_variable_and_refused_above_one():
    env = CREDENTIALS.env(Role.DISPATCH)
    assert parse_args([], env=env).verify_fraction == 0.0
    assert parse_args([], env={**env, "ACCELMESH_VERIFY_FRACTION": "0.05"}).verify_fraction == 0.05
    with pytest.raises(errors.InvalidArgument, match="ACCELMESH_VERIFY_FRACTION"):
        parse_args([], env={**env, "ACCELMESH_VERIFY_FRACTION": "2"})
    with pytest.raises(errors.InvalidArgument, match="ACCELMESH_VERIFY_FRACTION"):
        parse_args([], env={**env, "ACCELMESH_VERIFY_FRACTION": "-1"})
