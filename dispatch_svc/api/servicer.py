"""DispatchService adapter: request streams into the runner, what dispatch_svc.api.delivery hands back out.

Every job belongs to whoever submitted it: another caller asking for it gets NOT_FOUND, exactly
as for a job that does not exist (so job ids reveal nothing), and ListJobs lists one's own;
operators see every job.

A SubmitJob or RunJob request stream that sends no message for `stream_idle_s` while the
dispatcher waits for one is ended DEADLINE_EXCEEDED (runtime/request_streams.py), and its job
with it, releasing all it held. Response streams are never cut for waiting on a job: a WatchJob
of a job queued for a day holds its stream slot, within its principal's share of them
(runtime/admission.py), and keepalive pings end it if its client is gone.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading

import numpy as np

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.errors import quoted
from accelmesh.runtime.batches import FLUSH, batched
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES
from accelmesh.runtime.request_streams import IdleBounded
from accelmesh.runtime.tensors import dtype_code, split_frames
from accelmesh.security.access import Authenticator, sees_everything
from dispatch_svc.api import delivery
from dispatch_svc.api import translate as tr
from dispatch_svc.api.direct_feed import DirectFeed
from dispatch_svc.api.stream_feed import BlockHeaders, StreamFeed
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import job_not_found
from dispatch_svc.jobs.limits import JobLimits
from dispatch_svc.jobs.validation import check_job_id

log = logging.getLogger(__name__)

DEFAULT_LIST = 50
MAX_LIST = 1000  # a larger page_size is read as this (AIP-158): each listed job is read and parsed
# A ListJobs page stops before its jobs pass this share of the message limit, whatever page_size
# asked: listed jobs are summaries (translate.job_to_proto), so only specs near the limits fill it.
LIST_MESSAGE_SHARE = 0.5
CANCEL_WAIT_S = 30  # CancelJob answers once the job has stopped, or with it as it is after this
STREAM_IDLE_ENV = "ACCELMESH_STREAM_IDLE_S"
DEFAULT_STREAM_IDLE_S = 60.0  # a request stream sending nothing this long is ended (the module docstring)


def _first(requests):
    """The stream's first message, which must carry the job spec."""
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != "spec":
        raise errors.InvalidArgument("the first message must carry the job spec")
    return first


