"""Stream parts batched into one message and read back: the same parts in the same order, each
batch within its limit, a part too large to share a message sent as it came, nothing read ahead
of what is sent, and a batch inside a batch refused."""

from __future__ import annotations

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.runtime.batches import batched, unbatched
from accelmesh.runtime.tensors import split_frames
from accelmesh.worker.v1 import worker_service_pb2 as pb

KIB = 1024


def shard_parts(rows: int, chunk_bytes: int = 4 * KIB) -> list[pb.ExecuteManyRequest | bytes]:
    """A shard as the dispatcher sends it: header and tensor header as messages, chunks as frames."""
    x = np.arange(rows * 256, dtype=np.float32).reshape(rows, 256)
    tensor, chunks = split_frames("x", x, chunk_bytes, pb.ExecuteManyRequest)
    return [pb.ExecuteManyRequest(header=pb.ShardHeader(job_id="job", input_count=1, batch_size=rows)),
            pb.ExecuteManyRequest(held=pb.TensorRef(name="w", key="params:w")),
            pb.ExecuteManyRequest(tensor=tensor), *chunks]


def parsed(part: pb.ExecuteManyRequest | bytes) -> pb.ExecuteManyRequest:
    return part if isinstance(part, pb.ExecuteManyRequest) else pb.ExecuteManyRequest.FromString(part)


@pytest.mark.parametrize("limit", [64 * KIB, 10 * KIB, 1])
def test_batched_parts_read_back_as_the_same_parts_in_order_within_the_limit(limit):
    parts = shard_parts(rows=8)  # 8 KiB of data in two 4 KiB chunks
    sent = list(batched(parts, pb.ExecuteManyRequest, limit))
    received = [parsed(message) for message in sent]
    assert list(unbatched(received)) == [parsed(part) for part in parts]
    for message in sent:
        size = len(message) if isinstance(message, bytes) else message.ByteSize()
        # A batch stays within the limit; only a part too large for any batch goes over it, alone.
        assert size <= limit or parsed(message).WhichOneof("part") != "batch"
    if limit == 64 * KIB:
        assert len(sent) == 1 and received[0].WhichOneof("part") == "batch"
    if limit == 1:  # nothing fits beside anything: every part goes as it came, the very object
        assert len(sent) == len(parts) and all(s is p for s, p in zip(sent, parts))


def test_batched_reads_no_part_beyond_the_one_that_closes_the_batch_it_sends():
    """Lazy, so a shard's chunks are framed as the stream sends them, not all at once."""
    parts = shard_parts(rows=64)  # 64 KiB: sixteen 4 KiB chunks
    taken = []

    def source():
        for part in parts:
            taken.append(part)
            yield part

    stream = batched(source(), pb.ExecuteManyRequest, 10 * KIB)
    first = parsed(next(stream))
    assert len(taken) - len(first.batch.parts) == 1  # the one that did not fit, held for the next batch


def test_a_batch_inside_a_batch_is_refused_naming_where():
    inner = pb.ExecuteManyRequest.FromString(next(batched(shard_parts(rows=1), pb.ExecuteManyRequest, 64 * KIB)))
    outer = pb.ExecuteManyRequest(batch=pb.ExecuteManyRequestBatch(parts=[parsed(shard_parts(1)[0]), inner]))
    read = unbatched([outer])
    assert next(read).WhichOneof("part") == "header"
    with pytest.raises(errors.InvalidArgument, match=r"batch.parts\[1\] is a batch itself"):
        next(read)


def test_answers_batch_the_same_way():
    """The response stream's batch: what a worker sends a caller that accepts batches."""
    tensor, chunks = split_frames("output_0", np.ones((4, 10), np.float32), 4 * KIB, pb.ExecuteManyResponse)
    parts = [pb.ExecuteManyResponse(tensor=tensor), *chunks,
             pb.ExecuteManyResponse(timings=pb.ShardTimings(execute_seconds=0.5))]
    (sent,) = batched(parts, pb.ExecuteManyResponse, 64 * KIB)
    answer = pb.ExecuteManyResponse.FromString(sent)
    assert [p.WhichOneof("part") for p in unbatched([answer])] == ["tensor", "chunk", "timings"]
    assert list(unbatched([answer]))[1] == pb.ExecuteManyResponse.FromString(parts[1])


def test_the_reader_says_how_many_parts_of_the_batch_it_reads_are_already_here():
    parts = [parsed(part) for part in shard_parts(rows=1)]  # header, held reference, tensor header, one chunk
    batch = pb.ExecuteManyRequest.FromString(next(batched(parts, pb.ExecuteManyRequest, 64 * KIB)))
    read = unbatched([batch, parts[0]])
    assert [(next(read).WhichOneof("part"), read.buffered) for _ in range(5)] == [
        ("header", 3), ("held", 2), ("tensor", 1), ("chunk", 0), ("header", 0)]
