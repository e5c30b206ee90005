"""The dispatcher's limits and what it keeps of a job: a spec over any limit, parameters over
theirs and a block that cannot fit are refused before anything is planned, compiled or
reserved (the fake mesh records every call); ids and names are quoted short; a client that goes
away mid-stream leaves its job CANCELLED with how much arrived; an ended job leaves nothing of
itself in the live maps and no reference to its buffers. Through a real in-process server on
port 0 over the fake mesh of _fake_mesh.py, plus the runner alone where no stream is needed."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
from _fake_mesh import AFFINE, CHAIN, WAIT_S, FakeMesh, FakePipelineMesh, Feed, X, runner_for, spec_for
from conftest import CREDENTIALS, rpc_error

from accelmesh.client import job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import dtype_code, to_proto
from accelmesh.security.access import Authenticator
from accelmesh.security.identity import Role
from dispatch_svc import records as m
from dispatch_svc.config import JobLimits
from dispatch_svc.jobs import JobBook
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.runner import JobRunner
from dispatch_svc.server import ACCESS, SERVICE_NAME
from dispatch_svc.servicer import DispatchServicer

LIMITS = JobLimits(max_rows=1000, max_bytes=64 * 1024, max_shards=8, max_training_bytes=4096, max_training_steps=50,
                   max_layers=4, max_spec_entries=4, max_parameter_tensors=2, max_name_chars=40, max_filter_chars=100)
MAX_SHARD_BYTES = 1024  # 64 rows of AFFINE's 4 float32 a shard: 1000 rows need 16
SHORT_MESSAGE = 400  # a refusal quoting client input stays this short, whatever the input's size


class RecordingMesh(FakeMesh):
    """The fake mesh, noting every call that plans, compiles, reserves or fetches for a job."""

    def __init__(self):
        super().__init__(AFFINE)
        self.calls: list[str] = []
        self.reserving = threading.Event()

    def describe_program(self, name, version):
        self.calls.append("describe_program")
        return super().describe_program(name, version)

    def candidate_devices(self, constraints):
        self.calls.append("candidate_devices")
        return super().candidate_devices(constraints)

    def compile(self, program, devices, batch_sizes):
        self.calls.append("compile")
        return super().compile(program, devices, batch_sizes)

    def reserve(self, job_id, claims, ttl_s):
        self.calls.append("reserve")
        super().reserve(job_id, claims, ttl_s)
        self.reserving.set()


class Dispatcher:
    def __init__(self, tmp_path, limits=LIMITS, max_message_bytes=16 << 20, max_parameter_bytes=1 << 20):
        self.mesh = RecordingMesh()
        self.runner = JobRunner(self.mesh, JobBook(tmp_path, retention_s=3600), ThroughputModel(),
                                max_shard_bytes=MAX_SHARD_BYTES, inflight_bytes=1 << 20, job_limits=limits)
        security = CREDENTIALS.service(Role.DISPATCH)
        servicer = DispatchServicer(self.runner, Authenticator(security), chunk_bytes=1 << 16,
                                    max_parameter_bytes=max_parameter_bytes, max_message_bytes=max_message_bytes)
        self.server = create_server([Service(SERVICE_NAME, dispatch_service_pb2_grpc.add_DispatchServiceServicer_to_server,
                                             servicer)], security=security, access=ACCESS,
                                    max_message_bytes=max_message_bytes).start()
        self.channel = open_channel(f"127.0.0.1:{self.server.port}", security=CREDENTIALS.client(),
                                    max_message_bytes=max_message_bytes)
        self.stub = dispatch_service_pb2_grpc.DispatchServiceStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.stop(0)
        self.runner.book.close()


@contextmanager
def serving(tmp_path, **kwargs):
    dispatcher = Dispatcher(tmp_path, **kwargs)
    try:
        yield dispatcher
    finally:
        dispatcher.close()


@pytest.fixture
def dispatcher(tmp_path):
    with serving(tmp_path) as d:
        yield d


def requests(parts, kind=pb.SubmitJobRequest):
    return (kind(**{field: message}) for field, message in parts)


def submit(stub, parts):
    return stub.SubmitJob(requests(parts), timeout=WAIT_S)


def run_job(stub, parts):
    return list(stub.RunJob(requests(parts, pb.RunJobRequest), timeout=WAIT_S))


def spec(program="affine", rows=16, cols=4, **options) -> job_pb.JobSpec:
    """A spec declaring `rows` x `cols` float32 rows of input 'x', without making the array."""
    message = job_spec(program, {}, **options)
    message.inputs.add(name="x", dtype=dtype_code(np.dtype(np.float32)), shape=[rows, cols], total_bytes=rows * cols * 4)
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
    pytest.param(spec(program=LONG), grpc.StatusCode.INVALID_ARGUMENT, ["spec.program", "100000", "ACCELMESH_MAX_NAME_CHARS"],
                 id="program-name"),
    pytest.param(spec(name=LONG), grpc.StatusCode.INVALID_ARGUMENT, ["spec.name", "ACCELMESH_MAX_NAME_CHARS"],
                 id="job-name"),
    pytest.param(spec(version=LONG), grpc.StatusCode.INVALID_ARGUMENT, ["spec.version", "ACCELMESH_MAX_NAME_CHARS"],
                 id="version"),
    pytest.param(spec(capabilities=[LONG]), grpc.StatusCode.INVALID_ARGUMENT,
                 ["required_capabilities[0]", "ACCELMESH_MAX_NAME_CHARS"], id="capability-name"),
    pytest.param(spec(capabilities=[f"c{i}" for i in range(5)]), grpc.StatusCode.INVALID_ARGUMENT,
                 ["capabilities", "5 entries", "ACCELMESH_MAX_SPEC_ENTRIES"], id="capabilities"),
    pytest.param(spec(filter="x" * 101), grpc.StatusCode.INVALID_ARGUMENT, ["filter", "101", "ACCELMESH_MAX_FILTER_CHARS"],
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
    assert dispatcher.mesh.calls == [] and dispatcher.mesh.reserved == {}
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
    assert job.state == m.FAILED and "reserve" in dispatcher.mesh.calls and job.job_id in dispatcher.mesh.released


def test_a_block_for_a_spec_without_inputs_is_refused_before_planning(dispatcher):
    parts = [("spec", job_spec("affine", {})), ("block", pb.InputBlock(first_row=0))]
    error = rpc_error(submit, dispatcher.stub, parts)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "declares no inputs" in error.details()
    assert dispatcher.mesh.calls == []


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


# -- a client that goes away -------------------------------------------------------------------


def stalled_parts(gate: threading.Event, x: np.ndarray):
    """The spec and the first block, then nothing until `gate` is set (the client never sets it)."""
    parts = list(request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024))
    yield from parts[:2]
    gate.wait(WAIT_S)


@pytest.mark.parametrize("method", ["SubmitJob", "RunJob"])
def test_a_client_gone_mid_stream_leaves_its_job_cancelled_saying_how_much_arrived(dispatcher, method, caplog):
    x = X[:128]  # 2 KiB in 1 KiB blocks: one of them sent
    gate = threading.Event()
    kind = pb.SubmitJobRequest if method == "SubmitJob" else pb.RunJobRequest
    stream = (kind(**{field: message}) for field, message in stalled_parts(gate, x))
    if method == "SubmitJob":
        call = dispatcher.stub.SubmitJob.future(stream, timeout=WAIT_S)
    else:
        call = dispatcher.stub.RunJob(stream, timeout=WAIT_S)
    try:
        assert dispatcher.mesh.reserving.wait(WAIT_S)  # planned and reserved: the input is being read
        (job,) = dispatcher.runner.book.list(1)
        live = dispatcher.runner.live(job.job_id)
        call.cancel()
        assert live.done.wait(WAIT_S)
    finally:
        gate.set()
    job = dispatcher.runner.book.get(job.job_id)
    assert job.state == m.CANCELLED and list(dispatcher.runner.book.events(job.job_id))[-1].type == "cancelled"
    assert job.error == f"the client disconnected while sending input (1,024 of {x.nbytes:,} bytes received)"
    assert dispatcher.mesh.released == [job.job_id]
    assert dispatcher.runner.running == 0 and dispatcher.runner.book.live_count == 0
    # The call's handler has ended (admission lets go of a stream once its status is made): the
    # cancel was a CANCELLED status for nobody, never logged as a bug with an incident id.
    deadline = time.monotonic() + WAIT_S
    while dispatcher.server.streams.open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dispatcher.server.streams.open == 0
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]


# -- nothing of an ended job stays -------------------------------------------------------------


class ParameterFeed(Feed):
    def __init__(self, arrays, parameters):
        super().__init__(arrays)
        self._parameters = parameters

    def parameters(self):
        given, self._parameters = self._parameters, None
        return given


@pytest.mark.parametrize("failure", ["wrong-parameters", "shard-crash", "short-input", "succeeded"])
def test_an_ended_client_parameter_job_keeps_no_reference_to_its_buffer(tmp_path, failure):
    mesh = FakeMesh(AFFINE)
    mesh.crash = failure == "shard-crash"
    runner = runner_for(mesh, tmp_path)
    buffer = np.ones((5,) if failure == "wrong-parameters" else (4,), np.float32)
    alive = weakref.ref(buffer)
    feed = ParameterFeed([X[:64]], [("b", buffer)])
    feed.end_early = 32 if failure == "short-input" else None
    del buffer
    gc.collect()
    gc.disable()  # only references may free it, never the cycle collector
    try:
        job, live = runner.start(spec_for(AFFINE, [X[:64]], client_parameters=True))
        try:
            runner.run(job, live, feed, background=False)
        except InvalidArgument:  # the caller's copy of the error, dropped with this handler
            pass
        state = runner.book.get(job.job_id).state
        assert state == (m.SUCCEEDED if failure == "succeeded" else m.FAILED)
        assert live.pool is None and (live.error is None or live.error.__traceback__ is None)
        del live, feed
        assert alive() is None, gc.get_referrers(alive())
    finally:
        gc.enable()
    assert runner.running == 0 and runner.book.live_count == 0


PARAMETER_BYTES = 8 << 20


def test_failed_parameter_jobs_through_the_server_hold_no_memory_once_answered(tmp_path):
    """Four jobs, each with 8 MiB of parameters of the wrong shape (refused once the program is
    known): with the cycle collector off, Python holds none of their parameters afterwards."""
    with serving(tmp_path, limits=JobLimits(), max_parameter_bytes=64 << 20) as d:
        x = X[:64]
        parts = list(request_parts(job_spec("affine", {"x": x}, client_parameters=True), {"x": x},
                                   [("b", np.ones(PARAMETER_BYTES // 4, np.float32))], 1 << 16))
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(4):
                error = rpc_error(submit, d.stub, parts)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "expects float32[4]" in error.details()
            assert d.runner.wait_idle(WAIT_S)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
        assert held < PARAMETER_BYTES // 2, f"{held / 2**20:.1f} MiB still held"
        assert d.runner.book.live_count == 0


def test_the_live_maps_are_empty_once_jobs_end(dispatcher):
    x = X[:64]
    ok = request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16)
    submit(dispatcher.stub, ok)
    run_job(dispatcher.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16))
    dispatcher.mesh.crash = True
    failed = submit(dispatcher.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16)).job_id
    assert list(dispatcher.runner.book.events(failed))[-1].type == "failed"
    short = [("spec", job_spec("affine", {"x": x})), ("block", pb.InputBlock(first_row=0, tensors=[to_proto(x[:8])]))]
    rpc_error(submit, dispatcher.stub, short)
    assert dispatcher.runner.wait_idle(WAIT_S)
    assert [j.state for j in dispatcher.runner.book.list(10)] == [m.FAILED, m.FAILED, m.SUCCEEDED, m.SUCCEEDED]
    assert dispatcher.runner.running == 0 and dispatcher.runner.book.live_count == 0


# -- listings stay small -----------------------------------------------------------------------


def test_a_listing_leaves_out_the_per_shard_lists_and_stops_short_of_the_message_limit(tmp_path):
    with serving(tmp_path, max_message_bytes=65536) as d:  # a page of at most 32 KiB
        x = X[:256]  # 4 KiB: shards of at most 1 KiB

        def one(i):
            return submit(d.stub, request_parts(job_spec("affine", {"x": x}, name=f"job-{i}"), {"x": x}, None, 1 << 16))

        first = one(0).job_id
        assert d.runner.wait_idle(WAIT_S)
        full = d.stub.GetJob(pb.GetJobRequest(job_id=first), timeout=WAIT_S).job
        assert len(full.shards) == len(full.plan.shards) >= 4
        listed = d.stub.ListJobs(pb.ListJobsRequest(page_size=1), timeout=WAIT_S).jobs[0]
        assert not listed.shards and not listed.plan.shards and listed.plan.targets and listed.spec.name == "job-0"
        count = 32768 // listed.ByteSize() + 5
        for i in range(1, count):
            one(i)
        response = d.stub.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=WAIT_S)
        assert 0 < len(response.jobs) < count and response.ByteSize() <= 32768
        assert response.jobs[0].spec.name == f"job-{count - 1}"  # newest first


def test_names_under_the_limit_pass_and_over_it_are_refused_in_domain_code(tmp_path):
    runner = JobRunner(FakeMesh(AFFINE), JobBook(tmp_path, retention_s=60), ThroughputModel(), max_shard_bytes=1024,
                       inflight_bytes=1 << 20, job_limits=LIMITS)
    runner.check(spec_for(AFFINE, [X[:8]], name="n" * 40))
    with pytest.raises(InvalidArgument, match="ACCELMESH_MAX_NAME_CHARS"):
        runner.check(spec_for(AFFINE, [X[:8]], name="n" * 41))


# -- a huge job, declared or stored ------------------------------------------------------------


def test_a_spec_only_job_of_2_34_rows_is_refused_at_once_with_the_default_limits(tmp_path):
    with serving(tmp_path, limits=JobLimits()) as d:
        error = rpc_error(submit, d.stub, [("spec", spec(rows=2**34, cols=64))])
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "17,179,869,184" in error.details() and "ACCELMESH_MAX_JOB_ROWS" in error.details()
        assert d.mesh.calls == [] and d.runner.book.list(10) == []
        error = rpc_error(d.stub.PlanJob, pb.PlanJobRequest(spec=spec(rows=2**34, cols=64)), timeout=WAIT_S)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and d.mesh.calls == []


def store_oversized_record(book_dir) -> str:
    """A job as a dispatcher before the limits stored a huge one: ~6 MB, every shard spelled out."""
    import dataclasses
    import json
    import sqlite3

    book = JobBook(book_dir, retention_s=3600)
    job = book.create(m.JobSpec(program="affine", inputs=(m.InputDecl("x", "float32", (2**34, 64)),)))
    book.finish(job, m.CANCELLED, error="cancelled")
    book.close()
    old = dataclasses.asdict(job)
    old["plan"] = {"targets": [], "predicted_seconds": 1.0, "equal_split_predicted_seconds": 1.0, "placement": None,
                   "shards": [{"index": i, "device_id": "10.0.0.1/cuda:0", "target_type": "t", "first_row": i << 16,
                               "rows": 1 << 16, "predicted_seconds": i * 1e-6} for i in range(50_000)]}
    with sqlite3.connect(book_dir / "jobs.db") as db:
        db.execute("UPDATE jobs SET record = ? WHERE job_id = ?", (json.dumps(old), job.job_id))
    return job.job_id


def test_list_and_get_still_work_with_an_oversized_stored_record_present(tmp_path):
    huge = store_oversized_record(tmp_path)
    with serving(tmp_path, max_message_bytes=1 << 20) as d:  # its shards alone would be a 2 MB message
        x = X[:64]
        newer = submit(d.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16)).job_id
        assert d.runner.wait_idle(WAIT_S)
        (first,) = d.stub.ListJobs(pb.ListJobsRequest(page_size=1), timeout=WAIT_S).jobs
        assert first.job_id == newer
        both = d.stub.ListJobs(pb.ListJobsRequest(page_size=2), timeout=WAIT_S)
        assert [j.job_id for j in both.jobs] == [newer, huge] and both.ByteSize() < 16384
        job = d.stub.GetJob(pb.GetJobRequest(job_id=huge), timeout=WAIT_S).job
        assert job.state == job_pb.JOB_STATE_CANCELLED and not job.plan.shards and job.ByteSize() < 16384
        assert d.stub.GetJob(pb.GetJobRequest(job_id=newer), timeout=WAIT_S).job.state == job_pb.JOB_STATE_SUCCEEDED


def test_a_pipeline_of_more_micro_batches_x_stages_than_the_shard_limit_is_refused_before_building(tmp_path):
    """4 micro-batches pass the check before planning; through 3 stages they are 12 shards."""
    mesh = FakePipelineMesh()
    runner = JobRunner(mesh, JobBook(tmp_path, retention_s=60), ThroughputModel(), max_shard_bytes=1024,
                       inflight_bytes=1 << 20, job_limits=JobLimits(max_shards=8))
    spec = spec_for(CHAIN, [X[:16]], placement=m.PlacementSpec("ranked", device_count=2, micro_batch_rows=4))
    _, plan, _, _ = runner.plan(spec)
    assert (plan.placement.micro_batches, len(plan.placement.stages)) == (4, 3)
    job, live = runner.start(spec)
    with pytest.raises(ResourceExhausted, match=r"4 micro-batches through 3 stages are 12 shards.*ACCELMESH_MAX_JOB_SHARDS"):
        runner.run(job, live, Feed([X[:16]]), background=False)
    assert mesh.reserved == {} and runner.book.get(job.job_id).state == m.FAILED


def test_a_block_of_scalars_is_invalid_not_a_crash(dispatcher):
    x = np.zeros(16, np.float32)
    spec = job_spec("affine", {"x": x})
    error = rpc_error(submit, dispatcher.stub, [("spec", spec), ("block", pb.InputBlock(
        first_row=0, tensors=[to_proto(np.float32(1))]))])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "input 'x' is float32[]" in error.details()

