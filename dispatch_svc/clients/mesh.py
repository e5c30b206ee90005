"""The runner's `Mesh` port over gRPC: inventory, compile service and workers, protos <-> domain."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import grpc
import numpy as np
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.programs import Program
from accelmesh.runtime.batches import batched
from accelmesh.runtime.channels import ChannelPool
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from accelmesh.runtime.errors import error_from_rpc
from accelmesh.runtime.programs import FORMAT_FROM_PROTO, FORMAT_TO_PROTO, program_from_proto
from accelmesh.runtime.devices import PLATFORM_TO_PROTO, device_from_proto, device_to_proto
from accelmesh.runtime.tensors import PlaceTensor, TensorCollector, serialized_or, split_frames
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from dispatch_svc.jobs import records as m
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.held_keys import HeldKeys, Transfer
from dispatch_svc.dataplane.shard_streams import NotHeld, ShardStream, StreamClosed, Unanswered
from dispatch_svc.ports import ArtifactRef, Build, JobDevice, RuleChoice, ScoredStatus, Scoring, ShardOutput

CALL_TIMEOUT_S = 120.0
# A call to replicas that every replica failed (gRPC retried it already) is asked again up to this
# many times in all, 0.5 s, 1 s, then 1.5 s later: longer than a replica back up takes to be
# dialled again (runtime/channels.py caps that backoff at a second).
REPLICA_ATTEMPTS, REPLICA_RETRY_S = 4, 0.5
SHARD_TIMEOUT_S = 600.0
# A shard left unread on a stream that another shard's inputs ended is sent again on a fresh one
# this many times at most (each such end is that other shard's fault, answered to it).
UNANSWERED_RESENDS = 3
RELEASE_TIMEOUT_S = 5.0  # a worker's ReleaseJob at a job's end: held tensors, best effort
_WORKER_SERVICE = worker_pb.DESCRIPTOR.services_by_name["WorkerService"]
EXECUTE_MANY_METHOD = f"/{_WORKER_SERVICE.full_name}/ExecuteMany"  # the path gRPC calls

log = logging.getLogger(__name__)


def _artifact(msg: build_pb.Artifact) -> ArtifactRef:
    return ArtifactRef(msg.key, msg.digest, FORMAT_FROM_PROTO[msg.format], msg.batch_size)


def _builds(response: compile_pb.CompileResponse) -> list[Build]:
    return [Build(b.target_type, b.rule.name, b.rule.build.compute_dtype, b.rule, tuple(b.device_ids),
                  _artifact(b.portable), {e.batch_size: _artifact(e) for e in b.executables})
            for b in response.builds]


# A job's precision (records.PRECISIONS) as the compile service's Precision.
PRECISION_TO_PROTO = {"": common_pb2.PRECISION_UNSPECIFIED, "fp32": common_pb2.PRECISION_FP32,
                      "bf16": common_pb2.PRECISION_BF16_ALLOWED, "fp16": common_pb2.PRECISION_FP16_ALLOWED}


def _constraints_filter(c: m.Constraints) -> str:
    terms = [f"capabilities:{cap}" for cap in c.capabilities]
    if c.filter:
        terms.append(c.filter)
    return " AND ".join(terms)


class GrpcMesh:
    def __init__(self, inventory_address: str, compile_address: str, security: Security, *, tracer_provider=None,
                 max_message_bytes: int, chunk_bytes: int):
        self._chunk_bytes = chunk_bytes
        self.inventory_address, self.compile_address = inventory_address, compile_address
        # Pools even for one address each: a renewed certificate is picked up on the next call.
        pool = functools.partial(ChannelPool, security, tracer_provider=tracer_provider,
                                 max_message_bytes=max_message_bytes)
        self._inventory_channels, self._compile_channels = pool(Role.INVENTORY), pool(Role.COMPILE)
        self._workers = pool(Role.WORKER)
        self._rules: dict[str, build_pb.Rule] = {}
        self.held = HeldKeys()  # which keyed tensors each worker holds for each job
        self._streams: dict[tuple[str, str], ShardStream] = {}  # (job, device) -> its open ExecuteMany
        self._streams_lock = threading.Lock()
        # Workers that answered with batches, so read them (ShardHeader.accept_batches): their
        # shards' parts go batched too. Dropped with the worker's channel (_forget_worker).
        self._batching: set[str] = set()

    @property
    def inventory(self) -> inventory_service_pb2_grpc.InventoryServiceStub:
        return inventory_service_pb2_grpc.InventoryServiceStub(self._inventory_channels.get(self.inventory_address))

    @property
    def compiler(self) -> compile_service_pb2_grpc.CompileServiceStub:
        return compile_service_pb2_grpc.CompileServiceStub(self._compile_channels.get(self.compile_address))

    def close(self) -> None:
        for pool in (self._inventory_channels, self._compile_channels, self._workers):
            pool.close()

    def _call(self, what: str, method, request, *, replicated: bool = False):
        """`replicated`: an idempotent call to a service that may run as replicas. gRPC retries it
        on another replica at once (runtime/channels.py); while the channel still counts every
        replica as failing (one was just killed while another is being dialled again after a
        restart), it is asked again here, over a few seconds."""
        for attempt in range(1, REPLICA_ATTEMPTS + 1):
            try:
                return method(request, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                if not (replicated and exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < REPLICA_ATTEMPTS):
                    raise error_from_rpc(exc, what) from None
                time.sleep(REPLICA_RETRY_S * attempt)
        raise AssertionError("unreachable")

    # -- inventory -----------------------------------------------------------------------------

    def candidate_devices(self, constraints: m.Constraints) -> list[JobDevice]:
        devices = self._list_devices(_constraints_filter(constraints))
        platforms = {PLATFORM_TO_PROTO[p] for p in constraints.platforms}
        chosen = [d for d in devices if not platforms or d.platform in platforms]
        if constraints.max_devices:
            chosen = chosen[: constraints.max_devices]
        return [self._device(d) for d in chosen]

    def _list_devices(self, filter_text: str) -> list[common_pb2.Device]:
        """Every device the filter matches, page by page."""
        devices, token = [], ""
        while True:
            page = self._call("inventory", self.inventory.ListDevices, inv_pb.ListDevicesRequest(
                filter=filter_text, page_size=1000, page_token=token))
            devices.extend(page.devices)
            token = page.next_page_token
            if not token:
                return devices

    def _device(self, msg: common_pb2.Device) -> JobDevice:
        spec, _ = device_from_proto(msg, f"device {msg.id}")
        return JobDevice(spec, msg.node_address)

    def refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]:
        try:
            return self._refresh(devices)
        except errors.Unavailable:
            # One silent node fails the whole refresh. Until the inventory calls it lost (a few
            # missed polls later) the job runs on the nodes that did answer: they were polled just
            # now, so their missed-poll count is back to zero. The silent one is not polled again.
            nodes = self._call("inventory", self.inventory.ListNodes, inv_pb.ListNodesRequest()).nodes
            answered = {n.address for n in nodes if n.state == inv_pb.NODE_STATE_ACTIVE and n.missed_polls == 0}
            survivors = [d for d in devices if d.node_address in answered]
            if not survivors or len(survivors) == len(devices):
                raise
            return self._refresh(survivors)

    def _refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]:
        response = self._call("inventory refresh", self.inventory.RefreshDevices,
                              inv_pb.RefreshDevicesRequest(device_ids=[d.id for d in devices]))
        return [self._device(d) for d in response.devices if d.health == common_pb2.DEVICE_HEALTH_HEALTHY]

    def score_devices(self, kind: str, precision: str, intensity: float,
                      weights: tuple[float, float, float] | None, constraints: m.Constraints,
                      device_ids: Sequence[str] = ()) -> Scoring:
        task = inv_pb.TaskProfile(
            kind=inv_pb.TASK_KIND_TRAINING if kind == m.TRAINING else inv_pb.TASK_KIND_INFERENCE,
            precision=precision, arithmetic_intensity=intensity)
        if weights is not None:
            task.weights.CopyFrom(inv_pb.TaskWeights(compute=weights[0], memory=weights[1], bandwidth=weights[2]))
        response = self._call("inventory score", self.inventory.ScoreDevices, inv_pb.ScoreDevicesRequest(
            task=task, filter=_constraints_filter(constraints), device_ids=list(device_ids)))
        w = response.weights
        return Scoring(
            devices={s.device.id: ScoredStatus(s.score, s.free_compute_tflops, s.device.status.memory_free_bytes,
                                               s.device.status.utilization, s.device.status.reserved_compute_fraction)
                     for s in response.devices},
            weights=(w.compute, w.memory, w.bandwidth), rule=response.weights_rule)

    def reserve(self, job_id: str, claims: Sequence[tuple[str, int]], ttl_s: int) -> None:
        self._call("inventory reserve", self.inventory.ReserveDevices, inv_pb.ReserveDevicesRequest(
            job_id=job_id, ttl_seconds=ttl_s,
            claims=[inv_pb.DeviceClaim(device_id=d, memory_bytes=b, compute_fraction=1.0) for d, b in claims]))

    def renew(self, job_id: str, device_ids: Sequence[str], ttl_s: int, timeout_s: float) -> None:
        try:
            self.inventory.RenewReservations(inv_pb.RenewReservationsRequest(
                job_id=job_id, ttl_seconds=ttl_s, device_ids=list(device_ids)), timeout=min(timeout_s, CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # retrying cannot help: say what would
                raise errors.FailedPrecondition(
                    f"the inventory at {self.inventory_address} cannot renew reservations (no RenewReservations): "
                    "upgrade the inventory before the dispatcher") from None
            raise error_from_rpc(exc, "inventory renew") from None

    def all_devices(self) -> list:
        """Every device the inventory knows, lost ones too, as its Device messages (the status page)."""
        return self._list_devices("") + self._list_devices('health = "lost"')

    def pool_state(self) -> tuple:
        reservations = self._call("inventory", self.inventory.ListReservations, inv_pb.ListReservationsRequest())
        return (tuple((r.job_id, r.device_id, r.memory_bytes) for r in reservations.reservations),
                tuple(sorted((d.id, d.health) for d in self._list_devices(""))))

    def reserved_device_ids(self) -> frozenset[str]:
        """The devices any reservation holds now (the queue's scheduling rounds count the others free)."""
        reservations = self._call("inventory", self.inventory.ListReservations, inv_pb.ListReservationsRequest())
        return frozenset(r.device_id for r in reservations.reservations)

    def release(self, job_id: str) -> None:
        with self._streams_lock:  # the job's shards are over: its streams are closed or closing
            for key in [key for key in self._streams if key[0] == job_id]:
                del self._streams[key]
        holders = self.held.workers_of(job_id)
        self.held.forget_job(job_id)  # the job's shards are over: no call refers to its tensors again
        try:
            self._call("inventory release", self.inventory.ReleaseDevices, inv_pb.ReleaseDevicesRequest(job_id=job_id))
        finally:
            for address in sorted(holders):
                self._release_held(address, job_id)

    def _release_held(self, address: str, job_id: str) -> None:
        """The worker drops the job's tensors now (else at its idle expiry, ACCELMESH_WORKER_HELD_IDLE_S):
        best effort, a worker that does not answer lets them go on its own."""
        try:
            self._worker(address).ReleaseJob(worker_pb.ReleaseJobRequest(job_id=job_id), timeout=RELEASE_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("worker %s did not release the tensors of job %s (%s: %s); its idle expiry will",
                        address, job_id, exc.code().name, exc.details())

    # -- compile -------------------------------------------------------------------------------

    def explain_rule(self, device: JobDevice, precision: str = "") -> RuleChoice:
        response = self._call("compile service rules", self.compiler.ExplainRule, compile_pb.ExplainRuleRequest(
            device=device_to_proto(device.spec), precision=PRECISION_TO_PROTO[precision]), replicated=True)
        return RuleChoice(response.target_type, response.rule.name, response.rule.build.compute_dtype)

    def describe_program(self, name: str, version: str) -> Program:
        if not name:
            raise errors.InvalidArgument("spec.program is required; ListPrograms on the compile service shows them")
        response = self._call("compile service", self.compiler.DescribeProgram,
                              compile_pb.DescribeProgramRequest(name=name, version=version), replicated=True)
        return program_from_proto(response.program)

    def compile(self, program: Program, devices: Sequence[JobDevice], batch_sizes: Sequence[int],
                precision: str = "") -> list[Build]:
        return _builds(self._compile(program, devices, batch_sizes, precision))

    def compile_stage(self, program: Program, devices: Sequence[JobDevice], first: int, count: int,
                      batch_sizes: Sequence[int] = (), backward: bool = False,
                      precision: str = "") -> tuple[Program, list[Build]]:
        """Build layers first .. first + count - 1 of a layered model as one pipeline stage (its
        backward pass with `backward`); the stage program says what its artifacts take (its
        parameter leaves, then the activation, and for the backward pass the cotangent)."""
        response = self._compile(program, devices, batch_sizes, precision,
                                 compile_pb.LayerRange(first=first, count=count, backward=backward))
        if not response.HasField("stage"):
            raise errors.FailedPrecondition(f"the compile service at {self.compile_address} built {program.ref} whole, "
                                            "not the stage asked for; upgrade it to one that supports layers")
        return program_from_proto(response.stage), _builds(response)

    def _compile(self, program: Program, devices: Sequence[JobDevice], batch_sizes: Sequence[int], precision: str,
                 layers: compile_pb.LayerRange | None = None) -> compile_pb.CompileResponse:
        return self._call("compile service", self.compiler.Compile, compile_pb.CompileRequest(
            program=program.name, version=program.version, batch_sizes=list(batch_sizes),
            targets=[device_to_proto(d.spec) for d in devices], layers=layers,
            precision=PRECISION_TO_PROTO[precision]), replicated=True)

    def fetch_parameters(self, program: Program, seed: int) -> list[np.ndarray]:
        try:
            leaves = TensorCollector("parameter").collect(self.compiler.FetchParameters(
                compile_pb.FetchParametersRequest(program=program.name, version=program.version, seed=seed),
                timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "compile service parameters") from None
        return list(leaves.values())

    # -- workers -------------------------------------------------------------------------------

    def _worker(self, address: str) -> worker_service_pb2_grpc.WorkerServiceStub:
        return worker_service_pb2_grpc.WorkerServiceStub(self._workers.get(address))

    def _execute_many(self, address: str):
        """The worker's ExecuteMany, taking chunks already serialized as well as messages."""
        return self._workers.get(address).stream_stream(
            EXECUTE_MANY_METHOD, request_serializer=serialized_or(worker_pb.ExecuteManyRequest.SerializeToString),
            response_deserializer=worker_pb.ExecuteManyResponse.FromString)

    def _forget_worker(self, address: str) -> None:
        """The next call dials afresh (ChannelPool.forget). A worker back on the address holds no
        tensors: its keys go too."""
        self._workers.forget(address)
        self.held.forget_worker(address)
        self._batching.discard(address)

    def execute(self, job_id: str, shard_index: int, attempt: int, device: JobDevice, build: Build,
                artifact: ArtifactRef, arrays: Sequence[tuple[str, np.ndarray]], rows: int,
                scope: CancelScope, held_keys: Mapping[str, str] | None = None,
                place_outputs: PlaceTensor | None = None) -> ShardOutput:
        """Run one shard on its device's worker. `held_keys` maps names in `arrays` to keys unique per
        content within the job: such an input goes to each worker in full once, then as a reference
        to the copy the worker keeps (dispatch_svc.dataplane.held_keys); a worker that lost one gets all in full.
        `place_outputs` says where outputs go as their chunks arrive (the others are returned)."""
        header = worker_pb.ShardHeader(
            job_id=job_id, shard_index=shard_index, attempt=attempt, device_id=device.id,
            target_type=build.target_type, artifact_key=artifact.key, artifact_digest=artifact.digest,
            artifact_format=FORMAT_TO_PROTO[artifact.format], rule=build.rule,
            input_count=len(arrays), batch_size=rows, traceparent=_traceparent(), accept_batches=True)
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
                                         (requests, transfer, bool(refs), place), scope)
            if not waiting.done.wait(SHARD_TIMEOUT_S):
                stream.cancel()  # fails every shard on it, this one too
                waiting.done.wait()
                if not scope.cancelled.is_set():
                    raise ShardFailed(f"DEADLINE_EXCEEDED: worker {address} did not answer the shard within "
                                      f"{SHARD_TIMEOUT_S:.0f} s", "DEADLINE_EXCEEDED")
            failure = waiting.error
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
            stream = self._streams.get((job_id, device_id))
            if stream is not None:
                try:
                    return stream, stream.send(*shard)
                except StreamClosed:
                    pass
            stream = ShardStream(self._execute_many(address), scope, self.held, lambda: self._forget_worker(address),
                                 shard, on_batches=lambda: self._batching.add(address))
            self._streams[(job_id, device_id)] = stream
            return stream, stream.first


_PROPAGATOR = TraceContextTextMapPropagator()


def _traceparent() -> str:
    """The current span's place in its trace (W3C), for the worker's span of the shard; "" untraced."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")
