"""The `Workers` port over gRPC (ports.py): a job's shards on one ExecuteMany stream per device
(shard_streams.py), the inputs a worker holds sent once (held_keys.py), and a job's end told to
the workers that hold its tensors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from accelmesh import errors
from accelmesh.runtime.batches import batched
from accelmesh.runtime.channels import ChannelPool, explain_refusal
from accelmesh.runtime.programs import FORMAT_TO_PROTO
from accelmesh.runtime.tensors import PlaceTensor, serialized_or, split_frames
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from dispatch_svc.dataplane.descriptors import ArtifactRef, Build, JobDevice, ShardCall, ShardOutput, StoredRefs
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.held_keys import HeldKeys, Transfer
from dispatch_svc.dataplane.shard_streams import NotHeld, Shard, ShardStream, StreamClosed, Unanswered

SHARD_TIMEOUT_S = 600.0
# A shard left unread on a stream that another shard's inputs ended is sent again on a fresh one
# this many times at most (each such end is that other shard's fault, answered to it).
UNANSWERED_RESENDS = 3
RELEASE_TIMEOUT_S = 5.0  # a worker's ReleaseJob at a job's end: held tensors, best effort
_WORKER_SERVICE = worker_pb.DESCRIPTOR.services_by_name["WorkerService"]
EXECUTE_MANY_METHOD = f"/{_WORKER_SERVICE.full_name}/ExecuteMany"  # the path gRPC calls

log = logging.getLogger(__name__)


class GrpcWorkers:
    def __init__(self, security: Security, *, tracer_provider=None, max_message_bytes: int, chunk_bytes: int):
        self._chunk_bytes, self._security = chunk_bytes, security
        # A worker answers only with a certificate issued for its host (channels.PER_NODE_ROLES).
        self._channels = ChannelPool(security, Role.WORKER, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)
        self.held = HeldKeys()  # which keyed tensors each worker holds for each job
        self._streams: dict[tuple[str, str], ShardStream] = {}  # (job, device) -> its open ExecuteMany
        self._streams_lock = threading.Lock()
        # (job, device) -> why: devices the job lost while it ran (drop_device). A shard on one
        # fails with that cause, whatever its cancelled stream answered, and none is sent there again.
        self._lost: dict[tuple[str, str], str] = {}
        # Workers that answered with batches, so read them (ShardHeader.accept_batches): their
        # shards' parts go batched too. Dropped with the worker's channel (_forget_worker).
        self._batching: set[str] = set()

    def close(self) -> None:
        self._channels.close()

    def release(self, job_id: str) -> None:
        """The job's shards are over: its streams are closed or closing, and the workers holding
        its tensors are told to drop them."""
        with self._streams_lock:
            for key in [key for key in self._streams if key[0] == job_id]:
                del self._streams[key]
            for key in [key for key in self._lost if key[0] == job_id]:
                del self._lost[key]
        holders = self.held.workers_of(job_id)
        self.held.forget_job(job_id)  # no call refers to its tensors again
        for address in sorted(holders):
            self._release_held(address, job_id)

    def drop_device(self, job_id: str, device_id: str, cause: str) -> None:
        """The device is lost to the job: its stream is cancelled now, not when the transport
        notices (a cut link answers nothing), so the shards on it fail with `cause` and are retried
        elsewhere."""
        with self._streams_lock:
            self._lost[(job_id, device_id)] = cause
            stream = self._streams.pop((job_id, device_id), None)
        if stream is not None:
            stream.cancel()

    def _lost_cause(self, job_id: str, device_id: str) -> str | None:
        with self._streams_lock:
            return self._lost.get((job_id, device_id))

    def _release_held(self, address: str, job_id: str) -> None:
        """The worker drops the job's tensors now (else at its idle expiry, ACCELMESH_WORKER_HELD_IDLE_S):
        best effort, a worker that does not answer lets them go on its own."""
        try:
            self._worker(address).ReleaseJob(worker_pb.ReleaseJobRequest(job_id=job_id), timeout=RELEASE_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("worker %s did not release the tensors of job %s (%s: %s); its idle expiry will",
                        address, job_id, exc.code().name, self._refusal(address, exc.details()))

    def release_objects(self, address: str, ticket: bytes, object_ids: Sequence[str] = ()) -> None:
        try:
            self._worker(address).ReleaseObjects(worker_pb.ReleaseObjectsRequest(
                ticket=ticket, object_ids=list(object_ids)), timeout=RELEASE_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("worker %s did not release a job's objects (%s: %s); its store's idle expiry will",
                        address, exc.code().name, self._refusal(address, exc.details()))

    def _worker(self, address: str) -> worker_service_pb2_grpc.WorkerServiceStub:
        return worker_service_pb2_grpc.WorkerServiceStub(self._channels.get(address))

    def _execute_many(self, address: str):
        """The worker's ExecuteMany, taking chunks already serialized as well as messages."""
        return self._channels.get(address).stream_stream(
            EXECUTE_MANY_METHOD, request_serializer=serialized_or(worker_pb.ExecuteManyRequest.SerializeToString),
            response_deserializer=worker_pb.ExecuteManyResponse.FromString)

    def _forget_worker(self, address: str) -> None:
        """The next call dials afresh (ChannelPool.forget). A worker back on the address holds no
        tensors: its keys go too."""
        self._channels.forget(address)
        self.held.forget_worker(address)
        self._batching.discard(address)

    def _unavailable(self, address: str, details: str) -> str:
        """A worker that did not answer is dialled afresh next time; its details, explained."""
        self._forget_worker(address)
        return self._refusal(address, details)

    def _refusal(self, address: str, details: str) -> str:
        return explain_refusal(address, details, security=self._security, role=Role.WORKER)

    def execute(self, job_id: str, shard_index: int, attempt: int, device: JobDevice, build: Build,
                artifact: ArtifactRef, arrays: Sequence[tuple[str, np.ndarray]], rows: int,
                scope: CancelScope, held_keys: Mapping[str, str] | None = None,
                place_outputs: PlaceTensor | None = None, stored: StoredRefs | None = None) -> ShardOutput:
        """Run one shard on its device's worker. `held_keys` maps names in `arrays` to keys unique per
        content within the job: such an input goes to each worker in full once, then as a reference
        to the copy the worker keeps (dispatch_svc.dataplane.held_keys); a worker that lost one gets all in full.
        `place_outputs` says where outputs go as their chunks arrive (the others are returned).
        `stored`: inputs in the worker's object store, and outputs kept there (returned as `Placed`)."""
        return self._execute_one(ShardCall(job_id, shard_index, attempt, device, build, artifact, arrays, rows,
                                           held_keys, place_outputs, stored), scope)

    def execute_group(self, calls: Sequence[ShardCall], scope: CancelScope) -> Iterator[ShardOutput | ShardFailed]:
        """Shards of one job for one device, sent together: as one message to a worker that reads
        batches, which answers them in one (worker_svc ExecuteMany), so a group of small shards
        costs a message each way, not one a shard. Each answers for itself, in order, as its answer
        comes: its outputs, or the ShardFailed of its attempt. A shard that sends keyed inputs in
        full closes its group (those after it refer to them once they arrived); a shard whose
        worker did not hold what it referred to, or that another shard's inputs left unread, goes
        again alone."""
        index = 0
        while index < len(calls):
            group: list[tuple[ShardCall, worker_pb.ShardHeader, dict[str, str], Transfer | None]] = []
            cancelled = False
            while index < len(calls) and not cancelled:
                call = calls[index]
                keys = _keys(call)
                transfer = self.held.plan(call.device.node_address, call.job_id, keys.values(),
                                          scope.cancelled.is_set) if keys else None
                cancelled = bool(keys) and transfer is None
                if not cancelled:
                    group.append((call, self._header(call), keys, transfer))
                    index += 1
                    if transfer is not None and transfer.keep and transfer.full:
                        break
            for (call, *_), outcome in zip(group, self._together(group, scope)) if group else ():
                if isinstance(outcome, (NotHeld, Unanswered)):
                    if isinstance(outcome, NotHeld):
                        self.held.missed(call.device.node_address, call.job_id)
                    try:  # alone, sent in full if need be (execute's own resends)
                        outcome = self._execute_one(call, scope)
                    except ShardFailed as exc:
                        outcome = exc.with_traceback(None)
                yield outcome
            if cancelled:  # the job stopped while a shard waited for its parameters: the rest with it
                for _ in range(index, len(calls)):
                    yield ShardFailed(CANCELLED_WAITING)
                return

    def _execute_one(self, call: ShardCall, scope: CancelScope) -> ShardOutput:
        header, keys = self._header(call), _keys(call)
        for left in range(UNANSWERED_RESENDS, -1, -1):
            try:
                return self._execute_keyed(header, call, keys, scope)
            except Unanswered as exc:
                # Another shard's inputs ended the stream before this one was read: not this
                # shard's fault, nor the device's, so it goes again on a fresh stream.
                if not left:
                    raise ShardFailed(exc.cause, exc.code) from None
        raise AssertionError("unreachable: the last try returns or raises")

    @staticmethod
    def _header(call: ShardCall) -> worker_pb.ShardHeader:
        artifact, build = call.artifact, call.build
        header = worker_pb.ShardHeader(
            job_id=call.job_id, shard_index=call.shard_index, attempt=call.attempt, device_id=call.device.id,
            target_type=build.target_type, artifact_key=artifact.key, artifact_digest=artifact.digest,
            artifact_format=FORMAT_TO_PROTO[artifact.format], rule=build.rule, input_count=len(call.arrays),
            batch_size=call.rows, traceparent=_traceparent(call.span), accept_batches=True)
        if call.stored is not None:
            header.object_scope, header.output_prefix = call.stored.scope, call.stored.output_prefix
            header.stored_inputs.extend(worker_pb.StoredInput(name=n, object_id=i) for n, i in call.stored.inputs)
        return header

    def _execute_keyed(self, header: worker_pb.ShardHeader, call: ShardCall, keys: Mapping[str, str],
                       scope: CancelScope) -> ShardOutput:
        """One try of `execute`: keyed inputs as the held keys say, all in full once more if the
        worker did not hold one."""
        address = call.device.node_address
        if not keys:
            return self._execute_call(address, header, call, {}, None, scope)
        for resend in (False, True):
            transfer = self.held.plan(address, call.job_id, keys.values(), scope.cancelled.is_set, resend=resend)
            if transfer is None:
                raise ShardFailed(CANCELLED_WAITING)
            try:
                return self._execute_call(address, header, call, keys, transfer, scope)
            except NotHeld as exc:
                if resend:  # nothing was referred to this time: the worker broke the contract
                    raise ShardFailed(exc.cause) from None
                self.held.missed(address, call.job_id)
        raise AssertionError("unreachable: the resend returns or raises")

    def _execute_call(self, address: str, header: worker_pb.ShardHeader, call: ShardCall, keys: Mapping[str, str],
                      transfer: Transfer | None, scope: CancelScope) -> ShardOutput:
        """One shard on the job's stream to the worker (shard_streams.py); keyed inputs travel as
        `transfer` says, the others in full."""
        (outcome,) = self._together([(call, header, keys, transfer)], scope)  # run to its end: settled
        if isinstance(outcome, Exception):
            try:
                raise outcome
            finally:
                del outcome  # no cycle through this frame's traceback
        return outcome

    def _together(self, group: Sequence[tuple], scope: CancelScope) -> Iterator:
        """The shards of `group` ((call, header, keys, transfer) each) written to their stream
        together; each one's ShardOutput, or its ShardFailed (NotHeld, Unanswered among them), in
        order as its answer comes."""
        first = group[0][0]
        address = first.device.node_address
        written = [self._written(header, call, keys, transfer) for call, header, keys, transfer in group]
        join = ((lambda messages: batched(messages, worker_pb.ExecuteManyRequest, self._chunk_bytes))
                if address in self._batching else None)
        try:
            try:
                stream, waiting = self._send(address, first.job_id, first.device.id, written, join, scope)
            except ShardFailed as exc:  # the device was lost before they were written
                failed = exc.with_traceback(None)
                for _ in group:
                    yield failed
                return
            del written
            for shard, header in zip(waiting, (header for _, header, _, _ in group)):
                try:
                    outcome = self._answer(stream, shard, address, header, scope)
                except (ShardFailed, NotHeld) as exc:  # without its frames, which hold the shards' inputs
                    outcome = exc.with_traceback(None)
                yield outcome
        finally:
            for _, _, _, transfer in group:
                if transfer is not None:
                    self.held.abandoned(transfer)

    def _written(self, header: worker_pb.ShardHeader, call: ShardCall, keys: Mapping[str, str],
                 transfer: Transfer | None) -> Shard:
        """The shard as its stream takes it: its messages (keyed inputs by reference where the
        worker holds them), and what its answer is read with."""
        refs = {name: key for name, key in keys.items() if key in transfer.refs} if transfer else {}
        keep = [worker_pb.TensorRef(name=name, key=key) for name, key in keys.items()
                if transfer and transfer.keep and key in transfer.full]
        if keep:
            base, header = header, worker_pb.ShardHeader()
            header.CopyFrom(base)
            header.keep_tensors.extend(keep)
        if transfer is not None:
            self.held.count(transfer, sum(value.nbytes for name, value in call.arrays
                                          if name in keys and name not in refs))

        def parts():
            yield worker_pb.ExecuteManyRequest(header=header)
            for name, value in call.arrays:
                if name in refs:
                    yield worker_pb.ExecuteManyRequest(held=worker_pb.TensorRef(name=name, key=refs[name]))
                    continue
                tensor, chunks = split_frames(name, value, self._chunk_bytes, worker_pb.ExecuteManyRequest)
                yield worker_pb.ExecuteManyRequest(tensor=tensor)
                yield from chunks
        return parts(), transfer, bool(refs), call.place_outputs, bool(header.output_prefix)

    def _answer(self, stream: ShardStream, waiting, address: str, header: worker_pb.ShardHeader,
                scope: CancelScope) -> ShardOutput:
        """The shard's outputs once its answer came; raises its failure."""
        if not waiting.done.wait(SHARD_TIMEOUT_S):
            stream.cancel()  # fails every shard on it, this one too
            waiting.done.wait()
            if not scope.cancelled.is_set():
                raise ShardFailed(f"DEADLINE_EXCEEDED: worker {address} did not answer the shard within "
                                  f"{SHARD_TIMEOUT_S:.0f} s", "DEADLINE_EXCEEDED")
        failure = waiting.error
        lost = self._lost_cause(header.job_id, header.device_id) if failure is not None else None
        if lost is not None:
            raise ShardFailed(lost, "UNAVAILABLE") from None
        # Raised afresh, not as made by the reader: raised here, its traceback holds this frame,
        # which holds `waiting`, which holds it: a cycle that would keep the inputs until a full
        # garbage collection.
        if isinstance(failure, NotHeld):
            raise NotHeld(failure.cause) from None
        if isinstance(failure, Unanswered):
            raise Unanswered(failure.cause, failure.code) from None
        if failure is not None:
            raise ShardFailed(failure.cause, failure.code) from None
        try:
            results = list(waiting.outputs.results().values())  # a tensor cut short fails this attempt, not the job
        except errors.InvalidArgument as exc:
            raise ShardFailed(f"worker sent a malformed result: {exc}") from None
        timings = waiting.timings
        return ShardOutput(results, timings.queue_seconds, timings.load_seconds,
                           timings.execute_seconds, timings.load_kind)

    def _send(self, address: str, job_id: str, device_id: str, shards: Sequence[Shard], join, scope: CancelScope):
        """Write shards to the job's open stream for the device (at its worker, `address`), opening
        one if it has none (or the one it had closed). One a device, not a worker: the worker runs a
        stream's shards one after another, and the devices of a node run at the same time."""
        with self._streams_lock:
            lost = self._lost.get((job_id, device_id))
            if lost is not None:
                raise ShardFailed(lost, "UNAVAILABLE")
            stream = self._streams.get((job_id, device_id))
            if stream is not None:
                try:
                    return stream, stream.send(shards, join)
                except StreamClosed:
                    pass
            stream = ShardStream(self._execute_many(address), scope, self.held,
                                 lambda details: self._unavailable(address, details),
                                 shards, join, on_batches=lambda: self._batching.add(address))
            self._streams[(job_id, device_id)] = stream
            return stream, stream.first


CANCELLED_WAITING = "CANCELLED: the job was cancelled while the shard waited for its parameters to reach the worker"


def _keys(call: ShardCall) -> dict[str, str]:
    """The call's keyed inputs: name -> key."""
    held = call.held_keys
    return {name: held[name] for name, _ in call.arrays if held and held.get(name)}


_PROPAGATOR = TraceContextTextMapPropagator()


def _traceparent(span=None) -> str:
    """The span's (None: the current span's) place in its trace (W3C), for the worker's span of
    the shard; "" untraced."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=None if span is None else trace.set_span_in_context(span))
    return carrier.get("traceparent", "")
