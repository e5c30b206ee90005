"""Folding shard outputs: sum / mean against one-device references, in any arrival order, and
over the bucketed shards the planner makes (concatenated outputs are written in place:
tests/dispatch/execution/test_strategies.py and tests/dispatch/planner/test_buckets.py)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from accelmesh.errors import FailedPrecondition, InvalidArgument
from dispatch_svc.execution.combine import Accumulator
from dispatch_svc.planner import BUCKET_RUNGS, PlannedDevice, bucket_ladder, plan_shards

SHARD_ROWS = [3, 1, 5, 2]  # uneven, as a throughput-weighted plan makes them


def split(x: np.ndarray, rows=SHARD_ROWS) -> list[np.ndarray]:
    return np.split(x, np.cumsum(rows)[:-1])


def combine(rule: str, values, rows) -> np.ndarray:
    """The shards' values folded in shard order."""
    accumulator = Accumulator(rule, rows)
    for index, value in enumerate(values):
        accumulator.add(index, value)
    return accumulator.result()


@pytest.fixture
def batch() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(sum(SHARD_ROWS), 4))


def test_sum_of_shard_sums_equals_the_full_sum(batch):
    out = combine("sum", [s.sum(axis=0) for s in split(batch)], SHARD_ROWS)
    np.testing.assert_allclose(out, batch.sum(axis=0), rtol=1e-12)


def test_row_weighted_mean_of_shard_means_equals_the_full_mean(batch):
    out = combine("mean", [s.mean(axis=0) for s in split(batch)], SHARD_ROWS)
    np.testing.assert_allclose(out, batch.mean(axis=0), rtol=1e-12)
    unweighted = np.mean([s.mean(axis=0) for s in split(batch)], axis=0)
    assert not np.allclose(unweighted, batch.mean(axis=0))  # why the weights matter


