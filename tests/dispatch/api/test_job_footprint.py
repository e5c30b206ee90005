"""What the dispatcher keeps of a job: a client that goes away mid-stream leaves its job CANCELLED
with how much arrived; an ended job leaves nothing of itself in the live maps and no reference to
its buffers; a listing stays small, and a huge record stored before the limits existed is read
without failing. Through a real in-process server on port 0 over the fake mesh of tests/fakes/ports.py
(tests/fakes/small_dispatcher.py), plus the runner alone where no stream is needed. The limits themselves are
in test_limits.py."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref

import grpc
import numpy as np
import pytest

from accelmesh.client import job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.errors import InvalidArgument
from accelmesh.runtime.tensors import to_proto
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import JobLimits

from conftest import rpc_error
from fakes.ports import AFFINE, WAIT_S, FakeMesh, Feed, X, runner_for, spec_for
from fakes.small_dispatcher import RecordingCompiler, RecordingMesh, requests, run_job, serving, submit


@pytest.fixture
def dispatcher(tmp_path):
    with serving(tmp_path) as d:
        yield d


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
    assert dispatcher.mesh.inventory.released == [job.job_id]
    assert dispatcher.runner.running == 0 and dispatcher.runner.book.live_count == 0
    # The call's handler has ended (admission lets go of a stream once its status is made): the
    # cancel was a CANCELLED status for nobody, never logged as a bug with an incident id.
    deadline = time.monotonic() + WAIT_S
    while dispatcher.server.streams.open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dispatcher.server.streams.open == 0
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]


class HeldCompiler(RecordingCompiler):
    """A compile that takes until the test lets it go (`release`), then builds: one that does not
    hear of its job's cancel, as a build already done when it came."""

    compiling: threading.Event
    release: threading.Event

    def compile(self, program, devices, batch_sizes, precision=""):
        self.compiling.set()
        assert self.release.wait(WAIT_S * 2)  # past the test's own wait: the test fails first, saying why
        return super().compile(program, devices, batch_sizes, precision)


def test_a_submit_job_cancelled_while_its_job_compiles_leaves_it_cancelled_with_nothing_reserved(tmp_path):
    """The whole input sent, the call is cancelled while the job's compile blocks: the cancel
    reaches the job at once (its scope), and once the build comes back the job ends CANCELLED,
    saying it was never accepted, without reserving devices with the build, released all the same."""
    mesh = RecordingMesh()
    mesh.compiler.__class__ = HeldCompiler
    mesh.compiler.compiling, mesh.compiler.release = threading.Event(), threading.Event()
    x = X[:64]  # one block: all of it is read before planning
    with serving(tmp_path, mesh=mesh) as dispatcher:
        call = dispatcher.stub.SubmitJob.future(requests(request_parts(job_spec("affine", {"x": x}), {"x": x}, None,
                                                                       1024)), timeout=WAIT_S)
        try:
            assert mesh.compiler.compiling.wait(WAIT_S)
            (job,) = dispatcher.runner.book.list(1)
            live = dispatcher.runner.live(job.job_id)
            call.cancel()
            assert live.scope.cancelled.wait(WAIT_S), "the cancelled SubmitJob call did not reach its job"
        finally:
            mesh.compiler.release.set()
        assert live.done.wait(WAIT_S)
        job = dispatcher.runner.book.get(job.job_id)
        assert job.state == m.CANCELLED, job.error
        assert job.error == "the client of its SubmitJob call disconnected before the job was accepted"
        assert list(dispatcher.runner.book.events(job.job_id))[-1].type == "cancelled"
        assert "reserve" not in mesh.calls and mesh.inventory.reserved == {}, mesh.calls
        assert mesh.inventory.released == [job.job_id]
        assert dispatcher.runner.running == 0 and dispatcher.runner.book.live_count == 0


