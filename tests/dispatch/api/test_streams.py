"""The dispatcher's streams: no principal's idle streams leave the others none (each holds at most
as many as are free), an upload that goes quiet is ended after ACCELMESH_STREAM_IDLE_S with all
its job held released, and a WatchJob waiting on a job is never cut for waiting. Through a real
in-process server on port 0 with security on, over the fake mesh (tests/fakes/small_dispatcher.py),
each principal a user token of its own."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh import errors
from accelmesh.client import job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.runtime.admission import MAX_STREAMS_ENV, Admission
from accelmesh.runtime.errors import error_reason
from dispatch_svc.admission.admission import AdmissionGate
from dispatch_svc.admission.quotas import Quotas
from dispatch_svc.api.servicer import STREAM_IDLE_ENV
from dispatch_svc.jobs import records as m

from fakes.ports import WAIT_S, X
from fakes.small_dispatcher import RecordingInventory, RecordingMesh, requests, serving, submit

IDLE_S = 0.3  # the idle limit of the idle tests: short, so they end soon; what they assert is the outcome


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


class IdleUpload:
    """A SubmitJob whose client sends nothing until closed."""

    def __init__(self, stub):
        self._requests: queue.Queue = queue.Queue()
        self.call = stub.SubmitJob.future(iter(self._requests.get, None), timeout=WAIT_S * 4)

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


@pytest.fixture(name="uploads")
def uploads_fixture():
    opened: list[IdleUpload] = []
    yield opened
    for upload in opened:
        upload.close()


def open_until_refused(dispatcher, stub, key: str, uploads: list, most: int) -> grpc.RpcError | None:
    """Idle uploads as `key`'s principal, one at a time, until one is refused (its error) or `most` are open."""
    for held in range(most):
        upload = IdleUpload(stub)
        uploads.append(upload)
        wait_until(lambda upload=upload, held=held: upload.call.done()
                   or dispatcher.server.streams.held(key) == held + 1, f"stream {held + 1} of {key} is admitted")
        if upload.call.done():
            return upload.call.exception()
    return None


def share_details(refused: grpc.RpcError) -> tuple[dict, list[str]]:
    metadata, subjects = {}, []
    for detail in rpc_status.from_call(refused).details:
        info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
        if detail.Unpack(info):
            metadata = dict(info.metadata)
        elif detail.Unpack(quota):
            subjects += [v.subject for v in quota.violations]
    return metadata, subjects


@pytest.mark.slow
def test_no_principal_s_idle_streams_starve_the_dispatcher_of_streams_for_others(tmp_path, uploads):
    """Two principals opening idle uploads past the dispatcher's stream limit get half of it and
    half the rest (4 and 2 of 8), each refused past that RESOURCE_EXHAUSTED with the share, its
    variable and the principal as details; a third principal's SubmitJob and WatchJob are served."""
    with serving(tmp_path, admission=Admission(max_streams=8, max_streams_per_client=8)) as dispatcher:
        for user, share in (("streams-ann", 4), ("streams-bob", 2)):
            refused = open_until_refused(dispatcher, dispatcher.stub_as(user), f"user:{user}", uploads, most=8)
            assert refused is not None, f"{user} opened 8 idle streams of the dispatcher's 8"
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(refused) == errors.STREAM_SHARE
            assert f"holds {share} open streams" in refused.details() and MAX_STREAMS_ENV in refused.details()
            assert "close some of them" in refused.details()
            assert share_details(refused) == ({"limit": str(share), "held": str(share), "variable": MAX_STREAMS_ENV},
                                              [f"principal:user:{user}"])
        assert dispatcher.server.streams.open == 6
        cy = dispatcher.stub_as("streams-cy")
        x = X[:64]
        job_id = submit(cy, request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024)).job_id
        events = list(cy.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=WAIT_S))
        assert events[-1].event.type == job_pb.JOB_EVENT_TYPE_SUCCEEDED


def stalled(kind, gate: threading.Event, x: np.ndarray, parts: int):
    """The first `parts` messages of a job's stream (0: none, 1: the spec, 2: and its first block),
    then nothing until `gate` is set."""
    sent = list(request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024))
    for field, message in sent[:parts]:
        yield kind(**{field: message})
    gate.wait(WAIT_S * 4)


def call(stub, method: str, requests):
    """The status a SubmitJob or RunJob call ends with."""
    with pytest.raises(grpc.RpcError) as caught:
        if method == "SubmitJob":
            stub.SubmitJob(requests, timeout=WAIT_S)
        else:
            list(stub.RunJob(requests, timeout=WAIT_S))
    return caught.value


def readers(method: str) -> list[threading.Thread]:
    """The threads reading a request stream of `method` ahead (runtime/request_streams.py)."""
    return [t for t in threading.enumerate() if t.name == f"{method}-requests"]


def assert_idle_status(refused: grpc.RpcError, method: str) -> None:
    assert refused.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"the {method} request stream sent no message for {IDLE_S:g} s ({STREAM_IDLE_ENV})" in refused.details()
    assert error_reason(refused) == errors.STREAM_IDLE


