"""Spot checks of a data-parallel job's outputs: which shards are run a second time on another node,
and whether two runs of a shard agree.

A worker with a valid certificate can still return outputs of the right shape and wrong values;
only running the shard again somewhere else shows it. The sample is drawn from the job id, so the
same job always checks the same shards (a reader of its record can reproduce the choice), and
holds at least one shard whenever the fraction is above 0. Two runs agree when every output's
largest difference, relative to the larger magnitude of the two, is within the looser of the two
compile rules' tolerances (a bf16 build is compared with an fp32 one at bf16's 5e-2, as the demo
compares them), and both have their non-finite values (NaN, inf) in the same places.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A magnitude under this is taken as this when a difference is made relative: outputs of zeros
# compare by their absolute difference instead of dividing by zero.
ABSOLUTE_FLOOR = 1e-6


def sample_shards(job_id: str, shard_count: int, fraction: float) -> frozenset[int]:
    """The indices of the shards `fraction` of `shard_count` asks for, at least one when it is
    above 0, chosen by a generator seeded from `job_id` alone."""
    if fraction <= 0 or shard_count <= 0:
        return frozenset()
    count = min(shard_count, max(1, math.ceil(fraction * shard_count - 1e-9)))
    seed = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    picked = np.random.default_rng(seed).choice(shard_count, size=count, replace=False)
    return frozenset(int(i) for i in picked)


@dataclass(frozen=True)
class Comparison:
    """Two runs' outputs compared: `error_ratio` is the largest relative difference in units of
    `tolerance` (inf where their non-finite values or shapes differ)."""

    error_ratio: float
    tolerance: float
    output: str  # the name of the output that differed most

    @property
    def matched(self) -> bool:
        return self.error_ratio <= 1.0

    def describe(self) -> str:
        return f"{self.tolerance:g} of the outputs' largest magnitude"


def compare_outputs(names: Sequence[str], first: Sequence[np.ndarray], second: Sequence[np.ndarray],
                    tolerance: float) -> Comparison:
    """Compare two runs of one shard output by output (`names` in the program's order)."""
    worst = Comparison(0.0, tolerance, names[0] if names else "")
    for name, a, b in zip(names, first, second, strict=True):
        ratio = _error(np.asarray(a), np.asarray(b)) / tolerance
        if ratio > worst.error_ratio:
            worst = Comparison(ratio, tolerance, name)
    return worst


def _error(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    # NaN where one has NaN and inf of a sign where the other has the same: equal as values go.
    if not np.array_equal(finite_a, finite_b) or not np.array_equal(a[~finite_a], b[~finite_b], equal_nan=True):
        return math.inf
    if not finite_a.any():
        return 0.0
    a, b = a[finite_a], b[finite_b]
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(b))), ABSOLUTE_FLOOR)
    return float(np.max(np.abs(a - b))) / scale
