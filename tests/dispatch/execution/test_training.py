"""The host side of training: optimizer, minibatch order, options; and an end-to-end check that
the default options train the real digits MLP (one device, no mesh) to a good test accuracy."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from accelmesh.datasets import load_digits, train_test_split
from accelmesh.errors import InvalidArgument
from compile_svc.programs import default_registry
from dispatch_svc.jobs.training_options import Batch, SgdMomentum, TrainingOptions, minibatches, steps_per_epoch

# Measured with the defaults, split seed 0, init_params(0): 96.9% test, 100% train accuracy
# (over 10 seeds of split, init and shuffle: 96.9%..99.2%). The floor leaves room for other
# CPUs/XLA versions while still catching a wrong update (plain SGD at lr 0.1 reaches only ~91%).
TEST_ACCURACY_FLOOR = 0.95


# ---- SgdMomentum ----

def test_sgd_momentum_matches_a_hand_computation():
    opt = SgdMomentum(learning_rate=0.1, momentum=0.9)
    p0 = [np.array([1.0, 2.0], np.float32), np.array([[3.0]], np.float32)]
    g1 = [np.array([0.5, -1.0], np.float32), np.array([[2.0]], np.float32)]
    g2 = [np.array([0.1, 0.2], np.float32), np.array([[-1.0]], np.float32)]
    # step 1: v = g1                      -> p = p0 - 0.1 * g1
    p1 = opt.step(p0, g1)
    np.testing.assert_allclose(p1[0], [0.95, 2.1], rtol=1e-6)
    np.testing.assert_allclose(p1[1], [[2.8]], rtol=1e-6)
    # step 2: v = 0.9 * g1 + g2 = [0.55, -0.7], [[0.8]] -> p = p1 - 0.1 * v
    p2 = opt.step(p1, g2)
    np.testing.assert_allclose(p2[0], [0.895, 2.17], rtol=1e-6)
    np.testing.assert_allclose(p2[1], [[2.72]], rtol=1e-6)
    np.testing.assert_allclose(opt.velocity()[0], [0.55, -0.7], rtol=1e-6)
    assert all(p.dtype == np.float32 for p in p1 + p2)
    assert opt.steps == 2
    # inputs are never modified
    np.testing.assert_array_equal(p0[0], [1.0, 2.0])
    np.testing.assert_array_equal(g1[0], [0.5, -1.0])


def test_sgd_without_momentum_is_plain_sgd_and_keeps_float32_with_float64_grads():
    opt = SgdMomentum(0.5, 0.0)
    p = [np.array([1.0], np.float32)]
    for _ in range(3):
        p = opt.step(p, [np.array([1.0], np.float64)])
    assert p[0].dtype == np.float32
    np.testing.assert_allclose(p[0], [-0.5])


@pytest.mark.parametrize("lr", [0, -0.1, math.nan, math.inf, True, "0.1"])
def test_learning_rate_must_be_positive_and_finite(lr):
    with pytest.raises(InvalidArgument, match="training.learning_rate"):
        SgdMomentum(lr, 0.9)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5, math.nan, None])
def test_momentum_must_be_in_zero_one(momentum):
    with pytest.raises(InvalidArgument, match="training.momentum"):
        SgdMomentum(0.1, momentum)


def test_step_rejects_mismatched_gradients():
    opt = SgdMomentum(0.1, 0.9)
    p = [np.zeros((2, 3), np.float32)]
    with pytest.raises(InvalidArgument, match="2 gradients for 1 parameters"):
        opt.step(p, [np.zeros((2, 3)), np.zeros(1)])
    with pytest.raises(InvalidArgument, match="shape"):
        opt.step(p, [np.zeros((3, 2), np.float32)])
    opt.step(p, [np.ones((2, 3), np.float32)])
    with pytest.raises(InvalidArgument, match="shapes changed"):
        opt.step([np.zeros(4, np.float32)], [np.zeros(4, np.float32)])


# ---- minibatches ----

def test_minibatches_cover_every_row_once_per_epoch_with_a_partial_last_batch():
    batches = list(minibatches(rows=10, batch_size=3, epochs=3, seed=7))
    assert [b.step for b in batches] == list(range(1, 13))
    assert [b.epoch for b in batches] == [1] * 4 + [2] * 4 + [3] * 4
    assert [len(b.indices) for b in batches] == [3, 3, 3, 1] * 3
    orders = []
    for epoch in (1, 2, 3):
        rows = np.concatenate([b.indices for b in batches if b.epoch == epoch])
        assert sorted(rows.tolist()) == list(range(10))
        orders.append(rows.tolist())
    assert len({tuple(o) for o in orders}) == 3  # a fresh permutation each epoch
    assert all(isinstance(b, Batch) and b.indices.dtype.kind == "i" for b in batches)


def test_minibatches_are_deterministic_per_seed():
    def order(seed):
        return [b.indices.tolist() for b in minibatches(100, 32, 2, seed)]
    assert order(0) == order(0)
    assert order(0) != order(1)
    # An epoch's order depends only on (seed, epoch): a run resumed at epoch 2 repeats it.
    assert order(0)[4:] == [b.indices.tolist() for b in minibatches(100, 32, 2, 0) if b.epoch == 2]


def test_a_batch_larger_than_the_data_is_one_batch_per_epoch():
    batches = list(minibatches(5, 64, 2, 0))
    assert [(b.epoch, b.step, len(b.indices)) for b in batches] == [(1, 1, 5), (2, 2, 5)]
    assert steps_per_epoch(5, 64) == 1 and steps_per_epoch(1438, 128) == 12


@pytest.mark.parametrize("kwargs, field", [
    ({"batch_size": 0}, "training.batch_size"),
    ({"batch_size": 2.5}, "training.batch_size"),
    ({"batch_size": True}, "training.batch_size"),
    ({"epochs": 0}, "training.epochs"),
    ({"epochs": -3}, "training.epochs"),
    ({"seed": -1}, "training.shuffle_seed"),
    ({"rows": 0}, "training rows"),
])
def test_minibatches_validate_eagerly(kwargs, field):
    args = {"rows": 10, "batch_size": 3, "epochs": 1, "seed": 0, **kwargs}
    with pytest.raises(InvalidArgument, match=field):
        minibatches(**args)  # raises at the call, before iteration


# ---- TrainingOptions ----

def test_training_options_defaults_and_validation():
    options = TrainingOptions()
    assert (options.epochs, options.batch_size, options.learning_rate, options.momentum,
            options.shuffle_seed) == (20, 128, 0.1, 0.9, 0)
    assert isinstance(options.optimizer(), SgdMomentum)
    assert len(list(options.batches(1438))) == 20 * 12
    for field, bad in [("epochs", 0), ("batch_size", -1), ("learning_rate", 0.0), ("momentum", 1.0),
                       ("shuffle_seed", -1)]:
        with pytest.raises(InvalidArgument, match=f"training.{field}"):
            TrainingOptions(**{field: bad})


# ---- end to end on one device: the real programs, the packaged data ----

@pytest.fixture(scope="module")
def mlp():
    registry = default_registry()
    train, classify = registry.get("mlp_train_step"), registry.get("mlp_classifier")
    # The classifier evaluates the trained leaves as they are: same names, shapes, dtypes and order.
    assert train.parameters == classify.parameters
    assert [o.name for o in train.outputs] == [f"grad/{p.name}" for p in train.parameters] + ["loss", "correct"]
    for a, b in zip(train.init_params(0), classify.init_params(0)):
        np.testing.assert_array_equal(a, b)
    return train, jax.jit(train.fn), jax.jit(classify.fn)


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits()
    return train_test_split(x, y, test_fraction=0.2, seed=0)


def _accuracy(classify, params, x, y) -> float:
    (logits,) = classify(*params, x)
    return float(np.mean(np.asarray(logits).argmax(axis=-1) == y))


def test_default_options_train_the_digits_mlp(mlp, digits):
    program, step, classify = mlp
    options = TrainingOptions()
    params = program.init_params(0)
    n = len(program.parameters)
    optimizer = options.optimizer()
    before = _accuracy(classify, params, digits.x_test, digits.y_test)
    epoch_loss: dict[int, list[float]] = {}
    correct = 0
    for batch in options.batches(len(digits.y_train)):
        out = step(*params, digits.x_train[batch.indices], digits.y_train[batch.indices])
        params = optimizer.step(params, [np.asarray(g) for g in out[:n]])
        epoch_loss.setdefault(batch.epoch, []).append(float(out[n]))
        if batch.epoch == options.epochs:
            correct += int(out[n + 1])
    assert optimizer.steps == options.epochs * steps_per_epoch(len(digits.y_train), options.batch_size)
    assert all(p.dtype == np.float32 for p in params)
    first, last = np.mean(epoch_loss[1]), np.mean(epoch_loss[options.epochs])
    assert last < 0.1 * first, (first, last)
    assert correct / len(digits.y_train) > 0.98  # the step's 'correct' output counts the last epoch
    test_accuracy = _accuracy(classify, params, digits.x_test, digits.y_test)
    assert before < 0.3  # untrained: about chance
    assert test_accuracy >= TEST_ACCURACY_FLOOR, f"test accuracy {test_accuracy:.4f}"
    assert _accuracy(classify, params, digits.x_train, digits.y_train) >= 0.99


def test_size_weighted_mean_of_shard_gradients_is_the_full_batch_gradient(mlp, digits):
    """How dispatch must combine 'mean' outputs of shards of unequal size; the wrong ways are
    detectably different."""
    program, step, _ = mlp
    n = len(program.parameters)
    params = program.init_params(0)
    x, y = digits.x_train[:128], digits.y_train[:128]
    full = [np.asarray(o, np.float64) for o in step(*params, x, y)]
    sizes = [5, 17, 40, 66]  # very uneven, as a batch split over unequal devices can be
    edges = np.cumsum([0, *sizes])
    shards = [[np.asarray(o, np.float64) for o in step(*params, x[a:b], y[a:b])]
              for a, b in zip(edges[:-1], edges[1:])]
    weights = np.asarray(sizes, np.float64) / sum(sizes)

    weighted = [sum(w * s[i] for w, s in zip(weights, shards)) for i in range(n + 1)]
    unweighted = [sum(s[i] for s in shards) / len(shards) for i in range(n + 1)]
    summed = [sum(s[i] for s in shards) for i in range(n)]
    for i in range(n + 1):  # every gradient leaf and the loss
        np.testing.assert_allclose(weighted[i], full[i], rtol=1e-4, atol=1e-5)
    assert sum(int(s[n + 1]) for s in shards) == int(full[n + 1])  # 'correct' combines by sum

    def max_error(combined):
        return max(float(np.max(np.abs(c - f))) for c, f in zip(combined, full[:n]))
    assert max_error(weighted) < 1e-5
    assert max_error(unweighted) > 1e-3, max_error(unweighted)
    assert max_error(summed) > 1e-2, max_error(summed)

    # And the wrong combination changes the update, not just a rounding digit.
    right = SgdMomentum(0.1, 0.9).step(params, weighted[:n])
    wrong = SgdMomentum(0.1, 0.9).step(params, unweighted[:n])
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(right, wrong)) > 1e-4