@pytest.mark.slow
@pytest.mark.parametrize("method", ["SubmitJob", "RunJob"])
def test_an_idle_upload_is_ended_after_the_idle_limit_and_its_job_releases_all_it_held(tmp_path, method):
    """The spec and one block of two, then silence: past ACCELMESH_STREAM_IDLE_S the call ends
    DEADLINE_EXCEEDED naming the variable, the job FAILED saying so, its reservations released,
    its stream slot given back and nothing of it left live."""
    kind = pb.SubmitJobRequest if method == "SubmitJob" else pb.RunJobRequest
    gate = threading.Event()
    with serving(tmp_path, stream_idle_s=IDLE_S) as dispatcher:
        try:
            assert_idle_status(call(dispatcher.stub, method, stalled(kind, gate, X[:128], 2)), method)
        finally:
            gate.set()
        (job,) = dispatcher.runner.book.list(1)
        assert dispatcher.runner.wait_idle(WAIT_S)
        job = dispatcher.runner.book.get(job.job_id)
        assert job.state == m.FAILED and STREAM_IDLE_ENV in job.error
        assert dispatcher.mesh.inventory.released == [job.job_id]
        assert dispatcher.runner.running == 0 and dispatcher.runner.book.live_count == 0
        wait_until(lambda: dispatcher.server.streams.open == 0, "the idle stream's slot is given back")
        wait_until(lambda: not readers(method), "the stream's reading thread has ended")


@pytest.mark.slow
@pytest.mark.parametrize("parts", [0, 1], ids=["nothing", "spec-only"])
def test_an_upload_idle_before_its_job_starts_is_ended_and_starts_none(tmp_path, parts):
    gate = threading.Event()
    with serving(tmp_path, stream_idle_s=IDLE_S) as dispatcher:
        try:
            requests = stalled(pb.SubmitJobRequest, gate, X[:128], parts)
            assert_idle_status(call(dispatcher.stub, "SubmitJob", requests), "SubmitJob")
        finally:
            gate.set()
        assert dispatcher.runner.book.list(10) == []
        assert dispatcher.mesh.calls == []
        wait_until(lambda: dispatcher.server.streams.open == 0, "the idle stream's slot is given back")
        wait_until(lambda: not readers("SubmitJob"), "the stream's reading thread has ended")


class FullInventory(RecordingInventory):
    """Every reservation refused, as by a pool that other jobs fill: a job goes to the queue."""

    def reserve(self, job_id, claims, ttl_s):
        self.calls.append("reserve")
        self.reserving.set()
        raise errors.ResourceExhausted("every device is reserved by other jobs")


@pytest.mark.slow
def test_an_upload_idle_while_its_queued_job_stores_its_inputs_leaves_none_stored(tmp_path):
    mesh = RecordingMesh()
    mesh.inventory.__class__ = FullInventory
    gate = threading.Event()
    with serving(tmp_path, stream_idle_s=IDLE_S, mesh=mesh,
                 gate=lambda book: AdmissionGate(mesh.inventory, quotas=Quotas(book.engine))) as dispatcher:
        try:
            requests = stalled(pb.SubmitJobRequest, gate, X[:128], 2)
            assert_idle_status(call(dispatcher.stub, "SubmitJob", requests), "SubmitJob")
        finally:
            gate.set()
        (job,) = dispatcher.runner.book.list(1)
        assert "reserve" in mesh.calls  # it was refused devices, so its inputs were being stored
        assert dispatcher.runner.wait_idle(WAIT_S)
        job = dispatcher.runner.book.get(job.job_id)
        assert job.state == m.FAILED and STREAM_IDLE_ENV in job.error
        assert not (dispatcher.runner.book.inputs.root / job.job_id).exists()
        wait_until(lambda: dispatcher.server.streams.open == 0, "the idle stream's slot is given back")


@pytest.mark.slow
def test_a_watch_job_and_a_run_job_waiting_on_a_job_are_not_cut_by_the_idle_limit(tmp_path):
    """A RunJob whose inputs are all sent waits for its results, and a WatchJob for the job's next
    event, while the job's shard is held on its worker: both outlast an idle upload opened after
    them, which the dispatcher ends at its idle limit (the server's own clock, not the test's),
    and both see the job succeed once the shard is let go."""
    x = X[:64]
    with serving(tmp_path, stream_idle_s=IDLE_S) as dispatcher:
        workers = dispatcher.mesh.workers
        workers.hold = True
        parts = request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024)
        try:
            run = dispatcher.stub.RunJob(requests(parts, pb.RunJobRequest), timeout=WAIT_S * 2)
            assert workers.started.wait(WAIT_S)
            (job,) = dispatcher.runner.book.list(1)
            watch = dispatcher.stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=WAIT_S * 2)
            first = next(watch)
            idle = IdleUpload(dispatcher.stub)
            assert idle.call.exception(timeout=WAIT_S).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert not watch.done() and not run.done()
        finally:
            workers.let_go.set()
        rest = list(watch)
        assert first.event.index == 0 and rest[-1].event.type == job_pb.JOB_EVENT_TYPE_SUCCEEDED
        final = [r.job for r in run if r.HasField("job")]
        assert [j.state for j in final] == [job_pb.JOB_STATE_SUCCEEDED]