def test_a_submit_job_answered_leaves_its_job_running_after_the_call_ends(dispatcher):
    """Once SubmitJob has answered with the job id, the call's end is no cancel: the job, its
    shard held on its worker when the call ended, goes on and succeeds. (It passes without the
    cancel above too: it guards that cancel against reaching jobs it must not.)"""
    x = X[:64]
    workers = dispatcher.mesh.workers
    workers.hold = True
    try:
        job_id = submit(dispatcher.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024)).job_id
        assert workers.started.wait(WAIT_S)
        dispatcher.channel.close()  # the client is gone as well as its call
        live = dispatcher.runner.live(job_id)
        assert live is not None  # its shard is held: it runs
    finally:
        workers.let_go.set()
    assert live.done.wait(WAIT_S)
    job = dispatcher.runner.book.get(job_id)
    assert job.state == m.SUCCEEDED and not live.scope.cancelled.is_set(), job.error


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
    mesh.workers.crash = failure == "shard-crash"
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
    dispatcher.mesh.workers.crash = True
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
        # Half as many again as one page holds at the first record's size: a record's size moves by a few
        # bytes with its timestamps, and the listing may only be measured once every job has ended (a job
        # still queued has a smaller record), so the margin is by proportion, not by a count of jobs.
        count = 32768 * 3 // 2 // listed.ByteSize()
        for i in range(1, count):
            one(i)
        assert d.runner.wait_idle(WAIT_S)
        response = d.stub.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=WAIT_S)
        assert 0 < len(response.jobs) < count and response.ByteSize() <= 32768
        assert response.jobs[0].spec.name == f"job-{count - 1}"  # newest first
        names = [j.spec.name for j in response.jobs]
        while response.next_page_token:  # the rest come on the next pages (AIP-158), each within the limit
            response = d.stub.ListJobs(pb.ListJobsRequest(page_size=1000, page_token=response.next_page_token),
                                       timeout=WAIT_S)
            assert response.ByteSize() <= 32768
            names += [j.spec.name for j in response.jobs]
        assert names == [f"job-{i}" for i in reversed(range(count))]


def test_pages_of_a_listing_follow_each_other_without_gaps_or_repeats(tmp_path):
    with serving(tmp_path) as d:
        x = X[:8]
        made = [submit(d.stub, request_parts(job_spec("affine", {"x": x}, name=f"job-{i}"), {"x": x}, None,
                                             1 << 16)).job_id
                for i in range(7)]
        assert d.runner.wait_idle(WAIT_S)
        seen, token, pages = [], "", 0
        while True:
            page = d.stub.ListJobs(pb.ListJobsRequest(page_size=3, page_token=token), timeout=WAIT_S)
            seen += [j.job_id for j in page.jobs]
            pages += 1
            token = page.next_page_token
            if not token:
                break
        assert seen == made[::-1] and pages == 3  # 3 + 3 + 1
        error = rpc_error(d.stub.ListJobs, pb.ListJobsRequest(page_token="not-a-token"), timeout=WAIT_S)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in error.details()


def test_a_listing_by_state_pages_through_those_jobs_alone_and_names_a_bad_state(tmp_path):
    with serving(tmp_path) as d:
        x = X[:8]

        def run(name):
            parts = request_parts(job_spec("affine", {"x": x}, name=name), {"x": x}, None, 1 << 16)
            return submit(d.stub, parts).job_id
        good = [run(f"good-{i}") for i in range(3)]
        assert d.runner.wait_idle(WAIT_S)
        d.mesh.workers.fail = {device.id: 100 for device in d.mesh.devices}  # every attempt fails: the job does
        bad = run("bad")
        assert d.runner.wait_idle(WAIT_S)

        def listed(states, page_size):
            seen, token = [], ""
            while True:
                page = d.stub.ListJobs(pb.ListJobsRequest(page_size=page_size, page_token=token, states=states),
                                       timeout=WAIT_S)
                seen += [j.job_id for j in page.jobs]
                token = page.next_page_token
                if not token:
                    return seen
        assert listed([job_pb.JOB_STATE_SUCCEEDED], 2) == good[::-1]
        assert listed([job_pb.JOB_STATE_FAILED], 2) == [bad]
        assert listed([job_pb.JOB_STATE_FAILED, job_pb.JOB_STATE_SUCCEEDED], 50) == [bad, *good[::-1]]
        assert listed([job_pb.JOB_STATE_QUEUED, job_pb.JOB_STATE_RUNNING], 50) == []
        assert listed([], 50) == [bad, *good[::-1]]  # no states: every job
        for states, named in (([job_pb.JOB_STATE_UNSPECIFIED], "JOB_STATE_UNSPECIFIED"), ([1, 99], "not a JobState")):
            error = rpc_error(d.stub.ListJobs, pb.ListJobsRequest(states=states), timeout=WAIT_S)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"states[{len(states) - 1}] is {states[-1]} ({named}); name one of JOB_STATE_" in error.details()


