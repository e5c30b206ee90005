"""What a pipeline stage really costs on a target type, against what the layer model predicted.

The layer model (layer_model.py) prices a stage from datasheet peaks: right in its ratios between
devices, not in absolute seconds, and blind to what every stage call pays whatever its size (the
dispatcher sending the activation, the worker's handling and launch, the result's way back). On
this machine a transformer stage predicted at 0.9 ms on a host CPU ran 54 ms on the device and
200 ms as the dispatcher saw it (bench/placement.py, (c)). So each finished stage call on a type
leaves two figures:

- its slowdown: measured execution on the device over the model's predicted compute for it;
- its overhead: the call's own time as the dispatcher saw it (less the wait behind the device's
  previous call) beyond that execution.

Both are decayed means per target type (the slowdown's geometric: ratios), MEASURED_SMOOTHING a
sample, as the data-parallel fits are. A placement then prices a device of a calibrated type at
its peak rate and bandwidth over the slowdown, and charges every stage on it the overhead once
per micro-batch, so it weighs a cut that adds a hop against what the hop costs here.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

from accelmesh.errors import InvalidArgument


class Calibration(NamedTuple):
    slowdown: float  # measured device execution / predicted compute (> 0)
    overhead_seconds: float  # per stage call, beyond the execution
    samples: int


class StageCalibration:
    """Per target type: decayed slowdown and overhead of finished stage calls. Thread-safe."""

    def __init__(self, smoothing: float):
        if not 0 < smoothing <= 1:
            raise InvalidArgument(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._by_type: dict[str, tuple[float, float, float, int]] = {}  # weight, mean log slowdown, overhead, n

    def record(self, target_type: str, predicted_seconds: float, execute_seconds: float, own_seconds: float) -> None:
        """One stage call: the model's predicted compute, the device's execution, and the call's
        own seconds as the dispatcher saw it. Calls without a usable prediction are ignored."""
        if not (predicted_seconds > 0 and execute_seconds > 0 and math.isfinite(predicted_seconds)
                and math.isfinite(execute_seconds) and math.isfinite(own_seconds)):
            return
        keep = 1.0 - self.smoothing
        with self._lock:
            weight, log_slow, overhead, samples = self._by_type.get(target_type, (0.0, 0.0, 0.0, 0))
            weight = keep * weight + 1.0
            log_slow += (math.log(execute_seconds / predicted_seconds) - log_slow) / weight
            overhead += (max(0.0, own_seconds - execute_seconds) - overhead) / weight
            self._by_type[target_type] = (weight, log_slow, overhead, samples + 1)

    def get(self, target_type: str) -> Calibration | None:
        with self._lock:
            entry = self._by_type.get(target_type)
        if entry is None:
            return None
        _, log_slow, overhead, samples = entry
        return Calibration(math.exp(log_slow), overhead, samples)