class DispatchServicer(dispatch_service_pb2_grpc.DispatchServiceServicer):
    def __init__(self, runner: JobRunner, auth: Authenticator, *, chunk_bytes: int, max_parameter_bytes: int,
                 limits: JobLimits | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 stream_idle_s: float = DEFAULT_STREAM_IDLE_S):
        self.runner = runner
        self._auth = auth
        self.book = runner.book
        self._chunk_bytes = chunk_bytes
        self._max_parameter_bytes = max_parameter_bytes
        self._limits = limits or runner.job_limits
        self._list_bytes = int(max_message_bytes * LIST_MESSAGE_SHARE)
        self._stream_idle_s = stream_idle_s

    def PlanJob(self, request, context):
        if not request.HasField("spec"):
            raise errors.InvalidArgument("spec is required")
        _, plan, _, _ = self.runner.plan(tr.spec_from_proto(request.spec))
        return pb.PlanJobResponse(plan=tr.plan_to_proto(plan))

    def _job(self, job_id: str, context) -> m.JobRecord:
        """The job, if the caller may see it; NOT_FOUND (the same as for no such job) otherwise."""
        check_job_id(job_id, self._limits)
        job = self.book.get(job_id)
        principal = self._auth.principal(context)
        if job.owner != principal.key and not sees_everything(principal):
            raise job_not_found(job_id)
        return job

    def _start(self, first, requests, context, headers: BlockHeaders):
        """The job of a SubmitJob or RunJob stream, once its spec is within the limits and its
        parameters and first block fit, and no block read since is misplaced: all checked before
        the job is recorded or planned. A request id this caller used before: that job, with no
        live state or feed (nothing to run). `first` is the stream's first message (`_first`),
        `requests` the rest; `headers` checks their blocks as they come, and stops the job for
        one that cannot fit, whenever it comes."""
        spec = tr.spec_from_proto(first.spec)
        owner = self._auth.principal(context).key
        earlier = self.book.by_request(owner, spec.request_id)
        if earlier is not None:
            return earlier, None, None
        self.runner.check(spec)
        ended = threading.Event()  # a stream cut short by a client killed mid-upload reads as its going
        context.add_callback(ended.set)
        direct = spec.data_path == m.DIRECT
        feed = (DirectFeed if direct else StreamFeed)(requests, spec, self._max_parameter_bytes, self._limits, ended)
        try:
            feed.read_ahead()
        except errors.Cancelled as exc:  # gone before its job began: nothing to record, nobody to answer
            raise errors.Unavailable(f"{exc}; no job was started") from None
        headers.check()  # the block after the first came already, and cannot fit
        try:
            job, live = self.runner.start(spec, owner)
        except errors.AlreadyExists:  # a retry that raced its first attempt, on this replica or another
            return self.book.by_request(owner, spec.request_id), None, None
        headers.stops(live)
        if direct:
            feed.follow(live.direct.stored, live.refuse)
        return job, live, feed

    def _bounded(self, request_iterator, context, method: str, headers: BlockHeaders) -> IdleBounded:
        """The request stream, ended DEADLINE_EXCEEDED once it idles past `stream_idle_s`, each
        block's header checked by `headers` as the stream's reader takes it."""
        idle_s = self._stream_idle_s

        def idle() -> errors.DeadlineExceeded:
            return errors.DeadlineExceeded(
                f"the {method} request stream sent no message for {idle_s:g} s ({STREAM_IDLE_ENV}); it was ended "
                "and its job, if it had started, stopped: send each message sooner, and close the stream's sending "
                "side after the last block", reason=errors.STREAM_IDLE)

        requests = IdleBounded(headers.watch(request_iterator), idle_s, idle, name=f"{method}-requests")
        context.add_callback(requests.close)
        return requests

    def SubmitJob(self, request_iterator, context):
        headers = BlockHeaders()
        request_iterator = self._bounded(request_iterator, context, "SubmitJob", headers)
        first = _first(request_iterator)
        if first.spec.data_path == job_pb.DATA_PATH_DIRECT:
            raise errors.InvalidArgument("spec.data_path DATA_PATH_DIRECT needs RunJob, whose stream says where to put "
                                         "the inputs and where the outputs lie; SubmitJob takes DATA_PATH_RELAY",
                                         field="spec.data_path")
        job, live, feed = self._start(first, request_iterator, context, headers)
        if live is None:
            return pb.SubmitJobResponse(job_id=job.job_id)
        # Until the client has its job id, the call's end is its client gone (or its deadline past): the
        # job stops, whether planning, compiling or taking its input, rather than build and reserve for
        # nobody. Once answered, the job is the client's to watch, and outlives the call.
        answered = threading.Event()

        def ended():
            if not answered.is_set():
                self._client_gone(job, live, feed, "SubmitJob")
        if not context.add_callback(ended):  # the call ended already
            ended()
        try:
            self.runner.run(job, live, feed)
        except errors.Cancelled:  # CancelJob or a disconnect while the input arrived: GetJob says which
            pass
        answered.set()
        return pb.SubmitJobResponse(job_id=job.job_id)

    def RunJob(self, request_iterator, context):
        headers = BlockHeaders()
        request_iterator = self._bounded(request_iterator, context, "RunJob", headers)
        first = _first(request_iterator)
        job, live, feed = self._start(first, request_iterator, context, headers)
        responses = self._run_job(job, live, feed, context)
        if first.accept_batches:  # what is ready at once goes as one message (accelmesh.runtime.batches)
            yield from batched(responses, pb.RunJobResponse, self._chunk_bytes)
        else:
            yield from (response for response in responses if response is not FLUSH)

    def _run_job(self, job: m.JobRecord, live, feed, context):
        """RunJob's responses, with FLUSH where the job has nothing more ready for now."""
        if live is None:
            pieces = delivery.replay(self.book, job.job_id, self._chunk_bytes)
        else:
            # The client's deadline or disconnect stops the job (its shards and reservations).
            context.add_callback(lambda: self._client_gone(job, live, feed))
            pieces = delivery.run(self.runner, job, live, feed, self._chunk_bytes)
        for piece in pieces:
            if piece is delivery.IDLE:
                yield FLUSH
            elif isinstance(piece, delivery.EventOut):
                yield pb.RunJobResponse(event=tr.event_to_proto(piece.event, job.job_id))
            elif isinstance(piece, delivery.JobOut):
                yield pb.RunJobResponse(job=tr.job_to_proto(piece.job))
            elif isinstance(piece, delivery.TensorOut):
                yield pb.RunJobResponse(tensor=_header(piece.entry))
            elif isinstance(piece, delivery.WantedOut):
                yield pb.RunJobResponse(put_inputs=pb.InputsWanted(shards=_objects(piece.shards),
                                                                   tickets=_tickets(piece.shards)))
            elif isinstance(piece, delivery.OutputsOut):
                yield pb.RunJobResponse(outputs=pb.OutputsReady(shards=_objects(piece.shards),
                                                                tickets=_tickets(piece.shards)))
            else:
                yield from self._chunks(piece, pb.RunJobResponse)

    def _client_gone(self, job: m.JobRecord, live, feed, method: str = "RunJob") -> None:
        """A RunJob call ended (its client went, or its deadline passed, or it was answered), or a
        SubmitJob call before it was answered: its job stops if it has not ended, planning or running
        here or waiting in the queue (or started from it since), saying how much of its input had
        arrived (a SubmitJob job with all of it: that it was never accepted)."""
        if job.final:
            return
        if self.runner.live(job.job_id) is live:
            live.scope.cancel(feed.gone() if method == "RunJob" or feed.short else
                              f"the client of its {method} call disconnected before the job was accepted")
            return
        try:
            self.runner.cancel(job.job_id, f"the client of its {method} call disconnected")
        except errors.AccelmeshError as exc:  # the book is away: a queued job then waits for its deadline
            log.warning("could not cancel job %s after its client went: %s", job.job_id, exc)

    def _chunks(self, piece: delivery.RowsOut, into):
        """A slab of rows as serialized `into` messages of chunks, each at its byte offset in the whole tensor."""
        if piece.rows.size == 0:
            return
        yield from split_frames(piece.entry.name, piece.rows, self._chunk_bytes, into,
                                base_offset=piece.first_row * piece.entry.row_bytes)[1]

    def WatchJob(self, request, context):
        if request.from_index < 0:
            raise errors.InvalidArgument(f"from_index is {request.from_index}; use 0 for the whole log")
        self._job(request.job_id, context)
        so_far = object()  # `events` says it would wait for the next event: the log so far is sent
        for event in self.book.events(request.job_id, request.from_index, idle=so_far if request.log_so_far else None):
            if event is so_far or not context.is_active():
                return
            yield pb.WatchJobResponse(event=tr.event_to_proto(event, request.job_id))

    def GetJob(self, request, context):
        return pb.GetJobResponse(job=tr.job_to_proto(self._job(request.job_id, context)))

    def ListJobs(self, request, context):
        if request.page_size < 0:
            raise errors.InvalidArgument(f"page_size is {request.page_size}; use 0 for {DEFAULT_LIST}")
        principal = self._auth.principal(context)
        limit = min(request.page_size or DEFAULT_LIST, MAX_LIST)
        jobs = self.book.listing(limit, None if sees_everything(principal) else principal.key,
                                 after=_page_after(request.page_token), states=_states(request.states))
        response, size, last = pb.ListJobsResponse(), 0, None
        with contextlib.closing(jobs):
            for job in jobs:
                message = tr.job_to_proto(job, with_shards=False)
                size += message.ByteSize() + 8  # the field's tag and length
                if size > self._list_bytes and last is not None:
                    break  # the rest come on the next page (and are never read)
                response.jobs.append(message)
                last = job
            else:
                if len(response.jobs) < limit:
                    return response  # the last page
        if last is not None:
            response.next_page_token = _page_token(last)
        return response

    def CancelJob(self, request, context):
        self._job(request.job_id, context)
        self.runner.cancel(request.job_id)
        live = self.runner.live(request.job_id)
        if live is not None:
            live.done.wait(CANCEL_WAIT_S)
            job = self.book.get(request.job_id)
        else:  # run by another replica (or by none): as the book says once that one has acted
            job = self.book.wait_final(request.job_id, CANCEL_WAIT_S if self.book.lease_s else 0)
        return pb.CancelJobResponse(job=tr.job_to_proto(job))

    def FetchResult(self, request, context):
        job = self._job(request.job_id, context)
        if job.state != m.SUCCEEDED:
            raise errors.FailedPrecondition(
                f"job {job.job_id} is {job.state}; results exist only for succeeded jobs"
                + (f" (error: {job.error})" if job.error else ""))
        for piece in delivery.results(self.book, job.job_id, self._chunk_bytes):
            if isinstance(piece, delivery.TensorOut):
                yield pb.FetchResultResponse(tensor=_header(piece.entry))
            else:
                yield from self._chunks(piece, pb.FetchResultResponse)


    def SetQuota(self, request, context):
        quotas = self._quotas()
        if not request.HasField("quota"):
            raise errors.InvalidArgument("quota is required; set quota.tenant (\"user:alice\", or \"*\") "
                                         "and its limits",
                                         field="quota")
        quota = tr.quota_from_proto(request.quota)
        if request.remove:
            if not quotas.remove(quota.tenant):
                raise errors.NotFound(f"tenant {quoted(quota.tenant)} has no quota of its own to remove; ListQuotas "
                                      "shows the quotas set", field="quota.tenant")
            return pb.SetQuotaResponse(quota=tr.quota_to_proto(quota))
        return pb.SetQuotaResponse(quota=tr.quota_to_proto(quotas.set(quota)))

    def ListQuotas(self, request, context):
        principal = self._auth.principal(context)
        uses = self._quotas().usage(None if sees_everything(principal) else principal.key)
        return pb.ListQuotasResponse(quotas=[tr.use_to_proto(use) for use in uses])

    def _quotas(self):
        if self.runner.gate.quotas is None:
            raise errors.FailedPrecondition("this dispatcher runs without a queue, so it has no quotas")
        return self.runner.gate.quotas


