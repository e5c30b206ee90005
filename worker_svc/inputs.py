"""Reading an Execute request stream: the header, then each input in full (a TensorHeader and its
chunks) or as a reference to a tensor held for the job; the inputs the header asks to keep are
held before the shard is queued, so a later call may refer to them from SHARD_STAGE_QUEUED on.

What a call holds grows with the bytes that arrived, never with what its headers declare
(TensorAssembler); `received` hears each chunk, for the servicer's InputLedger."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from accelmesh import errors
from accelmesh.runtime.tensors import TensorAssembler
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc.held_tensors import KEPT, MAX_KEY_CHARS, OTHER, HeldTensors


def _ignore(nbytes: int) -> None:
    pass


def read_header(requests: Iterator[pb.ExecuteRequest]) -> pb.ShardHeader:
    first = next(requests, None)
    if first is None or first.WhichOneof("part") != "header":
        got = "nothing" if first is None else f"a {first.WhichOneof('part') or 'empty message'}"
        raise errors.InvalidArgument(f"the first message of Execute must be a ShardHeader, got {got}")
    return first.header


def check_keep(head: pb.ShardHeader, max_tensors: int) -> dict[str, str]:
    """header.keep_tensors as name -> key, refused before any input arrives if malformed or more
    than the worker may hold at all (`max_tensors`, ACCELMESH_WORKER_HELD_TENSORS)."""
    if len(head.keep_tensors) > max_tensors:
        raise errors.ResourceExhausted(
            f"header.keep_tensors lists {len(head.keep_tensors)} tensors but this worker holds at most {max_tensors} "
            "(ACCELMESH_WORKER_HELD_TENSORS); raise that limit on the worker or keep fewer tensors per call")
    keep: dict[str, str] = {}
    keys: set[str] = set()
    for index, ref in enumerate(head.keep_tensors):
        field = f"header.keep_tensors[{index}]"
        if not ref.name or not ref.key:
            raise errors.InvalidArgument(f"{field}: name and key are both required")
        if len(ref.key) > MAX_KEY_CHARS:
            raise errors.InvalidArgument(f"{field}.key {errors.quoted(ref.key)} is longer than {MAX_KEY_CHARS} "
                                         "characters; use a shorter key")
        if ref.name in keep or ref.key in keys:
            raise errors.InvalidArgument(f"{field}: name {errors.quoted(ref.name)} or key {errors.quoted(ref.key)} "
                                         "is listed twice; keep each input once, under one key")
        keep[ref.name] = ref.key
        keys.add(ref.key)
    if keep and not head.job_id:
        raise errors.InvalidArgument("header.job_id is required to keep tensors: they are held per job")
    if keep and len(head.job_id) > MAX_KEY_CHARS:
        raise errors.InvalidArgument(f"header.job_id {errors.quoted(head.job_id)} is longer than {MAX_KEY_CHARS} "
                                     "characters, the most a job that keeps tensors may have; use a shorter id")
    return keep


def read_inputs(requests: Iterator[pb.ExecuteRequest | pb.ExecuteManyRequest], head: pb.ShardHeader, held: HeldTensors,
                max_bytes: int, holder: str, *, max_inputs: int,
                received: Callable[[int], None] = _ignore, more: bool = False) -> tuple[list[np.ndarray], Kept]:
    """Exactly `head.input_count` inputs, then the end of the stream; keeps what the header asks,
    and says what it kept anew, which the caller forgets if the call then fails (Kept.undo).
    `more` (ExecuteMany): the stream goes on with the next shard, so reading stops as soon as the
    last input is whole. `received` hears the size of each chunk as it arrives (CallInputs.received).

    Tensors are held for the job under `holder` (the calling dispatcher's identity) as well as the
    job id, so no other caller can use them, even one that names the job."""
    count = head.input_count
    if count > max_inputs:
        # Each input costs memory whatever its size (empty tensors too), so their number is bounded.
        raise errors.ResourceExhausted(f"header.input_count is {count} but this worker takes at most {max_inputs} "
                                       "inputs per shard (ACCELMESH_WORKER_MAX_INPUTS); raise that limit on the "
                                       "worker or send fewer, larger inputs")
    keep = check_keep(head, held.max_tensors)
    scope = f"{holder}|{head.job_id}"
    inputs: list[TensorAssembler | np.ndarray] = []
    total = 0
    for message in requests if count or not more else ():
        part = message.WhichOneof("part")
        if part in ("tensor", "held"):
            if inputs and isinstance(inputs[-1], TensorAssembler) and not inputs[-1].complete:
                inputs[-1].result()  # raises: says how much of it arrived
            if len(inputs) == count:
                raise errors.InvalidArgument(f"header.input_count is {count} but more tensors follow")
            if part == "held":
                inputs.append(_held(held, scope, head.job_id, message.held, len(inputs)))
                if more and len(inputs) == count:
                    break  # the last input was a reference: the next message is the next shard's
                continue
            total += message.tensor.total_bytes
            if total > max_bytes:
                raise errors.ResourceExhausted(f"the shard's inputs exceed this worker's {max_bytes} byte limit "
                                               "(ACCELMESH_WORKER_MAX_INPUT_BYTES); send smaller shards")
            inputs.append(TensorAssembler(message.tensor, f"input {len(inputs)}"))
        elif part == "chunk" and inputs and isinstance(inputs[-1], TensorAssembler):
            inputs[-1].add(message.chunk)
            received(len(message.chunk.data))
        else:
            raise errors.InvalidArgument(f"unexpected {part or 'empty message'} in the inputs: send a TensorHeader, "
                                         "then its chunks, or a held reference, for each input")
        if more and len(inputs) == count and (not isinstance(inputs[-1], TensorAssembler) or inputs[-1].complete):
            break
    if len(inputs) != count:
        raise errors.InvalidArgument(f"the stream ended after {len(inputs)} of header.input_count={count} inputs")
    arrays = [i.result() if isinstance(i, TensorAssembler) else i for i in inputs]
    return arrays, (_keep(keep, scope, head.job_id, inputs, arrays, held) if keep else Kept(scope, ()))


def _held(held: HeldTensors, scope: str, job_id: str, ref: pb.TensorRef, index: int) -> np.ndarray:
    if not ref.key:
        raise errors.InvalidArgument(f"input {index}: a held reference needs a key")
    array = held.get(scope, ref.key)
    if array is None:
        raise errors.FailedPrecondition(
            f"input {index} ({errors.quoted(ref.name)}): tensor {errors.quoted(ref.key)} of job "
            f"{errors.quoted(job_id) if job_id else '(none)'} is not held by this worker (never kept, dropped for "
            "ACCELMESH_WORKER_HELD_BYTES or ACCELMESH_WORKER_HELD_TENSORS, idle past ACCELMESH_WORKER_HELD_IDLE_S, "
            "or the worker restarted); send it in full",
            reason=errors.TENSOR_NOT_HELD, field=f"held[{ref.name}].key")
    return array


@dataclass(frozen=True)
class Kept:
    """The tensors one call held anew (not those already held with the same content)."""

    scope: str
    entries: tuple[tuple[str, np.ndarray], ...]  # (key, the array held)

    def undo(self, held: HeldTensors) -> None:
        """The call failed: what it held goes, so the store is as the call found it."""
        for key, array in self.entries:
            held.forget(self.scope, key, array)


def _keep(keep: dict[str, str], scope: str, job_id: str, inputs: list, arrays: list[np.ndarray],
          held: HeldTensors) -> Kept:
    sent = [i.name if isinstance(i, TensorAssembler) else None for i in inputs]  # names of the inputs sent in full
    chosen = {}
    for name, key in keep.items():
        matches = [index for index, n in enumerate(sent) if n == name]
        if len(matches) != 1:
            what = "sent in full twice" if matches else "not an input sent in full"
            raise errors.InvalidArgument(f"header.keep_tensors names '{name}', which is {what} in this call; "
                                         "name exactly one TensorHeader of the call")
        chosen[key] = arrays[matches[0]]
    kept = Kept(scope, ())
    for key, array in chosen.items():  # all checked first: a refused call keeps nothing
        outcome = held.hold(scope, key, array)
        if outcome == OTHER:
            kept.undo(held)
            raise errors.FailedPrecondition(
                f"header.keep_tensors: tensor {errors.quoted(key)} of job {errors.quoted(job_id)} is held with other "
                "content; a key's content never changes within a job: keep new content under a new key",
                field="header.keep_tensors")
        if outcome == KEPT:
            kept = Kept(scope, (*kept.entries, (key, array)))
    return kept