def mse_gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of mean((x @ w - y)^2) over the rows given."""
    return 2.0 * x.T @ (x @ w - y) / len(x)


def test_mean_of_per_shard_mean_gradients_is_the_full_batch_gradient():
    rng = np.random.default_rng(1)
    x, y, w = rng.normal(size=(11, 3)), rng.normal(size=11), rng.normal(size=3)
    grads = [mse_gradient(w, xs, ys) for xs, ys in zip(split(x), split(y))]
    np.testing.assert_allclose(combine("mean", grads, SHARD_ROWS), mse_gradient(w, x, y), rtol=1e-12)


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_any_arrival_order_gives_the_bits_of_shard_order(rule):
    # Magnitudes that make float32 addition order visible: (1e8 + 1) - 1e8 != 1e8 - 1e8 + 1.
    values = [np.array([1e8, 3.0], np.float32), np.array([1.0, 1e-3], np.float32),
              np.array([-1e8, 7.0], np.float32), np.array([1.0, 1e7], np.float32)]
    reference = combine(rule, values, SHARD_ROWS)
    orders = list(itertools.permutations(range(len(values))))
    for order in orders:
        accumulator = Accumulator(rule, SHARD_ROWS)
        for i in order:
            accumulator.add(i, values[i])
        assert accumulator.done
        result = accumulator.result()
        assert result.dtype == np.float32
        assert result.tobytes() == reference.tobytes(), order
    naive = values[2] + values[0] + values[1] + values[3] if rule == "sum" else None
    if naive is not None:
        assert naive.tobytes() != reference.tobytes()  # a different order would have changed the bits


# -- bucketed shards: split into ladder sizes, never padded -----------------------------------------

RATES = (1.0, 2.5, 7.0)


def shard_rows(total: int, cap: int, *, bucketed: bool) -> list[int]:
    pool = [PlannedDevice(f"d{i}", "t", rate) for i, rate in enumerate(RATES)]
    plan = plan_shards(total, pool, max_shard_rows=cap, exact=True, bucket_rungs=BUCKET_RUNGS if bucketed else None)
    return [shard.rows for shard in plan.shards]


@pytest.mark.parametrize("total", [1000, 1003])  # 1003: a 3-row tail off the ladder
def test_bucketed_shards_sum_to_the_bits_of_the_unbucketed_and_whole_batch_sums(total):
    # Integer-valued rows: every partial sum is exact, so any split that folds only real rows
    # must give the whole batch's bits; a padded or dropped row would show.
    batch = np.random.default_rng(3).integers(-1000, 1000, size=(total, 4)).astype(np.float32)
    bucketed, free = shard_rows(total, 64, bucketed=True), shard_rows(total, 64, bucketed=False)
    assert set(bucketed) <= set(bucket_ladder(total, 64).sizes) and bucketed != free
    whole = batch.sum(axis=0)
    for rows in (bucketed, free):
        assert combine("sum", [s.sum(axis=0) for s in split(batch, rows)], rows).tobytes() == whole.tobytes()
    counts = (batch > 0).sum(axis=1).astype(np.int32)  # an int32 per-row count, as mlp's "correct"
    out = combine("sum", [np.int32(c.sum()) for c in split(counts, bucketed)], bucketed)
    assert out.dtype == np.int32 and int(out) == int(counts.sum())


def test_bucketed_means_weigh_real_rows_and_match_the_unbucketed_mean():
    total = 1000  # cap 64: unit 4, rungs 4..64, all powers of two, no tail
    batch = np.random.default_rng(4).integers(-1000, 1000, size=(total, 4)).astype(np.float64)
    bucketed, free = shard_rows(total, 64, bucketed=True), shard_rows(total, 64, bucketed=False)
    means = [s.mean(axis=0) for s in split(batch, bucketed)]
    # Power-of-two shards: each shard mean and its weighting back are exact, so the bits are the
    # whole batch's; an unbucketed split agrees to rounding.
    assert combine("mean", means, bucketed).tobytes() == (batch.sum(axis=0) / total).tobytes()
    np.testing.assert_allclose(combine("mean", [s.mean(axis=0) for s in split(batch, free)], free),
                               batch.mean(axis=0), rtol=1e-12)
    # Why shards are split, not padded: a tail padded up to a rung folds zero rows into its mean.
    tail = batch[-6:]
    padded = np.concatenate([tail, np.zeros((2, 4))]).mean(axis=0)
    head = batch[:-6].mean(axis=0)
    wrong = combine("mean", [head, padded], [total - 6, 6])
    assert not np.allclose(wrong, batch.mean(axis=0), rtol=1e-6)


def test_bucketed_shard_gradients_average_to_the_full_batch_gradient():
    rng = np.random.default_rng(5)
    x, y, w = rng.normal(size=(1003, 3)), rng.normal(size=1003), rng.normal(size=3)
    rows = shard_rows(1003, 64, bucketed=True)
    grads = [mse_gradient(w, xs, ys) for xs, ys in zip(split(x, rows), split(y, rows))]
    np.testing.assert_allclose(combine("mean", grads, rows), mse_gradient(w, x, y), rtol=1e-12)


def test_bf16_sums_accumulate_in_fp32_and_keep_their_dtype():
    ones = [np.ones(2, ml_dtypes.bfloat16) for _ in range(300)]
    out = combine("sum", ones, [1] * 300)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), [300.0, 300.0])
    naive = ones[0]
    for one in ones[1:]:
        naive = naive + one
    assert float(naive[0]) == 256.0  # bf16 accumulation stalls where 256 + 1 rounds back to 256


def test_bf16_mean_keeps_its_dtype(batch):
    shards = [s.astype(ml_dtypes.bfloat16) for s in split(batch)]
    mean = combine("mean", [s.astype(np.float32).mean(axis=0).astype(ml_dtypes.bfloat16) for s in shards], SHARD_ROWS)
    assert mean.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(mean.astype(np.float32), batch.mean(axis=0), rtol=2e-2, atol=2e-2)


def test_integer_sum_keeps_its_dtype():
    out = combine("sum", [np.array([1, 2], np.int32), np.array([3, 4], np.int32)], [1, 1])
    assert out.dtype == np.int32 and out.tolist() == [4, 6]


@pytest.mark.parametrize(
    "action, error",
    [
        (lambda: Accumulator("sum", SHARD_ROWS).add(4, np.zeros(1)), InvalidArgument),  # no shard 4
        (lambda: Accumulator("mean", SHARD_ROWS).add(0, np.array([1, 2])), InvalidArgument),  # integer mean
        (lambda: Accumulator("sum", SHARD_ROWS).add(0, np.array([True])), InvalidArgument),
        (lambda: Accumulator("concat", SHARD_ROWS), InvalidArgument),
        (lambda: Accumulator("sum", [2, 0]), InvalidArgument),
        (lambda: Accumulator("max", SHARD_ROWS), InvalidArgument),
        (lambda: Accumulator("sum", SHARD_ROWS).result(), FailedPrecondition),
    ],
)
def test_malformed_results_raise_typed_errors(action, error):
    with pytest.raises(error):
        action()


def test_duplicate_and_mismatched_shards_are_rejected():
    accumulator = Accumulator("sum", SHARD_ROWS)
    accumulator.add(1, np.zeros(3))
    with pytest.raises(FailedPrecondition, match="shard 1 was already added"):
        accumulator.add(1, np.zeros(3))
    with pytest.raises(InvalidArgument, match="shard 0"):
        accumulator.add(0, np.zeros(4))
    accumulator.add(0, np.zeros(3))
    with pytest.raises(FailedPrecondition, match="already added"):
        accumulator.add(0, np.zeros(3))  # folded already, still a duplicate
    with pytest.raises(FailedPrecondition, match=r"shards \[2, 3\]"):
        accumulator.result()