def test_a_retried_submit_with_its_request_id_gets_the_first_job_which_runs_once(tmp_path):
    with serving(tmp_path) as d:
        x = X[:64]

        def parts(request_id, name="first"):
            spec = job_spec("affine", {"x": x}, name=name)
            spec.request_id = request_id
            return request_parts(spec, {"x": x}, None, 1 << 16)

        first = submit(d.stub, parts("req-1")).job_id
        again = submit(d.stub, parts("req-1", name="a retry")).job_id
        other = submit(d.stub, parts("req-2")).job_id
        assert d.runner.wait_idle(WAIT_S)
        assert again == first != other
        assert sorted(j.job_id for j in d.runner.book.list(10)) == sorted([first, other])
        ran = run_job(d.stub, parts("req-1"))  # RunJob with that id: the first job, replayed
        assert ran[-1].job.job_id == first and ran[-1].job.state == job_pb.JOB_STATE_SUCCEEDED
        assert [p.event.type for p in ran if p.HasField("event")][-1] == job_pb.JOB_EVENT_TYPE_SUCCEEDED
        rows = sum(len(p.chunk.data) for p in ran if p.HasField("chunk"))
        fetched = sum(len(p.chunk.data) for p in d.stub.FetchResult(pb.FetchResultRequest(job_id=first), timeout=WAIT_S)
                      if p.HasField("chunk"))
        assert rows == fetched > 0
        error = rpc_error(submit, d.stub, parts("no spaces allowed"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.request_id" in error.details()


# -- a huge job, stored ------------------------------------------------------------------------


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



def test_a_job_book_database_that_goes_away_answers_unavailable_and_keeps_every_finished_result(
        tmp_path, postgres_url):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dispatch_svc.server import SERVICE_NAME

    from conftest import _postgres_server

    def health(service=""):
        stub = health_pb2_grpc.HealthStub(d.channel)
        return stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)

    def until(watch, status):
        return next(r.status for r in watch if r.status == status)

    with serving(tmp_path, database_url=postgres_url, readiness_interval_s=0.05) as d:
        x = X[:64]
        done = submit(d.stub, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1 << 16)).job_id
        assert d.runner.wait_idle(WAIT_S)

        def result():
            return b"".join(p.chunk.data for p in d.stub.FetchResult(pb.FetchResultRequest(job_id=done), timeout=WAIT_S)
                            if p.HasField("chunk"))

        before = result()
        readiness = health()
        until(readiness, health_pb2.HealthCheckResponse.SERVING)
        _postgres_server().allow_connections(postgres_url, False)
        try:
            # Not ready while the book is away (a Service sends it no callers), but alive: the
            # service's own name stays SERVING, so a liveness probe does not restart it for nothing.
            assert until(readiness, health_pb2.HealthCheckResponse.NOT_SERVING)
            alive = health_pb2_grpc.HealthStub(d.channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert alive.status == health_pb2.HealthCheckResponse.SERVING
            for call, request in ((d.stub.GetJob, pb.GetJobRequest(job_id=done)),
                                  (d.stub.ListJobs, pb.ListJobsRequest()),
                                  (d.stub.CancelJob, pb.CancelJobRequest(job_id=done))):
                error = rpc_error(call, request, timeout=WAIT_S)
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "try again" in error.details(), error.details()
        finally:
            _postgres_server().allow_connections(postgres_url, True)
        assert until(readiness, health_pb2.HealthCheckResponse.SERVING)  # ready again once it is back
        readiness.cancel()
        assert d.stub.GetJob(pb.GetJobRequest(job_id=done), timeout=WAIT_S).job.state == job_pb.JOB_STATE_SUCCEEDED
        assert before and result() == before  # the finished result, whole, as before the outage
