"""What one shard of a program costs on one device: seconds = fixed + rows x seconds per row.

The fixed part is what a shard pays whatever its size (sending it, the dispatcher's and the
worker's handling, loading its executable, launching it); the per-row part is the device's
marginal speed. A rate taken as rows / seconds folds the two together, so it mistakes a small
shard's fixed cost for slowness and plans a large job wrongly: a 6-row shard that took 150 ms,
120 of them fixed, reads as 40 rows/s on a device that runs 170.

Each (program ref, target type) has a prior from the catalog and, once shards ran, a fit to them:

- the prior: seconds per row = FLOPs per row / (peak TFLOP/s at the rule's compute dtype x
  CATALOG_EFFICIENCY); fixed = FIXED_PRIOR_S, the mesh's measured per-shard overhead. Without a
  FLOP estimate the peak itself is a relative speed, not rows/s, and the prior's fixed part is 0,
  since seconds cannot be added to it (the split is then proportional to the peaks, as before).
- the fit: least squares of the shard's seconds on its rows over the recorded (rows, seconds)
  pairs, each weighed down by (1 - MEASURED_SMOOTHING) per newer sample, kept as decayed
  weighted means and centred second moments (Welford's update, so large row counts lose no
  precision). One distinct shard size cannot separate fixed from per-row: then the fixed part is
  the mean of the parts the caller reported as fixed (a shard's time outside the device's
  execution: dispatch, transfer, loading), else the prior's split of the mean is kept (its
  fixed : per-row proportion at that size), and without a FLOP estimate all of it is per-row
  (the old rows / seconds rate). A fit whose slope is not positive (noise over sizes too close
  together) falls back the same way; a negative intercept is refitted through the origin.
- its uncertainty: the samples seen and the residual standard error of a shard's seconds
  around the fit (weighted, with the decayed weights' effective sample count for the degrees
  of freedom; 0 while there are too few samples to tell).

Measured costs win over the catalog because datasheet peaks mispredict real programs by
device-specific factors (the Gavel traces show Recommendation models running slower on a V100
than on a P100 despite a 1.7x higher fp32 peak). A target type not yet measured, in a job where
others are, is priced from the catalog scaled by how the measured types compare with their own
catalog figures (geometric mean), with their mean fixed cost: one type measured keeps the
others' costs in the same units.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import Performance
from accelmesh.programs import COMPUTE_DTYPES, Program
from dispatch_svc.planner.calibration import StageCalibration

# Fraction of datasheet peak a real program sustains. Dense training and inference of the models
# we run reach roughly 30-50% of peak (model FLOPs utilisation) on GPUs; 0.4 sits in that band.
# The same factor applies to every device, so it changes predicted seconds, never the split.
CATALOG_EFFICIENCY = 0.4
# A shard's fixed seconds before any is measured: the embedded mesh's per-shard overhead with the
# parameters held on the worker, 9-12 ms (bench/dispatch.py, README "per-shard overhead").
FIXED_PRIOR_S = 0.01
# Weight of a new measurement: every older sample's weight is multiplied by 1 - 0.3 per new one,
# so recent shards dominate after a handful (an old sample's weight halves in about two) without
# one noisy shard (a cold cache, a busy neighbour) swinging the next plan entirely.
MEASURED_SMOOTHING = 0.3
# Shard sizes whose weighted standard deviation is below this fraction of their mean count as one
# size: a size seen long ago, its weight decayed to almost nothing, then no longer sets the slope.
SAME_SIZE_SPREAD = 1e-3
# The least a row is priced at: a billion rows a second on one device. Shards whose time does not
# grow with their rows (a tiny program, all fixed cost) fit a slope near 0, and a rate of its
# inverse, next to measured ones, is beyond what float arithmetic splits rows by.
MIN_SECONDS_PER_ROW = 1e-9

# (device, artifact) pairs ThroughputModel.warm remembers: 64 bytes or so each.
MAX_WARM_PAIRS = 100_000

SOURCE_MEASURED = "measured"
SOURCE_CATALOG = "catalog"


class CostEstimate(NamedTuple):
    """What a shard of the program costs on one device, where the figures come from, and how
    well they fit (TargetPlan)."""

    rows_per_second: float  # the marginal rate: 1 / seconds per row
    source: str  # SOURCE_MEASURED or SOURCE_CATALOG
    fixed_seconds: float = 0.0  # per shard, whatever its rows
    samples: int = 0  # shards the fit has seen; 0 for the catalog
    residual_seconds: float = 0.0  # residual standard error of a shard's seconds; 0: unknown

    @property
    def seconds_per_row(self) -> float:
        return 1.0 / self.rows_per_second

    def seconds(self, rows: int) -> float:
        """Predicted seconds of one shard of ``rows`` rows (0 rows: no shard, no cost)."""
        return self.fixed_seconds + rows / self.rows_per_second if rows else 0.0


class Target(NamedTuple):
    """One target type of a job: what its devices are and what the rule builds them in. A named
    tuple, not a dataclass: a job over 80,000 devices makes one per device (half the cost)."""

    target_type: str  # TargetType.key
    performance: Performance
    compute_dtype: str  # the rule's BuildOptions.compute_dtype


def flops_per_row(program: Program) -> float | None:
    """FLOPs to process one row: the sum of the layers' per-sample estimates; None if any layer's
    is unknown, or the program has no layer table or no arithmetic to time by."""
    values = [layer.flops_per_sample for layer in program.layers]
    if not values or any(v is None for v in values):
        return None
    total = sum(values)
    return total if total > 0 else None


@dataclass
class _Fit:
    """Decayed weighted moments of one key's (rows, seconds) samples."""

    samples: int = 0
    weight: float = 0.0  # sum of weights
    weight_sq: float = 0.0  # sum of squared weights: the effective sample count is weight^2 / weight_sq
    mean_x: float = 0.0
    mean_y: float = 0.0
    cxx: float = 0.0  # sum of w (x - mean_x)^2
    cxy: float = 0.0
    cyy: float = 0.0
    fixed_weight: float = 0.0  # the same decayed weights, over samples that reported their fixed part
    mean_fixed: float = 0.0

    def add(self, x: float, y: float, fixed: float | None, keep: float) -> None:
        self.samples += 1
        old = keep * self.weight
        self.weight, self.weight_sq = old + 1.0, keep * keep * self.weight_sq + 1.0
        dx, dy = x - self.mean_x, y - self.mean_y
        share = old / self.weight  # the merge of (old, its moments) with one sample of weight 1
        self.cxx = keep * self.cxx + share * dx * dx
        self.cxy = keep * self.cxy + share * dx * dy
        self.cyy = keep * self.cyy + share * dy * dy
        self.mean_x += dx / self.weight
        self.mean_y += dy / self.weight
        self.fixed_weight *= keep
        if fixed is not None:
            self.fixed_weight += 1.0
            self.mean_fixed += (fixed - self.mean_fixed) / self.fixed_weight

    def estimate(self, prior: CostEstimate | None) -> CostEstimate:
        """Fixed and per-row seconds from the samples; ``prior`` splits a single shard size."""
        fixed, per_row, params = None, None, 1
        if self.cxx > SAME_SIZE_SPREAD * SAME_SIZE_SPREAD * self.mean_x * self.mean_x * self.weight:
            slope = self.cxy / self.cxx
            intercept = self.mean_y - slope * self.mean_x
            if slope > 0 and intercept >= 0:
                fixed, per_row, params = intercept, slope, 2
            elif slope > 0:  # through the origin: the best line with no negative fixed cost
                second_x = self.cxx + self.weight * self.mean_x * self.mean_x
                fixed, per_row, params = 0.0, (self.cxy + self.weight * self.mean_x * self.mean_y) / second_x, 1
        if per_row is None:
            fixed, per_row = self._one_size(prior)
        per_row = max(per_row, MIN_SECONDS_PER_ROW)
        return CostEstimate(1.0 / per_row, SOURCE_MEASURED, fixed, self.samples, self._residual(fixed, per_row, params))

    def _one_size(self, prior: CostEstimate | None) -> tuple[float, float]:
        rows, seconds = self.mean_x, self.mean_y
        if self.fixed_weight > 0 and self.mean_fixed < seconds:
            fixed = max(0.0, self.mean_fixed)
        elif prior is not None and prior.fixed_seconds > 0:
            fixed = seconds * prior.fixed_seconds / prior.seconds(max(1, round(rows)))
        else:
            fixed = 0.0
        return fixed, (seconds - fixed) / rows

    def _residual(self, fixed: float, per_row: float, params: int) -> float:
        """Weighted residual standard error around ``fixed + per_row x``; 0 with too few samples."""
        effective = self.weight * self.weight / self.weight_sq
        if effective <= params + 1e-9:
            return 0.0
        # Residual sum of squares from the moments: sum w (y - a - b x)^2.
        offset = self.mean_y - fixed - per_row * self.mean_x
        sse = self.cyy - 2 * per_row * self.cxy + per_row * per_row * self.cxx + self.weight * offset * offset
        return math.sqrt(max(0.0, sse) / self.weight * effective / (effective - params))


