"""The dispatcher's limits: a spec over any limit, parameters over theirs and a block that cannot
fit are refused before anything is planned, compiled or reserved (the fake mesh records every
call); ids and names are quoted short. Through a real in-process server on port 0 over the fake
mesh of tests/fakes/ports.py (tests/fakes/small_dispatcher.py), plus the runner alone where no stream is needed. What
a job leaves behind once it ends, or once its client goes, is in test_job_footprint.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh.client import job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.runtime.tensors import dtype_code, to_proto
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.limits import JobLimits

from conftest import rpc_error
from fakes.ports import AFFINE, CHAIN, WAIT_S, FakeMesh, Feed, X, fake_pipeline_mesh, runner_for, spec_for
from fakes.small_dispatcher import LIMITS, RecordingInventory, RecordingMesh, run_job, serving, submit

SHORT_MESSAGE = 400  # a refusal quoting client input stays this short, whatever the input's size


@pytest.fixture
def dispatcher(tmp_path):
    with serving(tmp_path) as d:
        yield d


def spec(program="affine", rows=16, cols=4, **options) -> job_pb.JobSpec:
    """A spec declaring `rows` x `cols` float32 rows of input 'x', without making the array."""
    message = job_spec(program, {}, **options)
    message.inputs.add(name="x", dtype=dtype_code(np.dtype(np.float32)), shape=[rows, cols],
                       total_bytes=rows * cols * 4)
    return message


def training_spec(rows, epochs=1, batch_size=16):
    inputs = {"x": np.zeros((rows, 4), np.float32), "y": np.zeros((rows,), np.float32)}
    return job_spec("linreg_step", inputs, training=job_pb.TrainingOptions(epochs=epochs, batch_size=batch_size))


def placed_spec(layers=0, micro_batch_rows=1, rows=16):
    table = [plan_pb.LayerCost(name=f"l{i}", order=i, parameter_count=4, parameter_bytes=16) for i in range(layers)]
    options = plan_pb.PlacementOptions(strategy=plan_pb.PLACEMENT_STRATEGY_RANKED, micro_batch_rows=micro_batch_rows,
                                       layers=table)
    return job_spec("chain", {"x": np.zeros((rows, 4), np.float32)}, placement=options)


LONG = "n" * 100_000

# (spec, code, words the message must hold): every refusal names its limit's variable.
OVER_LIMITS = [
    pytest.param(spec(rows=1001), grpc.StatusCode.RESOURCE_EXHAUSTED, ["1,001", "1,000", "ACCELMESH_MAX_JOB_ROWS"],
                 id="rows"),
    pytest.param(spec(rows=900, cols=64), grpc.StatusCode.RESOURCE_EXHAUSTED, ["230,400", "ACCELMESH_MAX_JOB_BYTES"],
                 id="bytes"),
    pytest.param(spec(rows=1000), grpc.StatusCode.RESOURCE_EXHAUSTED, ["16", "ACCELMESH_MAX_JOB_SHARDS"], id="shards"),
    pytest.param(training_spec(300), grpc.StatusCode.RESOURCE_EXHAUSTED, ["6,000", "ACCELMESH_MAX_TRAINING_BYTES"],
                 id="training-bytes"),
    pytest.param(training_spec(100, epochs=9, batch_size=16), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 ["63", "ACCELMESH_MAX_TRAINING_STEPS"], id="training-steps"),
    pytest.param(placed_spec(micro_batch_rows=1, rows=9), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 ["micro-batches", "9", "ACCELMESH_MAX_JOB_SHARDS"], id="micro-batches"),
    pytest.param(placed_spec(layers=3), grpc.StatusCode.INVALID_ARGUMENT, ["spec.placement.layers", "PlanJob"],
                 id="layer-table-to-run"),
    pytest.param(spec(program=LONG), grpc.StatusCode.INVALID_ARGUMENT,
                 ["spec.program", "100000", "ACCELMESH_MAX_NAME_CHARS"],
                 id="program-name"),
    pytest.param(spec(name=LONG), grpc.StatusCode.INVALID_ARGUMENT, ["spec.name", "ACCELMESH_MAX_NAME_CHARS"],
                 id="job-name"),
    pytest.param(spec(version=LONG), grpc.StatusCode.INVALID_ARGUMENT, ["spec.version", "ACCELMESH_MAX_NAME_CHARS"],
                 id="version"),
    pytest.param(spec(capabilities=[LONG]), grpc.StatusCode.INVALID_ARGUMENT,
                 ["required_capabilities[0]", "ACCELMESH_MAX_NAME_CHARS"], id="capability-name"),
    pytest.param(spec(capabilities=[f"c{i}" for i in range(5)]), grpc.StatusCode.INVALID_ARGUMENT,
                 ["capabilities", "5 entries", "ACCELMESH_MAX_SPEC_ENTRIES"], id="capabilities"),
    pytest.param(spec(filter="x" * 101), grpc.StatusCode.INVALID_ARGUMENT,
                 ["filter", "101", "ACCELMESH_MAX_FILTER_CHARS"],
                 id="filter"),
    pytest.param(job_spec("affine", {LONG: np.zeros((16, 4), np.float32)}), grpc.StatusCode.INVALID_ARGUMENT,
                 ["spec.inputs[0].name", "ACCELMESH_MAX_NAME_CHARS"], id="input-name"),
]


@pytest.mark.parametrize("job, code, words", OVER_LIMITS)
@pytest.mark.parametrize("method", ["SubmitJob", "RunJob"])
def test_a_spec_over_a_limit_is_refused_before_anything_is_planned_or_recorded(dispatcher, job, code, words, method):
    call = submit if method == "SubmitJob" else run_job
    error = rpc_error(call, dispatcher.stub, [("spec", job)])  # no input sent: the spec alone is refused
    assert error.code() == code, error.details()
    assert all(w in error.details() for w in words), error.details()
    assert len(error.details()) < SHORT_MESSAGE
    assert dispatcher.mesh.calls == [] and dispatcher.mesh.inventory.reserved == {}
    assert dispatcher.runner.book.list(10) == []  # never recorded


@pytest.mark.parametrize("job, code, words", [p for p in OVER_LIMITS if p.id != "layer-table-to-run"])
def test_plan_job_refuses_the_same_specs_before_planning(dispatcher, job, code, words):
    error = rpc_error(dispatcher.stub.PlanJob, pb.PlanJobRequest(spec=job), timeout=WAIT_S)
    assert error.code() == code and all(w in error.details() for w in words), error.details()
    assert dispatcher.mesh.calls == []


def test_plan_job_refuses_a_layer_table_over_the_limit_before_planning(dispatcher):
    error = rpc_error(dispatcher.stub.PlanJob, pb.PlanJobRequest(spec=placed_spec(layers=5, rows=0)), timeout=WAIT_S)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "5" in error.details() and "ACCELMESH_MAX_MODEL_LAYERS" in error.details()
    assert dispatcher.mesh.calls == []


def test_a_job_within_the_limits_still_runs(dispatcher):
    x = X[:64]
    job_id = submit(dispatcher.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16)).job_id
    assert dispatcher.runner.wait_idle(WAIT_S)
    job = dispatcher.stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=WAIT_S).job
    assert job.state == job_pb.JOB_STATE_SUCCEEDED and "reserve" in dispatcher.mesh.calls


# -- blocks and parameters, before planning ---------------------------------------------------

X16 = np.zeros((16, 4), np.float32)
BAD_INPUTS = [
    pytest.param([("spec", job_spec("affine", {"x": X16})),
                  ("block", pb.InputBlock(first_row=0, tensors=[to_proto(np.zeros((16, 4), np.int32))]))],
                 grpc.StatusCode.INVALID_ARGUMENT, "int32", id="block-dtype"),
    pytest.param([("spec", job_spec("affine", {"x": X16})),
                  ("block", pb.InputBlock(first_row=0, tensors=[to_proto(np.zeros((17, 4), np.float32))]))],
                 grpc.StatusCode.INVALID_ARGUMENT, "declares 16", id="block-rows"),
    pytest.param([("spec", job_spec("affine", {"x": X16})),
                  ("block", pb.InputBlock(first_row=3, tensors=[to_proto(X16)]))],
                 grpc.StatusCode.INVALID_ARGUMENT, "first_row is 3", id="block-first-row"),
    pytest.param(list(request_parts(job_spec("affine", {"x": X16}, client_parameters=True), {"x": X16},
                                    [("a", np.zeros(4, np.float32)), ("b", np.zeros(4, np.float32)),
                                     ("c", np.zeros(4, np.float32))], 1 << 16)),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "ACCELMESH_MAX_PARAMETER_TENSORS", id="parameter-count"),
    pytest.param(list(request_parts(job_spec("affine", {"x": X16}, client_parameters=True), {"x": X16},
                                    [("b", np.zeros(20_000, np.float32))], 1 << 16)),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "ACCELMESH_MAX_JOB_BYTES", id="parameter-bytes"),
    pytest.param(list(request_parts(job_spec("affine", {"x": X16}, client_parameters=True), {"x": X16},
                                    [(LONG, np.zeros(4, np.float32))], 1 << 16)),
                 grpc.StatusCode.INVALID_ARGUMENT, "ACCELMESH_MAX_NAME_CHARS", id="parameter-name"),
]


@pytest.mark.parametrize("parts, code, words", BAD_INPUTS)
def test_bad_parameters_or_a_bad_first_block_are_refused_before_planning(dispatcher, parts, code, words):
    error = rpc_error(submit, dispatcher.stub, parts)
    assert error.code() == code and words in error.details(), error.details()
    assert len(error.details()) < SHORT_MESSAGE
    assert dispatcher.mesh.calls == [] and dispatcher.runner.book.list(10) == []


def test_a_spec_alone_gets_what_planning_finds_first_then_that_no_block_came(dispatcher):
    error = rpc_error(submit, dispatcher.stub, [("spec", job_spec("no_such_program", {"x": X16}))])
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no_such_program" in error.details()
    error = rpc_error(submit, dispatcher.stub, [("spec", job_spec("affine", {"x": X16}))])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended after 0 of the 16 rows" in error.details()
    (job,) = dispatcher.runner.book.list(1)
    assert job.state == m.FAILED and "reserve" in dispatcher.mesh.calls
    assert job.job_id in dispatcher.mesh.inventory.released


def test_a_block_for_a_spec_without_inputs_is_refused_before_planning(dispatcher):
    parts = [("spec", job_spec("affine", {})), ("block", pb.InputBlock(first_row=0))]
    error = rpc_error(submit, dispatcher.stub, parts)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "declares no inputs" in error.details()
    assert dispatcher.mesh.calls == []


class SlowInventory(RecordingInventory):
    """Planning slower than the client's next block: candidate_devices answers only once the job
    being planned is stopped (else after a while), and then as a call cancelled with the job, the way
    GrpcInventory's planning calls are (dispatch_svc/clients/calls.py)."""

    runner = None  # the dispatcher's, set by the test

    def candidate_devices(self, constraints):
        (job,) = self.runner.book.list(1)
        scope = self.runner.live(job.job_id).scope
        if scope.cancelled.wait(WAIT_S / 3):  # within the call's deadline: a dispatcher that never stops plans on
            scope.check()
        return super().candidate_devices(constraints)


