"""WorkerService adapter: proto in, NodeAgent or ShardExecutor call, proto out."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from importlib import metadata
from queue import SimpleQueue

import grpc
import numpy as np
from opentelemetry import trace

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.runtime import attributes as attr
from accelmesh.runtime.devices import device_to_proto
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES, TensorAssembler, split
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from accelmesh.programs import BuildOptions
from dispatch_svc.worker import executor as ex
from dispatch_svc.worker.agent import NodeAgent

try:
    VERSION = metadata.version("accelmesh")
except metadata.PackageNotFoundError:
    VERSION = "unknown"

FORMATS = {compile_pb.ARTIFACT_FORMAT_STABLEHLO: "stablehlo", compile_pb.ARTIFACT_FORMAT_EXECUTABLE: "executable"}
STAGES = {ex.QUEUED: pb.SHARD_STAGE_QUEUED, ex.LOADING: pb.SHARD_STAGE_LOADING,
          ex.RUNNING: pb.SHARD_STAGE_RUNNING, ex.DONE: pb.SHARD_STAGE_DONE}


def build_options_from_proto(msg: compile_pb.BuildOptions) -> BuildOptions:
    default = BuildOptions()
    return BuildOptions(compute_dtype=msg.compute_dtype or default.compute_dtype,
                        matmul_precision=msg.matmul_precision or default.matmul_precision, remat=msg.remat,
                        xla_options=dict(msg.xla_options), tolerance=msg.tolerance or default.tolerance)


def shard_from_proto(h: pb.ShardHeader) -> ex.Shard:
    return ex.Shard(h.job_id, h.shard_index, h.attempt, h.device_id, h.target_type, h.artifact_key, h.artifact_digest,
                    FORMATS.get(h.artifact_format, ""), build_options_from_proto(h.rule.build), h.compile_address,
                    h.input_count, h.batch_size)


def read_header(requests: Iterator[pb.ExecuteRequest]) -> pb.ShardHeader:
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != "header":
        got = "nothing" if first is None else f"a {first.WhichOneof('part') or 'empty message'}"
        raise errors.InvalidArgument(f"the first message of Execute must be a ShardHeader, got {got}")
    return first.header


def read_inputs(requests: Iterator[pb.ExecuteRequest], count: int, max_bytes: int) -> list[np.ndarray]:
    """Exactly `count` tensors, each a TensorHeader and its chunks, then the end of the stream."""
    tensors: list[TensorAssembler] = []
    total = 0
    for message in requests:
        part = message.WhichOneof("part")
        if part == "tensor":
            if tensors and not tensors[-1].complete:
                tensors[-1].result()  # raises: says how much of it arrived
            if len(tensors) == count:
                raise errors.InvalidArgument(f"header.input_count is {count} but more tensors follow")
            total += message.tensor.total_bytes
            if total > max_bytes:
                raise errors.ResourceExhausted(f"the shard's inputs exceed this worker's {max_bytes} byte limit "
                                               "(ACCELMESH_WORKER_MAX_INPUT_BYTES); send smaller shards")
            tensors.append(TensorAssembler(message.tensor, f"input {len(tensors)}"))
        elif part == "chunk" and tensors:
            tensors[-1].add(message.chunk)
        else:
            raise errors.InvalidArgument(f"unexpected {part or 'empty message'} in the inputs: send a TensorHeader, "
                                         "then its chunks, for each input")
    if len(tensors) != count:
        raise errors.InvalidArgument(f"the stream ended after {len(tensors)} of header.input_count={count} inputs")
    return [t.result() for t in tensors]


def timings_to_proto(t: ex.ShardTimings) -> pb.ShardTimings:
    return pb.ShardTimings(receive_seconds=t.receive_seconds, queue_seconds=t.queue_seconds,
                           load_seconds=t.load_seconds, execute_seconds=t.execute_seconds,
                           artifact_cached=t.artifact_cached, load_kind=t.load_kind)


class WorkerServicer(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self, agent: NodeAgent, executor: ex.ShardExecutor, *,
                 max_input_bytes: int, max_message_bytes: int):
        self.agent = agent
        self.executor = executor
        self._max_input_bytes = max_input_bytes
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)  # room for the message framing

    def DescribeNode(self, request, context):
        node = self.agent.describe(list(request.device_ids))
        samples = {s.device_id: s for s in node.samples}
        return pb.DescribeNodeResponse(
            node_ip=node.ip,
            hostname=node.hostname,
            devices=[device_to_proto(d, samples.get(d.id)) for d in node.devices],
            software_version=VERSION,
        )

    def Execute(self, request_iterator, context):
        started = time.perf_counter()
        try:
            head = read_header(request_iterator)
            shard = shard_from_proto(head)
            span = trace.get_current_span()
            span.set_attribute(attr.JOB_ID, shard.job_id)
            span.set_attribute(attr.DEVICE_ID, shard.device_id)
            self.executor.admit(shard)  # refuse before megabytes of inputs arrive
            inputs = read_inputs(request_iterator, shard.input_count, self._max_input_bytes)
        except grpc.RpcError:  # the request stream broke: the caller cancelled or timed out
            if context.is_active():
                raise
            return
        if not head.report_stages:
            # Nothing to stream while it runs: run right here, without a thread and a queue.
            try:
                result = self.executor.run(shard, inputs, receive_seconds=time.perf_counter() - started,
                                           on_stage=lambda stage: None, cancelled=lambda: not context.is_active())
            except ex.ShardCancelled:
                return
            yield from self._results(result)
            return
        # The executor runs on its own thread so its stages reach the caller as they happen; the
        # device lock is held there, never across a yield to a caller that might not read.
        stages: SimpleQueue[str | None] = SimpleQueue()
        outcome: Future[ex.ShardResult] = Future()

        def run() -> None:
            try:
                outcome.set_result(self.executor.run(
                    shard, inputs, receive_seconds=time.perf_counter() - started, on_stage=stages.put,
                    cancelled=lambda: not context.is_active()))
            except BaseException as exc:  # noqa: BLE001 - handed to the handler thread below
                outcome.set_exception(exc)
            finally:
                stages.put(None)

        # The executor thread carries this call's context: the artifact fetch joins the job's trace.
        threading.Thread(target=contextvars.copy_context().run, args=(run,), name=f"shard-{shard.device_id}",
                         daemon=True).start()
        while (stage := stages.get()) is not None:
            yield pb.ExecuteResponse(stage=STAGES[stage])
        try:
            result = outcome.result()
        except ex.ShardCancelled:
            return
        yield from self._results(result)

    def _results(self, result: ex.ShardResult):
        for index, array in enumerate(result.outputs):
            header, chunks = split(f"output_{index}", array, self._chunk_bytes)
            yield pb.ExecuteResponse(tensor=header)
            for chunk in chunks:
                yield pb.ExecuteResponse(chunk=chunk)
        yield pb.ExecuteResponse(timings=timings_to_proto(result.timings))
