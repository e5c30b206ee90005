"""Task-aware device status scores (requirements B1, B2).

Status of a device (B1), from its spec, latest sample and live reservations:

    compute_tflops    = peak rate at the task's precision x (1 - utilization) x (1 - reserved compute fraction)
    memory_free_bytes = max(0, memory total - used - reserved)
    bandwidth_gbps    = memory bandwidth x (1 - reserved compute fraction)

Weights (B2). A task may give its own; each must be finite and >= 0 with a positive sum, and
they are normalised to sum 1. Otherwise the default rule is a roofline argument:

    I = the task's arithmetic intensity in FLOP/byte (100 for training, 10 for inference if not given)
    B = median balance point of the candidates = peak FLOP/s / memory bytes/s, at the task's precision
    compute   = I / (I + B)     a task that does more work per byte than the hardware's balance
                                point is compute bound, one that does less is memory bound
    memory    = (1 - compute) x 2/3 for training (parameters + optimizer state dominate),
                (1 - compute) x 1/2 for inference
    bandwidth = (1 - compute) - memory

Candidates lacking a peak rate or a bandwidth are left out of the median; if none has both,
B = I and compute gets half the weight.

Score: accelmesh.scoring.combine (each metric over its maximum among the candidates, then the
weighted sum; the dispatcher's layer placement uses the same function). Ranking is by score, highest
first, ties by device id so it is deterministic. Callers choose the candidates: pass healthy
devices only (ListDevices' default filter does that).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import PRECISIONS
from accelmesh.scoring import DeviceStatus, Weights, combine, free_status
from inventory_svc.records import DeviceRecord

TASK_KINDS = ("training", "inference")
DEFAULT_INTENSITY_FLOP_PER_BYTE = {"training": 100.0, "inference": 10.0}
MEMORY_SHARE = {"training": 2.0 / 3.0, "inference": 0.5}  # memory's part of the non-compute weight


@dataclass(frozen=True)
class TaskProfile:
    kind: str  # "training" | "inference"
    precision: str = "fp32"
    arithmetic_intensity: float | None = None  # FLOP per byte of memory traffic
    weights: Weights | None = None  # explicit weights override the default rule

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise InvalidArgument(f"task.kind must be one of {', '.join(TASK_KINDS)}, got {self.kind!r}")
        if self.precision not in PRECISIONS:
            raise InvalidArgument(f"task.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        intensity = self.arithmetic_intensity
        if intensity is not None and not (
            isinstance(intensity, (int, float)) and math.isfinite(intensity) and intensity > 0
        ):
            raise InvalidArgument(
                f"task.arithmetic_intensity must be a finite number of FLOP per byte > 0, got {intensity!r}; "
                "or leave it unset for the default of its kind"
            )


@dataclass(frozen=True)
class ScoredDevice:
    record: DeviceRecord
    score: float
    components: dict[str, float]  # "compute", "memory", "bandwidth": status / max over candidates
    weights: Weights
    status: DeviceStatus


def status_of(record: DeviceRecord, precision: str = "fp32") -> DeviceStatus:
    """The device's free processing capability, memory and bandwidth right now (B1)."""
    perf = record.spec.performance
    return free_status(perf.rate_tflops(precision), perf.memory_bandwidth_gbps, record.free_memory_bytes,
                       record.utilization, record.reserved_compute_fraction)


def weights_for(profile: TaskProfile, records: Iterable[DeviceRecord]) -> Weights:
    """The task's weights: explicit ones normalised, else the default rule in the module docstring."""
    if profile.weights is not None:
        return profile.weights.normalised()
    balances = [
        # TFLOP/s x 1e12 over GB/s x 1e9 = FLOP per byte.
        record.spec.performance.rate_tflops(profile.precision) * 1e3 / record.spec.performance.memory_bandwidth_gbps
        for record in records
        if record.spec.performance.memory_bandwidth_gbps > 0
        and record.spec.performance.rate_tflops(profile.precision) > 0
    ]
    return weights_from_balance(profile, statistics.median(balances) if balances else None)


def weights_from_balance(profile: TaskProfile, balance: float | None) -> Weights:
    """The default rule's weights from the candidates' median balance point B in FLOP per byte
    (None when no candidate has one); explicit weights are the caller's to prefer."""
    intensity = profile.arithmetic_intensity or DEFAULT_INTENSITY_FLOP_PER_BYTE[profile.kind]
    if balance is None:
        balance = intensity
    compute = intensity / (intensity + balance)
    memory = (1.0 - compute) * MEMORY_SHARE[profile.kind]
    return Weights(compute, memory, 1.0 - compute - memory)


def score_devices(
    records: Sequence[DeviceRecord], profile: TaskProfile, limit: int | None = None
) -> list[ScoredDevice]:
    """Rank ``records`` for ``profile``, best first (B2); ``limit`` keeps the top ones."""
    if limit is not None and limit < 0:
        raise InvalidArgument(f"limit must be >= 0 (0 or unset means all), got {limit}")
    weights = weights_for(profile, records)
    statuses = [status_of(record, profile.precision) for record in records]
    scored = [ScoredDevice(record, score, components, weights, status)
              for record, status, (score, components) in zip(records, statuses, combine(statuses, weights))]
    scored.sort(key=lambda item: (-item.score, item.record.id))
    return scored[:limit] if limit else scored


def explain_weights(profile: TaskProfile, weights: Weights) -> str:
    """ScoreDevices' account of the weights it ranked by: the request's own, or the rule above."""
    chosen = f"compute {weights.compute:.2f}, memory {weights.memory:.2f}, bandwidth {weights.bandwidth:.2f}"
    if profile.weights is not None:
        return f"explicit weights from the request, normalised: {chosen}"
    return (
        f"derived for {profile.kind} at {profile.precision}: compute = I/(I+B) with arithmetic intensity I "
        f"against the candidates' median balance point B; {chosen}"
    )
