"""WorkerService adapter: it authorises, calls NodeAgent or ShardExecutor and maps errors; the
protos are translated by translate.py."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from importlib import metadata
from queue import SimpleQueue

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from accelmesh import errors
from accelmesh.runtime import attributes as attr
from accelmesh.runtime.batches import batched, unbatched
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES
from accelmesh.security.access import Authenticator
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from worker_svc import executor as ex
from worker_svc import translate as tr
from worker_svc.agent import NodeAgent
from worker_svc.held_tensors import MAX_KEY_CHARS, HeldTensors
from worker_svc.inputs import Kept, read_header, read_inputs
from worker_svc.ledger import CallInputs, InputLedger
from worker_svc.object_methods import ObjectMethods

try:
    VERSION = metadata.version("accelmesh")
except metadata.PackageNotFoundError:
    VERSION = "unknown"

_PROPAGATOR = TraceContextTextMapPropagator()  # ShardHeader.traceparent


def _ignore(stage: str) -> None:
    pass


def _run_apart(run: Callable[[], ex.ShardResult], outcome: Future, stages: SimpleQueue) -> None:
    """The executor thread: `run`'s result or exception into `outcome`, then the end of `stages`.

    The exception's traceback holds this frame; as concurrent.futures does, the frame lets go of
    `outcome` (and of `run`, which holds the inputs) so that no cycle runs through the Future."""
    try:
        outcome.set_result(run())
    except BaseException as exc:  # noqa: BLE001 - handed to the handler thread
        outcome.set_exception(exc)
    finally:
        del run, outcome
        stages.put(None)


class WorkerServicer(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self, agent: NodeAgent, executor: ex.ShardExecutor, held: HeldTensors, auth: Authenticator, *,
                 max_input_bytes: int, max_inputs: int, max_message_bytes: int, objects: ObjectMethods,
                 tracer: trace.Tracer | None = None):
        self.agent = agent
        self._tracer = tracer or trace.NoOpTracer()
        self._auth = auth
        self.executor = executor
        self.held = held  # tensors kept for jobs between calls
        self.inputs = InputLedger()  # what calls in flight hold
        self._max_input_bytes = max_input_bytes
        self._max_inputs = max_inputs
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)  # room for the message framing
        self.objects = objects  # the object store's methods (object_methods.py)

    def DescribeNode(self, request, context):
        # The inventory polls every few seconds: an idle worker lets go of ended jobs' tensors here.
        self.held.expire()
        self.objects.store.expire()
        return tr.node_to_proto(self.agent.describe(list(request.device_ids)), VERSION)

    def ReleaseJob(self, request, context):
        """The caller's job ended: its held tensors go now, not at the idle expiry. Held tensors are
        scoped to the dispatcher that kept them, so a caller releases only its own."""
        if not request.job_id or len(request.job_id) > MAX_KEY_CHARS:
            raise errors.InvalidArgument(f"job_id {errors.quoted(request.job_id)} must be 1..{MAX_KEY_CHARS} "
                                         "characters: the job whose tensors to release", field="job_id")
        count, nbytes = self.held.release(f"{self._auth.principal(context).key}|{request.job_id}")
        return pb.ReleaseJobResponse(released_tensors=count, released_bytes=nbytes)

    def PutObjects(self, request_iterator, context):
        return self.objects.put(request_iterator)

    def FetchObjects(self, request, context):
        yield from self.objects.fetch(request)

    def MapObjects(self, request, context):
        return self.objects.map(request, context.peer())

    def SealObjects(self, request, context):
        return self.objects.seal(request)

    def ReleaseObjects(self, request, context):
        return self.objects.release(request)

    def Execute(self, request_iterator, context):
        call = self.inputs.open()
        try:
            yield from self._execute(request_iterator, context, call)
        except BaseException as exc:
            # The error goes on to the interceptors and gRPC, which keep it a while; the frames of
            # its traceback let go of their locals (what arrived) now. A log needs no locals.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            call.close()

    def _execute(self, request_iterator, context, call: CallInputs):
        # Nothing here may keep the inputs alive after the call ends (a cancel, an error): no frame
        # that holds them may end up in a cycle with an exception, or they wait for a full garbage
        # collection (gigabytes, for a worker that is called often).
        started = time.perf_counter()
        try:
            head = read_header(request_iterator)
            shard, inputs, kept = self._receive(head, request_iterator, context, call)
            shard, inputs = self._with_stored(head, shard, inputs)
        except grpc.RpcError as exc:  # the request stream broke: the caller cancelled or timed out
            # gRPC keeps this error in the call's state, and its traceback holds gRPC's frames (which
            # hold that state) and read_inputs' (which hold what arrived): a cycle that only a full
            # garbage collection would free. The traceback tells nothing here.
            exc.__traceback__ = None
            if context.is_active():
                raise
            return
        if not head.report_stages:
            # Nothing to stream while it runs: run right here, without a thread and a queue.
            try:
                with self._undone_on_failure(kept):
                    result = self.executor.run(shard, inputs, receive_seconds=time.perf_counter() - started,
                                               on_stage=_ignore, cancelled=lambda: not context.is_active())
            except ex.ShardCancelled:
                return
            del inputs  # not kept while the caller reads the outputs
            yield from self._results(result)
            return
        # The executor runs on its own thread so its stages reach the caller as they happen; the
        # device lock is held there, never across a yield to a caller that might not read.
        stages: SimpleQueue[str | None] = SimpleQueue()
        outcome: Future[ex.ShardResult] = Future()
        run = functools.partial(self.executor.run, shard, inputs, receive_seconds=time.perf_counter() - started,
                                on_stage=stages.put, cancelled=lambda: not context.is_active())
        del inputs
        # The executor thread carries this call's context: the artifact fetch joins the job's trace.
        thread = threading.Thread(target=contextvars.copy_context().run, args=(_run_apart, run, outcome, stages),
                                  name=f"shard-{shard.device_id}", daemon=True)
        del run
        thread.start()
        try:
            with self._undone_on_failure(kept):
                while (stage := stages.get()) is not None:
                    yield pb.ExecuteResponse(stage=tr.STAGES[stage])
                result = outcome.result()
        except ex.ShardCancelled:
            return
        finally:
            # Also when gRPC closes this generator at a yield (the caller went away): the call ends
            # once its shard's thread has (it stops at its next step), so nothing of the shard holds
            # the inputs after it, and no more shards run than the server has threads for.
            thread.join()
            del outcome  # an exception's traceback holds this frame: no cycle through the Future
        yield from self._results(result)

    def ExecuteMany(self, request_iterator, context):
        """Execute's shards one after another on one stream; a shard that fails to run is answered
        with its ShardFailure and the stream goes on (the proto says the rest). A request may batch
        parts (accelmesh.runtime.batches); a shard whose header accepts batches is answered so, and
        a small answer (outputs kept in the store, a failure) waits while the shards after it in the
        same batch run, so a caller that sent a batch of shards hears of them in one message."""
        reader = unbatched(request_iterator)
        held: list = []  # small answers waiting for the rest of their batch's shards

        def sent(parts: list) -> list:
            return list(batched(parts, pb.ExecuteManyResponse, self._chunk_bytes))
        try:
            for accepts, answer, small in self._answers(reader, context):
                if not accepts:
                    yield from held
                    yield from answer
                elif small and reader.buffered:
                    held.extend(answer)
                    continue
                else:
                    yield from batched(itertools.chain(held, answer), pb.ExecuteManyResponse, self._chunk_bytes)
                held = []
        except Exception:
            # Whatever ends the call (a shard's inputs that cannot be read) answers the shard after
            # these: they are answered first, so the caller takes that status for the right shard.
            answered, held = sent(held), []
            yield from answered
            raise
        yield from sent(held)

    def _answers(self, reader, context):
        """(header.accept_batches, the shard's answer parts, whether they are few and small) for
        each shard on the stream."""
        owner = self._auth.principal(context).key  # one caller a call: its certificate parsed once
        while True:
            call = self.inputs.open()
            try:
                try:
                    first = next(reader, None)
                    if first is None:
                        return  # the caller has no more shards
                    started = time.perf_counter()  # from its header on: not the wait for it
                    if first.WhichOneof("part") != "header":
                        raise errors.InvalidArgument(
                            f"each shard of ExecuteMany begins with a ShardHeader; got a "
                            f"{first.WhichOneof('part') or 'empty message'} where the next shard's header belongs")
                    # The shard's own span, in the trace of the dispatcher's span for it (one call
                    # carries shards of many positions in the trace); current while it is received and
                    # run, never across a yield.
                    span = self._tracer.start_span("worker.shard", context=_PROPAGATOR.extract(
                        {"traceparent": first.header.traceparent}) if first.header.traceparent else None)
                    with trace.use_span(span, end_on_exit=True):
                        shard, inputs, kept = self._receive(first.header, reader, context, call, more=True, owner=owner)
                        span.set_attribute(attr.SHARD_INDEX, shard.shard_index)
                        try:
                            with self._undone_on_failure(kept):
                                shard, inputs = self._with_stored(first.header, shard, inputs)
                                result = self.executor.run(shard, inputs,
                                                           receive_seconds=time.perf_counter() - started,
                                                           on_stage=_ignore, cancelled=lambda: not context.is_active())
                        except ex.ShardCancelled:
                            return
                        except Exception as exc:  # noqa: BLE001 - this shard's answer; the stream goes on
                            traceback.clear_frames(exc.__traceback__)
                            result = tr.failure_to_proto(exc)
                            span.set_status(trace.Status(trace.StatusCode.ERROR, result.message))
                        del inputs  # not kept while the caller reads the outputs
                except grpc.RpcError as exc:  # the request stream broke: as in _execute
                    exc.__traceback__ = None
                    if context.is_active():
                        raise
                    return
                accepts, stored = first.header.accept_batches, bool(first.header.output_prefix)
                if isinstance(result, pb.ShardFailure):
                    yield accepts, [pb.ExecuteManyResponse(failure=result)], True
                    continue
                try:
                    answer = self._results(result, pb.ExecuteManyResponse, first.header)
                except errors.AccelmeshError as exc:  # no room in the store, say: this shard's answer
                    yield accepts, [pb.ExecuteManyResponse(failure=tr.failure_to_proto(exc))], True
                    continue
                yield accepts, (list(answer) if stored else answer), stored
            except BaseException as exc:
                traceback.clear_frames(exc.__traceback__)  # as Execute: no frame keeps what arrived
                raise
            finally:
                call.close()

    def _receive(self, head: pb.ShardHeader, request_iterator, context, call: CallInputs,
                 more: bool = False, owner: str | None = None) -> tuple[ex.Shard, list, Kept]:
        """The shard the header names, admitted here, its inputs and what of them it held anew.
        `owner`: the caller's principal key, if known already (a stream's shards share it)."""
        shard = tr.shard_from_proto(head)
        span = trace.get_current_span()
        span.set_attribute(attr.JOB_ID, shard.job_id)
        span.set_attribute(attr.DEVICE_ID, shard.device_id)
        self.executor.admit(shard)  # refuse before megabytes of inputs arrive
        inputs, kept = read_inputs(request_iterator, head, self.held, self._max_input_bytes,
                                   owner or self._auth.principal(context).key, max_inputs=self._max_inputs,
                                   received=call.received, more=more)
        return shard, inputs, kept

    def _with_stored(self, head: pb.ShardHeader, shard: ex.Shard, inputs: list) -> tuple[ex.Shard, list]:
        """The shard and its inputs with those that lie in the object store appended. Looked up
        once the call's inputs were read, so on ExecuteMany one missing (NOT_FOUND) is that
        shard's ShardFailure, and the stream goes on."""
        if not head.stored_inputs:
            return shard, inputs
        inputs.extend(self._stored(head))
        return dataclasses.replace(shard, input_count=len(inputs)), inputs

    def _stored(self, head: pb.ShardHeader) -> list:
        """The shard's inputs that lie in the object store, as views of it (no copy)."""
        if not head.object_scope:
            raise errors.InvalidArgument("header.object_scope is required with stored_inputs", field="object_scope")
        if len(head.stored_inputs) > self._max_inputs:
            raise errors.ResourceExhausted(
                f"header.stored_inputs lists {len(head.stored_inputs)} objects, more than the {self._max_inputs} "
                "inputs a shard may have (ACCELMESH_WORKER_MAX_INPUTS)")
        return [self.objects.store.get(head.object_scope, ref.object_id).array() for ref in head.stored_inputs]

    @contextlib.contextmanager
    def _undone_on_failure(self, kept: Kept):
        """A shard that does not run to its outputs (refused, failed, cancelled) keeps nothing it
        asked to keep: a failed call leaves the job's held tensors as it found them."""
        try:
            yield
        except BaseException:
            kept.undo(self.held)
            raise

    def _results(self, result: ex.ShardResult, into: type = pb.ExecuteResponse, head: pb.ShardHeader | None = None):
        """The shard's answer: its outputs' chunks, or with header.output_prefix their headers alone,
        the outputs kept in the object store."""
        if head is None or not head.output_prefix:
            return tr.results_to_proto(result, into, self._chunk_bytes)
        if not head.object_scope:
            raise errors.InvalidArgument("header.object_scope is required with output_prefix", field="object_scope")
        stored = [self.objects.store.put_array(head.object_scope, f"{head.output_prefix}{index}", array)
                  for index, array in enumerate(result.outputs)]
        return tr.stored_results_to_proto(stored, result.timings, into)
