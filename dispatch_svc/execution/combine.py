"""Folding per-shard "sum" and "mean" outputs into a job's outputs (requirements A7), in shard order.

Rules (OutputSpec.combine): "sum" adds the shards' values; "mean" is the mean weighted by shard
rows, so per-shard mean gradients give the full-batch mean gradient ("concat" outputs are written
in place by dispatch_svc.execution.outputs). Float addition is not associative, so sums fold strictly in
shard order: whatever order shards finish in, the result is bit-identical to folding them in
order. A shard that arrives early waits in a buffer until the shards before it are in: memory is
one output in the common in-order case and grows only with the shards finished ahead of a gap.

Sums of bfloat16 / float16 outputs accumulate in float32 and are cast back once at the end, so
the rounding of a low-precision dtype happens once instead of once per shard. Integer sums use
64-bit accumulators and wrap when cast back to a narrower declared dtype, as the device would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from accelmesh.errors import FailedPrecondition, InvalidArgument

_FLOAT_ACCUMULATORS = {"bfloat16": np.float32, "float16": np.float32, "float32": np.float32, "float64": np.float64}
_INT_ACCUMULATORS = {"int8": np.int64, "int16": np.int64, "int32": np.int64, "int64": np.int64,
                     "uint8": np.uint64, "uint32": np.uint64}


class _ShardSlots:
    """Which of a plan's shards have arrived: rejects unknown and duplicate indices."""

    def __init__(self, shard_rows: Sequence[int]):
        if not shard_rows or any(rows < 1 for rows in shard_rows):
            raise InvalidArgument(f"shard_rows must list every shard's rows, each >= 1; got {list(shard_rows)}")
        self.shard_rows = tuple(int(rows) for rows in shard_rows)
        self.next_index = 0  # every shard before it has been folded in or released
        self.pending: dict[int, object] = {}

    def check(self, shard_index: int) -> int:
        """The shard's rows, once the index is known to be new and in range."""
        if not 0 <= shard_index < len(self.shard_rows):
            raise InvalidArgument(f"shard index {shard_index} is outside 0..{len(self.shard_rows) - 1}")
        if shard_index < self.next_index or shard_index in self.pending:
            raise FailedPrecondition(f"shard {shard_index} was already added; add each shard's result once")
        return self.shard_rows[shard_index]

    def ready(self) -> Iterator[tuple[int, object]]:
        """Yield (index, value) for each shard that is next in order, advancing past it."""
        while self.next_index in self.pending:
            index = self.next_index
            self.next_index += 1
            yield index, self.pending.pop(index)

    @property
    def done(self) -> bool:
        return self.next_index == len(self.shard_rows)


class Accumulator:
    """Folds one "sum" or "mean" output in, in shard order, in O(output size) when shards arrive in order."""

    def __init__(self, rule: str, shard_rows: Sequence[int]):
        if rule not in ("sum", "mean"):
            raise InvalidArgument(f"an Accumulator folds 'sum' or 'mean' outputs, not {rule!r}; "
                                  "'concat' outputs are written in place (dispatch_svc.execution.outputs)")
        self.rule = rule
        self._slots = _ShardSlots(shard_rows)
        self._total: np.ndarray | None = None
        self._like: np.ndarray | None = None  # the first shard to arrive fixes shape and dtype

    def add(self, shard_index: int, value: np.ndarray) -> None:
        self._slots.check(shard_index)
        array = np.asarray(value)
        if self._like is None:
            _accumulator_dtype(self.rule, array.dtype)
            self._like = array
        elif array.shape != self._like.shape or array.dtype != self._like.dtype:
            raise InvalidArgument(f"shard {shard_index} {self.rule} output is {array.dtype}{list(array.shape)} but "
                                  f"an earlier shard's is {self._like.dtype}{list(self._like.shape)}")
        self._slots.pending[shard_index] = array
        for index, ready in self._slots.ready():
            self._fold(index, ready)

    def _fold(self, index: int, array: np.ndarray) -> None:
        term = array.astype(_accumulator_dtype(self.rule, array.dtype))
        if self.rule == "mean":
            term *= self._slots.shard_rows[index]
        if self._total is None:
            self._total = term
        else:
            self._total += term

    @property
    def done(self) -> bool:
        return self._slots.done

    def result(self) -> np.ndarray:
        if not self.done:
            missing = [i for i in range(len(self._slots.shard_rows))
                       if i >= self._slots.next_index and i not in self._slots.pending]
            raise FailedPrecondition(f"the {self.rule} is not final: shards {missing} have not been added")
        total = self._total
        if self.rule == "mean":
            total = total / sum(self._slots.shard_rows)
        return np.asarray(total).astype(self._like.dtype)


def _accumulator_dtype(rule: str, dtype: np.dtype) -> type:
    name = np.dtype(dtype).name
    if name in _FLOAT_ACCUMULATORS:
        return _FLOAT_ACCUMULATORS[name]
    if rule == "sum" and name in _INT_ACCUMULATORS:
        return _INT_ACCUMULATORS[name]
    wanted = ", ".join(_FLOAT_ACCUMULATORS) + ("" if rule == "mean" else ", " + ", ".join(_INT_ACCUMULATORS))
    raise InvalidArgument(f"cannot {rule} outputs of dtype {name}; a {rule} output must be one of {wanted}")
