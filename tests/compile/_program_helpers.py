"""Shared by the program tests: seeded parameters and random inputs of a batch for any program.
A module of its own, not a conftest.py: a second conftest.py would shadow the top-level one that
tests import as `conftest`."""

from __future__ import annotations

import numpy as np

from accelmesh.programs import Program, TensorSpec

SEED = 0


def _batch(spec: TensorSpec, batch: int, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(batch if d is None else d for d in spec.shape)
    if spec.dtype == "int32":
        high = 512 if spec.name == "tokens" else 10  # vocabulary size; number of classes
        return rng.integers(0, high, size=shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(spec.dtype)


def _inputs(program: Program, batch: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_batch(spec, batch, rng) for spec in program.inputs]


def _params(program: Program) -> list[np.ndarray]:
    return program.init_params(SEED) if program.init_params else []
