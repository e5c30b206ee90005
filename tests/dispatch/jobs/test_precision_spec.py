"""A job's precision in the dispatcher: read from JobConstraints, written back, kept in the job book's
records (and records from before the field still load), passed to every compile call, refused
when unknown or fp16 for training."""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from dispatch_svc.api import translate as tr
from dispatch_svc.jobs import codec as job_codec
from dispatch_svc.jobs import records as m

from fakes.ports import AFFINE, CHAIN, FakeMesh, Feed, X, fake_pipeline_mesh, run, runner_for, spec_for


def spec_message(precision: int, kind: int = job_pb.JOB_KIND_INFERENCE) -> job_pb.JobSpec:
    msg = job_pb.JobSpec(program="mlp_classifier", kind=kind, inputs=[], constraints=job_pb.JobConstraints(
        precision=precision))
    if kind == job_pb.JOB_KIND_TRAINING:
        msg.training.CopyFrom(job_pb.TrainingOptions(epochs=1, batch_size=8, learning_rate=0.1))
    return msg


@pytest.mark.parametrize(("value", "name"), [
    (common_pb2.PRECISION_UNSPECIFIED, ""), (common_pb2.PRECISION_FP32, "fp32"),
    (common_pb2.PRECISION_BF16_ALLOWED, "bf16"), (common_pb2.PRECISION_FP16_ALLOWED, "fp16"),
])
def test_the_precision_round_trips_through_the_proto_and_the_job_book(value, name):
    spec = tr.spec_from_proto(spec_message(value))
    assert spec.constraints.precision == name and name in m.PRECISIONS
    assert tr.spec_to_proto(spec).constraints.precision == value
    stored = json.loads(job_codec.record_text(m.JobRecord("j1", spec)))
    assert job_codec.record_from(stored).spec.constraints.precision == name


def test_a_record_from_before_the_field_loads_with_no_precision():
    stored = json.loads(job_codec.record_text(m.JobRecord("j1", tr.spec_from_proto(spec_message(0)))))
    del stored["spec"]["constraints"]["precision"]
    assert job_codec.record_from(stored).spec.constraints.precision == ""


@pytest.mark.parametrize(("msg", "message"), [
    (spec_message(9), "spec.constraints.precision 9 is not a Precision"),
    (spec_message(common_pb2.PRECISION_FP16_ALLOWED, job_pb.JOB_KIND_TRAINING),
     "spec.constraints.precision PRECISION_FP16_ALLOWED is for inference only"),
], ids=["unknown", "fp16-training"])
def test_a_bad_precision_is_invalid_argument_naming_the_field(msg, message):
    with pytest.raises(errors.InvalidArgument, match=message) as caught:
        tr.spec_from_proto(msg)
    assert caught.value.field == "spec.constraints.precision"


def test_training_may_ask_for_fp32_or_bf16():
    for value in (common_pb2.PRECISION_FP32, common_pb2.PRECISION_BF16_ALLOWED):
        assert tr.spec_from_proto(spec_message(value, job_pb.JOB_KIND_TRAINING)).kind == m.TRAINING


# -- every compile call carries it -------------------------------------------------------------

class Recording:
    """Wraps a fake compiler's rule and build calls, keeping the precision each was asked with."""

    def __init__(self, compiler):
        self.asked: list[tuple[str, str]] = []
        # compile_stage only: the pipeline fake's compile_stage builds through its own compile.
        names = ("compile_stage", "explain_rule") if hasattr(compiler, "compile_stage") else ("compile",)
        for name in names:
            setattr(compiler, name, self._recorder(name, getattr(compiler, name)))

    def _recorder(self, name, call):
        signature = inspect.signature(call)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.asked.append((name, bound.arguments["precision"]))
            return call(*args, **kwargs)
        return recorded


def test_a_data_parallel_job_asks_for_its_precision_in_every_build(tmp_path):
    mesh = FakeMesh(AFFINE)
    calls = Recording(mesh.compiler)
    runner = runner_for(mesh, tmp_path)
    spec = dataclasses.replace(spec_for(AFFINE, [X]), constraints=m.Constraints(precision="fp32"))
    assert run(runner, spec, Feed([X])).state == m.SUCCEEDED
    assert calls.asked and set(calls.asked) == {("compile", "fp32")}


def test_a_pipeline_job_asks_for_its_precision_for_rules_and_stages(tmp_path):
    mesh = fake_pipeline_mesh()
    calls = Recording(mesh.compiler)
    runner = runner_for(mesh, tmp_path)
    x = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)
    spec = dataclasses.replace(spec_for(CHAIN, [x], placement=m.PlacementSpec("ranked", device_count=2,
                                                                               micro_batch_rows=8)),
                               constraints=m.Constraints(precision="bf16"))
    _, plan, _, _ = runner.plan(spec)
    mesh.workers.stage_count = len(plan.placement.stages)
    assert run(runner, spec, Feed([x])).state == m.SUCCEEDED
    assert {name for name, _ in calls.asked} >= {"explain_rule", "compile_stage"}
    assert {precision for _, precision in calls.asked} == {"bf16"}