def field_violations(error: grpc.RpcError) -> list[str]:
    fields = []
    for detail in rpc_status.from_call(error).details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


@pytest.mark.parametrize("method", ["SubmitJob", "RunJob"])
def test_a_second_block_beyond_the_spec_is_refused_as_it_arrives_and_nothing_is_compiled(tmp_path, method):
    """The spec declares 128 rows; the first block carries rows 0-63, the second says it carries
    128 more. That block arrives while the job plans (the inventory answers slowly): the call ends
    INVALID_ARGUMENT naming the field, the input and the fix, and nothing was compiled or reserved,
    the job (if it was recorded before the block came) FAILED without a plan."""
    mesh = RecordingMesh()
    mesh.inventory.__class__ = SlowInventory
    x = X[:128]
    parts = [("spec", job_spec("affine", {"x": x})),
             ("block", pb.InputBlock(first_row=0, tensors=[to_proto(x[:64])])),
             ("block", pb.InputBlock(first_row=64, tensors=[to_proto(x)]))]
    with serving(tmp_path, mesh=mesh) as dispatcher:
        mesh.inventory.runner = dispatcher.runner
        error = rpc_error(submit if method == "SubmitJob" else run_job, dispatcher.stub, parts)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "compile" not in mesh.calls and "reserve" not in mesh.calls, mesh.calls
        assert error.details() == ("block at row 64 carries 128 rows; the spec declares 128 in all "
                                   "(spec.inputs[0].shape[0] of input 'x'): send at most 64 more rows, or declare "
                                   "every row in the spec")
        assert field_violations(error) == ["block.tensors[0].shape"]
        assert dispatcher.runner.wait_idle(WAIT_S)
        for job in dispatcher.runner.book.list(10):
            assert job.state == m.FAILED and job.plan is None and job.error == error.details()


