"""worker_svc/inputs.py's read_inputs on an ExecuteMany stream, without a server: where one shard's
inputs end and the next shard's header begins."""

from __future__ import annotations

import numpy as np
import pytest

from accelmesh.runtime.tensors import split
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc.held_tensors import HeldTensors
from worker_svc.inputs import read_inputs

HOLDER = "dispatch:d1"


def _held_store() -> HeldTensors:
    held = HeldTensors(1 << 20, 60.0)
    held.hold(f"{HOLDER}|job-1", "params:w", np.arange(4, dtype=np.float32))
    return held


def _full(name: str, array: np.ndarray) -> list[pb.ExecuteManyRequest]:
    header, chunks = split(name, array, 1 << 20)
    return [pb.ExecuteManyRequest(tensor=header), *(pb.ExecuteManyRequest(chunk=c) for c in chunks)]


@pytest.mark.parametrize("last", ["held reference", "tensor in full"])
def test_a_shard_whose_last_input_is_a_reference_stops_before_the_next_shards_header(last):
    """A shard of stored inputs sends only its parameters, by reference: reading must stop at the
    last reference, not wait for a message that belongs to the next shard."""
    x = np.ones((2, 3), np.float32)
    parts = [pb.ExecuteManyRequest(held=pb.TensorRef(name="w", key="params:w"))]
    if last == "tensor in full":
        parts += _full("x", x)
    head = pb.ShardHeader(job_id="job-1", input_count=len([p for p in parts if p.WhichOneof("part") != "chunk"]))
    next_header = pb.ExecuteManyRequest(header=pb.ShardHeader(job_id="job-1", shard_index=1))
    stream = iter([*parts, next_header])
    arrays, _ = read_inputs(stream, head, _held_store(), 1 << 20, HOLDER, max_inputs=16, more=True)
    assert np.array_equal(arrays[0], np.arange(4, dtype=np.float32))
    assert len(arrays) == head.input_count
    assert next(stream) is next_header  # left for the next shard
