"""The status score of a device (requirements B1, B2): one definition for the inventory's
ScoreDevices and for the dispatcher's layer placement, which re-scores devices after each
layer it places (B5) without a round trip per layer.

Each metric is divided by its maximum over the candidates (so components are 0..1, and 0
when no candidate has any), then the components are combined as the weighted sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from accelmesh.errors import InvalidArgument

METRICS = ("compute", "memory", "bandwidth")


@dataclass(frozen=True)
class Weights:
    compute: float
    memory: float
    bandwidth: float

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(
                    f"task.weights.{item.name} must be a finite number >= 0, got {value!r}; "
                    "or leave task.weights unset to use the default rule"
                )
        if self.compute + self.memory + self.bandwidth <= 0:
            raise InvalidArgument(
                "task.weights.compute, task.weights.memory and task.weights.bandwidth are all 0; "
                "give at least one a positive weight, or leave task.weights unset to use the default rule"
            )

    def normalised(self) -> Weights:
        total = self.compute + self.memory + self.bandwidth
        return Weights(self.compute / total, self.memory / total, self.bandwidth / total)


@dataclass(frozen=True)
class DeviceStatus:
    compute_tflops: float  # free processing capability at the task's precision
    memory_free_bytes: int
    bandwidth_gbps: float


def free_status(peak_tflops: float, bandwidth_gbps: float, memory_free_bytes: int, utilization: float,
                reserved_compute_fraction: float) -> DeviceStatus:
    """What a device has free (B1): its compute less what is in use and reserved, its bandwidth less
    what is reserved (oversubscription leaves nothing, not less), its free memory as measured."""
    unreserved = 1.0 - _unit(reserved_compute_fraction)
    return DeviceStatus(peak_tflops * (1.0 - _unit(utilization)) * unreserved, memory_free_bytes,
                        bandwidth_gbps * unreserved)


def combine(statuses: Sequence[DeviceStatus], weights: Weights) -> list[tuple[float, dict[str, float]]]:
    """(score, components) of each status, normalised over `statuses`; `weights` should be normalised."""
    components = normalised(np.array([s.compute_tflops for s in statuses], float),
                            np.array([s.memory_free_bytes for s in statuses], float),
                            np.array([s.bandwidth_gbps for s in statuses], float))
    scores = weighted(components, weights).tolist()
    columns = [components[name].tolist() for name in METRICS]
    return [(score, dict(zip(METRICS, values))) for score, values in zip(scores, zip(*columns))]


def normalised(compute: np.ndarray, memory: np.ndarray, bandwidth: np.ndarray) -> dict[str, np.ndarray]:
    """Each metric over its maximum among the candidates: 0..1, all 0 when none has any."""
    out = {}
    for name, values in zip(METRICS, (compute, memory, bandwidth)):
        peak = values.max() if values.size else 0.0
        out[name] = values / peak if peak > 0 else np.zeros_like(values)
    return out


def weighted(components: dict[str, np.ndarray], weights: Weights) -> np.ndarray:
    return sum(getattr(weights, name) * components[name] for name in METRICS)


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))