def _header(entry) -> common_pb2.TensorHeader:
    size = int(np.prod(entry.shape, dtype=np.int64)) * entry.dtype.itemsize
    return common_pb2.TensorHeader(name=entry.name, dtype=dtype_code(entry.dtype), shape=entry.shape, total_bytes=size)


def _objects(shards) -> list[pb.ShardObjects]:
    """The shards' objects, their tickets left to the message's `tickets` (one a worker)."""
    return [pb.ShardObjects(shard_index=s.shard_index, first_row=s.first_row, rows=s.rows,
                            worker_address=s.worker_address, object_ids=s.object_ids, names=s.names) for s in shards]


def _tickets(shards) -> dict[str, bytes]:
    return {s.worker_address: s.ticket for s in shards}


def _page_token(job: m.JobRecord) -> str:
    """Where the next page starts (AIP-158): after this job, in the listing's order."""
    return base64.urlsafe_b64encode(json.dumps([job.created, job.job_id]).encode()).decode()


def _states(values) -> frozenset[str] | None:
    """ListJobsRequest.states as the book's states; None (every state) when empty."""
    if not values:
        return None
    states = set()
    for index, value in enumerate(values):
        state = tr.STATE_FROM_PROTO.get(value)
        if state is None:
            known = ", ".join(job_pb.JobState.Name(v) for v in tr.STATE_FROM_PROTO)
            raise errors.InvalidArgument(f"states[{index}] is {value} ({_state_name(value)}); name one of {known}",
                                         field=f"states[{index}]")
        states.add(state)
    return frozenset(states)


def _state_name(value: int) -> str:
    return job_pb.JobState.Name(value) if value in job_pb.JobState.values() else "not a JobState"


def _page_after(token: str) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        if isinstance(created, (int, float)) and isinstance(job_id, str) and len(job_id) <= 64:
            return float(created), job_id
    except (ValueError, TypeError, UnicodeError):
        pass
    raise errors.InvalidArgument(f"page_token {quoted(token, 80)} is not one ListJobs returned; pass "
                                 "next_page_token as it came, or leave it empty for the first page")
