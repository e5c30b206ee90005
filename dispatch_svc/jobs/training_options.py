"""The host side of data-parallel training: options, minibatch order and the optimizer.

Pure numpy (no jax, no grpc): dispatch runs a training-step program on the mesh, which returns the
full-batch gradient (the shard-size-weighted mean of the shards' mean-loss gradients), and applies
it to the parameters here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from accelmesh.errors import InvalidArgument


def _check_learning_rate(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"training.learning_rate is {value!r}; pass a finite number > 0 (e.g. 0.1)")
    return float(value)


def _check_momentum(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or not 0 <= value < 1:
        raise InvalidArgument(f"training.momentum is {value!r}; pass a number in [0, 1) (0 disables momentum)")
    return float(value)


def _check_count(value: int, field: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgument(f"{field} is {value!r}; pass an integer >= 1 ({hint})")
    return int(value)


def _check_seed(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgument(f"training.shuffle_seed is {value!r}; pass an integer >= 0")
    return int(value)


@dataclass(frozen=True)
class TrainingOptions:
    """How to train. The defaults, measured on one device, train the digits MLP (mlp_train_step)
    from init_params(0) to ~97% test accuracy (100% train) on the stratified 80/20 split of
    accelmesh.datasets.load_digits() (seed 0): 1,438 rows, 12 steps an epoch, 240 steps in all.
    Over 10 seeds of split, init and shuffle: 96.9% to 99.2% (mean 97.8%)."""

    epochs: int = 20
    batch_size: int = 128  # 16 rows a device on an 8-device mesh
    learning_rate: float = 0.1
    momentum: float = 0.9
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        _check_count(self.epochs, "training.epochs", "passes over the training data")
        _check_count(self.batch_size, "training.batch_size", "rows per step, split across devices")
        _check_learning_rate(self.learning_rate)
        _check_momentum(self.momentum)
        _check_seed(self.shuffle_seed)

    def optimizer(self) -> SgdMomentum:
        return SgdMomentum(self.learning_rate, self.momentum)

    def batches(self, rows: int) -> Iterator[Batch]:
        return minibatches(rows, self.batch_size, self.epochs, self.shuffle_seed)


class SgdMomentum:
    """Classic (heavy-ball) momentum: v = momentum * v + g; p = p - learning_rate * v.

    The velocity starts at zero and is kept per parameter in the parameter's dtype (float32 stays
    float32). step() returns new arrays and never modifies the ones passed in.
    """

    def __init__(self, learning_rate: float, momentum: float = 0.0):
        self.learning_rate = _check_learning_rate(learning_rate)
        self.momentum = _check_momentum(momentum)
        self._velocity: list[np.ndarray] | None = None
        self.steps = 0  # updates applied so far

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        params = [np.asarray(p) for p in params]
        grads = [np.asarray(g) for g in grads]
        if len(params) != len(grads):
            raise InvalidArgument(f"{len(grads)} gradients for {len(params)} parameters; pass one gradient "
                                  "per parameter leaf, in Program.parameters order")
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.shape != g.shape:
                raise InvalidArgument(f"gradient {i} has shape {g.shape} but its parameter has {p.shape}")
            if not np.issubdtype(p.dtype, np.floating):
                raise InvalidArgument(f"parameter {i} has dtype {p.dtype}; only floating parameters train")
        if self._velocity is None:
            self._velocity = [np.zeros_like(p) for p in params]
        elif [v.shape for v in self._velocity] != [p.shape for p in params]:
            raise InvalidArgument("the parameter shapes changed since the first step; use a new optimizer "
                                  "for another model")
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            v = self._velocity[i]
            dtype = p.dtype.type
            v = (dtype(self.momentum) * v + g.astype(p.dtype, copy=False)).astype(p.dtype, copy=False)
            self._velocity[i] = v
            out.append((p - dtype(self.learning_rate) * v).astype(p.dtype, copy=False))
        self.steps += 1
        return out

    def velocity(self) -> list[np.ndarray]:
        """Copies of the current velocities (empty before the first step)."""
        return [v.copy() for v in self._velocity] if self._velocity is not None else []


@dataclass(frozen=True)
class Batch:
    epoch: int  # 1-based
    step: int  # 1-based, counted across epochs
    indices: np.ndarray  # int64 row numbers into the training set


def steps_per_epoch(rows: int, batch_size: int) -> int:
    """Batches in one epoch: the last, partial batch counts."""
    rows = _check_count(rows, "training rows", "the training set is empty")
    return math.ceil(rows / _check_count(batch_size, "training.batch_size", "rows per step"))


def minibatches(rows: int, batch_size: int, epochs: int, seed: int) -> Iterator[Batch]:
    """Every row exactly once per epoch, in a fresh permutation per epoch; the last batch of an
    epoch may be smaller. Epoch e's order depends only on (seed, e), so a resumed run repeats it."""
    rows = _check_count(rows, "training rows", "the training set is empty")
    batch_size = _check_count(batch_size, "training.batch_size", "rows per step")
    epochs = _check_count(epochs, "training.epochs", "passes over the training data")
    seed = _check_seed(seed)
    return _minibatches(rows, batch_size, epochs, seed)


def _minibatches(rows: int, batch_size: int, epochs: int, seed: int) -> Iterator[Batch]:
    step = 0
    for epoch in range(1, epochs + 1):
        order = np.random.default_rng((seed, epoch)).permutation(rows)
        for start in range(0, rows, batch_size):
            step += 1
            yield Batch(epoch, step, order[start:start + batch_size])