class ThroughputModel:
    """Per (program ref, target type key) fitted shard costs, with the catalog as the prior.

    Thread-safe: shards finish on many threads and each records its time while planners read.
    """

    def __init__(self, *, efficiency: float = CATALOG_EFFICIENCY, smoothing: float = MEASURED_SMOOTHING,
                 fixed_prior_s: float = FIXED_PRIOR_S, calibrate_stages: bool = True):
        if not 0 < efficiency <= 1:
            raise InvalidArgument(f"efficiency must be in (0, 1], got {efficiency!r}")
        if not 0 < smoothing <= 1:
            raise InvalidArgument(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not (fixed_prior_s >= 0 and math.isfinite(fixed_prior_s)):
            raise InvalidArgument(f"fixed_prior_s must be a finite number of seconds >= 0, got {fixed_prior_s!r}")
        self.efficiency = efficiency
        self.smoothing = smoothing
        self.fixed_prior_s = fixed_prior_s
        self._lock = threading.Lock()
        self._fits: dict[tuple[str, str], _Fit] = {}
        self._warm: set[tuple[str, str]] = set()  # (device, artifact) pairs that ran here once
        # program name -> device type -> the (program ref, target type key) last measured on it (`by_device_type`)
        self._measured_types: dict[str, dict[str, tuple[str, str]]] = {}
        # pipeline stages: the layer model against what ran; None: not calibrated (config.calibrate_stages)
        self.stages: StageCalibration | None = StageCalibration(smoothing) if calibrate_stages else None

    def record(self, program_ref: str, target_type: str, rows: int, seconds: float, *,
               fixed_seconds: float | None = None, device_type: str = "") -> CostEstimate:
        """Fold a finished shard in: ``rows`` took ``seconds`` in all, of which ``fixed_seconds``
        (optional) did not depend on its rows; returns the key's new estimate (no prior).
        ``device_type``: the catalog type of the device it ran on, so the queue's scheduling round
        finds the program's measured rates by device type (`by_device_type`).

        Each shard is one sample of the line, so a tiny shard, whose time is mostly fixed cost,
        sets the intercept instead of dragging the rate down as it would in rows / seconds.
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise InvalidArgument(f"rows must be a positive whole number to record a shard, got {rows!r}")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise InvalidArgument(f"seconds must be a positive finite number to record a shard, got {seconds!r}")
        if fixed_seconds is not None and not (0 <= fixed_seconds <= seconds):
            raise InvalidArgument(f"fixed_seconds must be within 0..seconds ({seconds!r}), got {fixed_seconds!r}; "
                                  "pass None when the shard's fixed part is not known")
        key = (program_ref, target_type)
        with self._lock:
            fit = self._fits.setdefault(key, _Fit())
            fit.add(float(rows), float(seconds), fixed_seconds, 1.0 - self.smoothing)
            if device_type:
                name = program_ref.rsplit("@", 1)[0]
                self._measured_types.setdefault(name, {})[device_type] = key
            return fit.estimate(None)

    def by_device_type(self, program: str) -> dict[str, tuple[str, str]]:
        """The (program ref, target type key) last measured for ``program`` (a name, any version)
        on each device type."""
        with self._lock:
            return dict(self._measured_types.get(program, {}))

    def warm(self, device_id: str, artifact_key: str) -> bool:
        """Whether `device_id` ran `artifact_key` before (as this dispatcher saw it); the first
        call remembers it. A device's first run of an executable pays one-time costs later runs do
        not (measured: 128 rows in 618 ms cold, 412 ms warm, on an emulated A100), so only warm
        runs are fitted. At MAX_WARM_PAIRS remembered pairs the memory starts over."""
        key = (device_id, artifact_key)
        with self._lock:
            if key in self._warm:
                return True
            if len(self._warm) >= MAX_WARM_PAIRS:
                self._warm.clear()
            self._warm.add(key)
            return False

    def measured(self, program_ref: str, target_type: str, prior: CostEstimate | None = None) -> CostEstimate | None:
        """The fitted cost, or None before any shard of the key was recorded."""
        with self._lock:
            fit = self._fits.get((program_ref, target_type))
            return None if fit is None else fit.estimate(prior)

    def rate(self, program_ref: str, target_type: str, performance: Performance, compute_dtype: str, *,
             flops_per_row: float | None = None) -> CostEstimate:
        """The cost of one device of ``target_type`` running ``program_ref`` built with ``compute_dtype``:
        measured when known, else the catalog prior (see the module's docstring)."""
        return self.rates(program_ref, [Target(target_type, performance, compute_dtype)],
                          flops_per_row=flops_per_row)[target_type]

    def rates(self, program_ref: str, targets: Sequence[Target], *,
              flops_per_row: float | None = None) -> dict[str, CostEstimate]:
        """The cost of every target type of one job, consistently in seconds.

        Unmeasured types are priced from the catalog scaled by the measured types' ratio of
        measured to catalog seconds per row (geometric mean over them), which also turns relative
        peak speeds into seconds when the program has no FLOP estimate, and get the measured
        types' mean fixed cost: one slow type measured still lets the fast unmeasured ones get
        their share.
        """
        priors = {t.target_type: self.catalog_cost(t.performance, t.compute_dtype, flops_per_row=flops_per_row)
                  for t in targets}
        measured = {t.target_type: self.measured(program_ref, t.target_type, priors[t.target_type]) for t in targets}
        known = [(measured[k], priors[k]) for k in priors if measured[k] is not None]
        if not known:
            return priors
        scale = math.exp(sum(math.log(prior.rows_per_second / cost.rows_per_second) for cost, prior in known)
                         / len(known))
        fixed = sum(cost.fixed_seconds for cost, _ in known) / len(known)
        return {k: measured[k] if measured[k] is not None
                else CostEstimate(priors[k].rows_per_second / scale, SOURCE_CATALOG, fixed)
                for k in priors}

    def catalog_cost(self, performance: Performance, compute_dtype: str, *,
                     flops_per_row: float | None = None) -> CostEstimate:
        """The prior: datasheet peak for the per-row part, FIXED_PRIOR_S for the fixed part (0 and
        a relative speed when ``flops_per_row`` is None)."""
        rate = self.catalog_rate(performance, compute_dtype, flops_per_row=flops_per_row)
        return CostEstimate(rate, SOURCE_CATALOG, 0.0 if flops_per_row is None else self.fixed_prior_s)

    def catalog_rate(self, performance: Performance, compute_dtype: str, *,
                     flops_per_row: float | None = None) -> float:
        """Rows/s from datasheet peaks alone (a relative speed when ``flops_per_row`` is None)."""
        if compute_dtype not in COMPUTE_DTYPES:
            raise InvalidArgument(f"compute_dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        peak_tflops = performance.rate_tflops(compute_dtype)
        if peak_tflops <= 0:
            raise InvalidArgument(
                f"the device publishes no peak rate (peak_tflops {dict(performance.peak_tflops)}); "
                "record a measured rate for it or fix its catalog entry"
            )
        if flops_per_row is None:
            return peak_tflops
        if not (flops_per_row > 0 and math.isfinite(flops_per_row)):
            raise InvalidArgument(f"flops_per_row must be a positive finite number or None, got {flops_per_row!r}")
        return peak_tflops * 1e12 * self.efficiency / flops_per_row
