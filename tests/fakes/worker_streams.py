"""For fake workers in tests: an ExecuteMany request stream read one shard at a time, as the real
worker reads it (a header, then `input_count` inputs, each a held reference or a tensor header
and chunks up to its total_bytes), so a fake answers each shard before the next one is sent."""

from __future__ import annotations

from collections.abc import Iterator

from accelmesh.worker.v1 import worker_service_pb2 as pb


def shards(requests: Iterator[pb.ExecuteManyRequest]) -> Iterator[tuple[pb.ShardHeader, list[pb.ExecuteManyRequest]]]:
    """(header, the shard's input messages) for each shard of the stream."""
    for first in requests:
        header, inputs = first.header, []
        for _ in range(header.input_count):
            message = next(requests)
            inputs.append(message)
            left = message.tensor.total_bytes if message.WhichOneof("part") == "tensor" else 0
            while left > 0:
                chunk = next(requests)
                inputs.append(chunk)
                left -= len(chunk.chunk.data)
        yield header, inputs