# -- ids and names quoted short ----------------------------------------------------------------

JOB_ID_CALLS = [
    ("GetJob", lambda stub, job_id: stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=WAIT_S)),
    ("CancelJob", lambda stub, job_id: stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=WAIT_S)),
    ("WatchJob", lambda stub, job_id: list(stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=WAIT_S))),
    ("FetchResult", lambda stub, job_id: list(stub.FetchResult(pb.FetchResultRequest(job_id=job_id), timeout=WAIT_S))),
]


@pytest.mark.parametrize("name, call", JOB_ID_CALLS, ids=[name for name, _ in JOB_ID_CALLS])
def test_a_100_kb_job_id_is_invalid_with_a_short_message_naming_the_limit(dispatcher, name, call):
    error = rpc_error(call, dispatcher.stub, "j" * 100_000)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ACCELMESH_MAX_NAME_CHARS" in error.details() and "(100000 chars)" in error.details()
    assert len(error.details()) < SHORT_MESSAGE


def test_an_unknown_job_id_within_the_limit_is_not_found_and_quoted_short(tmp_path):
    with serving(tmp_path, limits=JobLimits()) as d:  # ids of up to 256 characters are looked up
        error = rpc_error(d.stub.GetJob, pb.GetJobRequest(job_id="q" * 256), timeout=WAIT_S)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "q" * 100 not in error.details() and "(256 chars)" in error.details()


