"""The `Workers` port over gRPC (ports.py): a job's shards on one ExecuteMany stream per device
(shard_streams.py), the inputs a worker holds sent once (held_keys.py), and a job's end told to
the workers that hold its tensors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import grpc
import numpy as np
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
from dispatch_svc.dataplane.descriptors import ArtifactRef, Build, JobDevice, ShardOutput, StoredRefs
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.held_keys import HeldKeys, Transfer
from dispatch_svc.dataplane.shard_streams import NotHeld, ShardStream, StreamClosed, Unanswered

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
        header = worker_pb.ShardHeader(
            job_id=job_id, shard_index=shard_index, attempt=attempt, device_id=device.id,
            target_type=build.target_type, artifact_key=artifact.key, artifact_digest=artifact.digest,
            artifact_format=FORMAT_TO_PROTO[artifact.format], rule=build.rule,
            input_count=len(arrays), batch_size=rows, traceparent=_traceparent(), accept_batches=True)
        if stored is not None:
            header.object_scope, header.output_prefix = stored.scope, stored.output_prefix
            header.stored_inputs.extend(worker_pb.StoredInput(name=n, object_id=i) for n, i in stored.inputs)
        address = device.node_address
        keys = {name: held_keys[name] for name, _ in arrays if held_keys and held_keys.get(name)}
        for left in range(UNANSWERED_RESENDS, -1, -1):
            try:
                return self._execute_keyed(address, job_id, header, arrays, keys, scope, place_outputs)
            except Unanswered as exc:
                # Another shard's inputs ended the stream before this one was read: not this
                # shard's fault, nor the device's, so it goes again on a fresh stream.
                if not left:
                    raise ShardFailed(exc.cause, exc.code) from None
        raise AssertionError("unreachable: the last try returns or raises")

    def _execute_keyed(self, address: str, job_id: str, header: worker_pb.ShardHeader,
                       arrays: Sequence[tuple[str, np.ndarray]], keys: Mapping[str, str],
                       scope: CancelScope, place: PlaceTensor | None) -> ShardOutput:
        """One try of `execute`: keyed inputs as the held keys say, all in full once more if the
        worker did not hold one."""
        if not keys:
            return self._execute_call(address, header, arrays, {}, None, scope, place)
        for resend in (False, True):
            transfer = self.held.plan(address, job_id, keys.values(), scope.cancelled.is_set, resend=resend)
            if transfer is None:
                raise ShardFailed("CANCELLED: the job was cancelled while the shard waited for its parameters "
                                  "to reach the worker")
            try:
                return self._execute_call(address, header, arrays, keys, transfer, scope, place)
            except NotHeld as exc:
                if resend:  # nothing was referred to this time: the worker broke the contract
                    raise ShardFailed(exc.cause) from None
                self.held.missed(address, job_id)
        raise AssertionError("unreachable: the resend returns or raises")

    def _execute_call(self, address: str, header: worker_pb.ShardHeader, arrays: Sequence[tuple[str, np.ndarray]],
                      keys: Mapping[str, str], transfer: Transfer | None, scope: CancelScope,
                      place: PlaceTensor | None) -> ShardOutput:
        """One shard on the job's stream to the worker (shard_streams.py); keyed inputs travel as
        `transfer` says, the others in full."""
        refs = {name: key for name, key in keys.items() if key in transfer.refs} if transfer else {}
        keep = [worker_pb.TensorRef(name=name, key=key) for name, key in keys.items()
                if transfer and transfer.keep and key in transfer.full]
        if keep:
            base, header = header, worker_pb.ShardHeader()
            header.CopyFrom(base)
            header.keep_tensors.extend(keep)
        if transfer is not None:
            self.held.count(transfer, sum(value.nbytes for name, value in arrays if name in keys and name not in refs))

        def parts():
            yield worker_pb.ExecuteManyRequest(header=header)
            for name, value in arrays:
                if name in refs:
                    yield worker_pb.ExecuteManyRequest(held=worker_pb.TensorRef(name=name, key=refs[name]))
                    continue
                tensor, chunks = split_frames(name, value, self._chunk_bytes, worker_pb.ExecuteManyRequest)
                yield worker_pb.ExecuteManyRequest(tensor=tensor)
                yield from chunks

        requests = (batched(parts(), worker_pb.ExecuteManyRequest, self._chunk_bytes) if address in self._batching
                    else parts())
        try:
            stream, waiting = self._send(address, header.job_id, header.device_id,
                                         (requests, transfer, bool(refs), place, bool(header.output_prefix)),
                                         scope)
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
        finally:
            if transfer is not None:
                self.held.abandoned(transfer)
        timings = waiting.timings
        return ShardOutput(results, timings.queue_seconds, timings.load_seconds,
                           timings.execute_seconds, timings.load_kind)

    def _send(self, address: str, job_id: str, device_id: str, shard: tuple, scope: CancelScope):
        """Write a shard to the job's open stream for the device (at its worker, `address`), opening
        one if it has none (or the one it had closed). One a device, not a worker: the worker runs a
        stream's shards one after another, and the devices of a node run at the same time."""
        with self._streams_lock:
            lost = self._lost.get((job_id, device_id))
            if lost is not None:
                raise ShardFailed(lost, "UNAVAILABLE")
            stream = self._streams.get((job_id, device_id))
            if stream is not None:
                try:
                    return stream, stream.send(*shard)
                except StreamClosed:
                    pass
            stream = ShardStream(self._execute_many(address), scope, self.held,
                                 lambda details: self._unavailable(address, details),
                                 shard, on_batches=lambda: self._batching.add(address))
            self._streams[(job_id, device_id)] = stream
            return stream, stream.first


_PROPAGATOR = TraceContextTextMapPropagator()


def _traceparent() -> str:
    """The current span's place in its trace (W3C), for the worker's span of the shard; "" untraced."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")
