"""Folding shard outputs: sum / mean against one-device references, in any arrival order
(concatenated outputs are written in place: tests/dispatch/test_strategies.py)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from accelmesh.errors import FailedPrecondition, InvalidArgument
from dispatch_svc.combine import Accumulator

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
