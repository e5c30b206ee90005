"""Reading an Execute request stream: the header, then each input in full (a TensorHeader and its
chunks) or as a reference to a tensor held for the job; the inputs the header asks to keep are
held before the shard is queued, so a later call may refer to them from SHARD_STAGE_QUEUED on."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from accelmesh import errors
from accelmesh.runtime.tensors import TensorAssembler
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc.held_tensors import HeldTensors



def read_header(requests: Iterator[pb.ExecuteRequest]) -> pb.ShardHeader:
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != "header":
        got = "nothing" if first is None else f"a {first.WhichOneof('part') or 'empty message'}"
        raise errors.InvalidArgument(f"the first message of Execute must be a ShardHeader, got {got}")
    return first.header


def check_keep(head: pb.ShardHeader) -> dict[str, str]:
    """header.keep_tensors as name -> key, refused before any input arrives if malformed."""
    keep: dict[str, str] = {}
    keys: set[str] = set()
    for index, ref in enumerate(head.keep_tensors):
        field = f"header.keep_tensors[{index}]"
        if not ref.name or not ref.key:
            raise errors.InvalidArgument(f"{field}: name and key are both required")
        if ref.name in keep or ref.key in keys:
            raise errors.InvalidArgument(f"{field}: name '{ref.name}' or key '{ref.key}' is listed twice; "
                                         "keep each input once, under one key")
        keep[ref.name] = ref.key
        keys.add(ref.key)
    if keep and not head.job_id:
        raise errors.InvalidArgument("header.job_id is required to keep tensors: they are held per job")
    return keep


def read_inputs(requests: Iterator[pb.ExecuteRequest], head: pb.ShardHeader, held: HeldTensors,
                max_bytes: int, holder: str) -> list[np.ndarray]:
    """Exactly `head.input_count` inputs, then the end of the stream; keeps what the header asks.

    Tensors are held for the job under `holder` (the calling dispatcher's identity) as well as the
    job id, so no other caller can use them, even one that names the job."""
    keep = check_keep(head)
    scope = f"{holder}|{head.job_id}"
    count = head.input_count
    inputs: list[TensorAssembler | np.ndarray] = []
    total = 0
    for message in requests:
        part = message.WhichOneof("part")
        if part in ("tensor", "held"):
            if inputs and isinstance(inputs[-1], TensorAssembler) and not inputs[-1].complete:
                inputs[-1].result()  # raises: says how much of it arrived
            if len(inputs) == count:
                raise errors.InvalidArgument(f"header.input_count is {count} but more tensors follow")
            if part == "held":
                inputs.append(_held(held, scope, message.held, len(inputs)))
                continue
            total += message.tensor.total_bytes
            if total > max_bytes:
                raise errors.ResourceExhausted(f"the shard's inputs exceed this worker's {max_bytes} byte limit "
                                               "(ACCELMESH_WORKER_MAX_INPUT_BYTES); send smaller shards")
            inputs.append(TensorAssembler(message.tensor, f"input {len(inputs)}"))
        elif part == "chunk" and inputs and isinstance(inputs[-1], TensorAssembler):
            inputs[-1].add(message.chunk)
        else:
            raise errors.InvalidArgument(f"unexpected {part or 'empty message'} in the inputs: send a TensorHeader, "
                                         "then its chunks, or a held reference, for each input")
    if len(inputs) != count:
        raise errors.InvalidArgument(f"the stream ended after {len(inputs)} of header.input_count={count} inputs")
    arrays = [i.result() if isinstance(i, TensorAssembler) else i for i in inputs]
    if keep:
        _keep(keep, scope, inputs, arrays, held)
    return arrays


def _held(held: HeldTensors, job_id: str, ref: pb.TensorRef, index: int) -> np.ndarray:
    if not ref.key:
        raise errors.InvalidArgument(f"input {index}: a held reference needs a key")
    array = held.get(job_id, ref.key)
    if array is None:
        raise errors.FailedPrecondition(
            f"input {index} ('{ref.name}'): tensor '{ref.key}' of job {job_id or '(none)'} is not held by this worker "
            "(never kept, evicted, expired or the worker restarted); send it in full",
            reason=errors.TENSOR_NOT_HELD, field=f"held[{ref.name}].key")
    return array


def _keep(keep: dict[str, str], job_id: str, inputs: list, arrays: list[np.ndarray], held: HeldTensors) -> None:
    sent = [i.name if isinstance(i, TensorAssembler) else None for i in inputs]  # names of the inputs sent in full
    chosen = {}
    for name, key in keep.items():
        matches = [index for index, n in enumerate(sent) if n == name]
        if len(matches) != 1:
            what = "sent in full twice" if matches else "not an input sent in full"
            raise errors.InvalidArgument(f"header.keep_tensors names '{name}', which is {what} in this call; "
                                         "name exactly one TensorHeader of the call")
        chosen[key] = arrays[matches[0]]
    for key, array in chosen.items():  # all checked first: a refused call keeps nothing
        held.keep(job_id, key, array)