def test_names_under_the_limit_pass_and_over_it_are_refused_in_domain_code(tmp_path):
    runner = runner_for(FakeMesh(AFFINE), tmp_path, job_limits=LIMITS)
    runner.check(spec_for(AFFINE, [X[:8]], name="n" * 40))
    with pytest.raises(InvalidArgument, match="ACCELMESH_MAX_NAME_CHARS"):
        runner.check(spec_for(AFFINE, [X[:8]], name="n" * 41))


# -- a huge job, declared ----------------------------------------------------------------------


def test_a_spec_only_job_of_2_34_rows_is_refused_at_once_with_the_default_limits(tmp_path):
    with serving(tmp_path, limits=JobLimits()) as d:
        error = rpc_error(submit, d.stub, [("spec", spec(rows=2**34, cols=64))])
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "17,179,869,184" in error.details() and "ACCELMESH_MAX_JOB_ROWS" in error.details()
        assert d.mesh.calls == [] and d.runner.book.list(10) == []
        error = rpc_error(d.stub.PlanJob, pb.PlanJobRequest(spec=spec(rows=2**34, cols=64)), timeout=WAIT_S)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and d.mesh.calls == []


def test_a_pipeline_of_more_micro_batches_x_stages_than_the_shard_limit_is_refused_before_building(tmp_path):
    """4 micro-batches pass the check before planning; through 3 stages they are 12 shards."""
    mesh = fake_pipeline_mesh()
    runner = runner_for(mesh, tmp_path, job_limits=JobLimits(max_shards=8))
    spec = spec_for(CHAIN, [X[:16]], placement=m.PlacementSpec("ranked", device_count=2, micro_batch_rows=4))
    _, plan, _, _ = runner.plan(spec)
    assert (plan.placement.micro_batches, len(plan.placement.stages)) == (4, 3)
    job, live = runner.start(spec)
    with pytest.raises(ResourceExhausted,
                       match=r"4 micro-batches through 3 stages are 12 shards.*ACCELMESH_MAX_JOB_SHARDS"):
        runner.run(job, live, Feed([X[:16]]), background=False)
    assert mesh.inventory.reserved == {} and runner.book.get(job.job_id).state == m.FAILED


def test_a_block_of_scalars_is_invalid_not_a_crash(dispatcher):
    x = np.zeros(16, np.float32)
    spec = job_spec("affine", {"x": x})
    error = rpc_error(submit, dispatcher.stub, [("spec", spec), ("block", pb.InputBlock(
        first_row=0, tensors=[to_proto(np.float32(1))]))])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "input 'x' is float32[]" in error.details()
