"""What a worker returned for a shard, checked against the program before any strategy combines
it: a wrong answer fails that attempt (ShardFailed), so the shard is retried elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from accelmesh.programs import Program
from accelmesh.runtime.tensors import Placed
from dispatch_svc.dataplane.device_queues import ShardFailed


def check_shard_outputs(program: Program, outputs: Sequence[Any], shard_index: int, device_id: str,
                        rows: int) -> None:
    """What a worker returned for one shard of `rows` rows matches `program`'s outputs: their
    number, each one's dtype, and its shape (axis 0 is `rows` where the output is batched).

    A rogue or broken worker must not reach the combined result: a mismatch raises ShardFailed,
    so the attempt fails like a worker error and the shard is retried on another device."""
    where = f"shard {shard_index} on {device_id}"
    wanted = program.outputs
    if len(outputs) != len(wanted):
        names = ", ".join(f"'{o.name}'" for o in wanted)
        raise ShardFailed(f"{where} returned {len(outputs)} output{'' if len(outputs) == 1 else 's'}; "
                          f"{program.ref} returns {len(wanted)} ({names})")
    for value, spec in zip(outputs, wanted):
        got = value if isinstance(value, Placed) else np.asarray(value)
        if str(got.dtype) != spec.dtype:
            raise ShardFailed(f"{where} returned output '{spec.name}' of dtype {got.dtype}; "
                              f"{program.ref} declares {spec.dtype}")
        expected = (rows, *spec.shape[1:]) if spec.batched else tuple(spec.shape)
        if got.shape != expected:
            why = f"the shard has {rows} rows, so expected" if spec.batched else f"{program.ref} declares"
            raise ShardFailed(f"{where} returned output '{spec.name}' of shape {got.shape}; {why} {expected}")
