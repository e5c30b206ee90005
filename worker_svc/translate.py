"""Proto <-> domain translations of the worker's types: a shard's header, its outputs and
timings, a shard's failure, the node a DescribeNode reports; a device's spec and status, tensors
and build options are shared ones (accelmesh.runtime)."""

from __future__ import annotations

from collections.abc import Iterator

from accelmesh.common.v1 import common_pb2
from accelmesh.hardware.model import NodeDescription
from accelmesh.runtime.devices import device_to_proto
from accelmesh.runtime.errors import bounded, status_for
from accelmesh.runtime.programs import FORMAT_FROM_PROTO, build_options_from_proto
from accelmesh.runtime.tensors import dtype_code, split_frames
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc import executor as ex

STAGES = {ex.QUEUED: pb.SHARD_STAGE_QUEUED, ex.LOADING: pb.SHARD_STAGE_LOADING,
          ex.RUNNING: pb.SHARD_STAGE_RUNNING, ex.DONE: pb.SHARD_STAGE_DONE}


def shard_from_proto(h: pb.ShardHeader) -> ex.Shard:
    return ex.Shard(h.job_id, h.shard_index, h.attempt, h.device_id, h.target_type, h.artifact_key, h.artifact_digest,
                    FORMAT_FROM_PROTO.get(h.artifact_format, ""), build_options_from_proto(h.rule.build),
                    h.input_count, h.batch_size)


def node_to_proto(node: NodeDescription, software_version: str) -> pb.DescribeNodeResponse:
    samples = {s.device_id: s for s in node.samples}
    return pb.DescribeNodeResponse(
        node_ip=node.ip,
        hostname=node.hostname,
        devices=[device_to_proto(d, samples.get(d.id)) for d in node.devices],
        software_version=software_version,
    )


def timings_to_proto(t: ex.ShardTimings) -> pb.ShardTimings:
    return pb.ShardTimings(receive_seconds=t.receive_seconds, queue_seconds=t.queue_seconds,
                           load_seconds=t.load_seconds, execute_seconds=t.execute_seconds,
                           artifact_cached=t.artifact_cached, load_kind=t.load_kind)


def results_to_proto(result: ex.ShardResult, into: type, chunk_bytes: int) -> Iterator:
    """A shard's outputs as ``into`` messages (each tensor's header, then its chunks of at most
    ``chunk_bytes``), then its timings."""
    for index, array in enumerate(result.outputs):
        header, chunks = split_frames(f"output_{index}", array, chunk_bytes, into)
        yield into(tensor=header)
        yield from chunks
    yield into(timings=timings_to_proto(result.timings))


def stored_results_to_proto(stored, timings: ex.ShardTimings, into: type) -> Iterator:
    """A shard's outputs kept in the object store: each one's header (name = its object id, no
    chunks follow), then its timings."""
    for obj in stored:
        yield into(tensor=common_pb2.TensorHeader(name=obj.object_id, dtype=dtype_code(obj.dtype), shape=obj.shape,
                                                  total_bytes=obj.nbytes))
    yield into(timings=timings_to_proto(timings))


def failure_to_proto(exc: Exception) -> pb.ShardFailure:
    """A shard's failure as the stream answers it (a bug: INTERNAL with an incident id, logged)."""
    code, message = status_for(exc)
    return pb.ShardFailure(code=code.value[0], message=bounded(message), reason=getattr(exc, "reason", ""))
