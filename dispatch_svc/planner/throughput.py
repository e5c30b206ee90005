"""Expected rows per second of one device for a program: measured when known, else from the catalog.

Sharding only needs the *ratios* between devices to be right; the absolute figure matters for the
predicted seconds a plan reports. Measured rates win because datasheet peaks mispredict real
programs by device-specific factors (the Gavel traces show Recommendation models running slower
on a V100 than on a P100 despite a 1.7x higher fp32 peak).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import Performance
from accelmesh.programs import COMPUTE_DTYPES, Program

# Fraction of datasheet peak a real program sustains. Dense training and inference of the models
# we run reach roughly 30-50% of peak (model FLOPs utilisation) on GPUs; 0.4 sits in that band.
# The same factor applies to every device, so it changes predicted seconds, never the split.
CATALOG_EFFICIENCY = 0.4
# Weight of a new measurement in the running average: recent shards dominate after a handful of
# samples (0.3 halves an old figure's weight in about two samples) without one noisy shard
# (a cold cache, a busy neighbour) swinging the next plan entirely.
MEASURED_SMOOTHING = 0.3

SOURCE_MEASURED = "measured"
SOURCE_CATALOG = "catalog"


class RateEstimate(NamedTuple):
    """Rows per second of one device, and where the figure comes from (TargetPlan.rate_source)."""

    rows_per_second: float
    source: str  # SOURCE_MEASURED or SOURCE_CATALOG


class Target(NamedTuple):
    """One target type of a job: what its devices are and what the rule builds them in. A named
    tuple, not a dataclass: a job over 80,000 devices makes one per device (half the cost)."""

    target_type: str  # TargetType.key
    performance: Performance
    compute_dtype: str  # the rule's BuildOptions.compute_dtype


def flops_per_row(program: Program) -> float | None:
    """FLOPs to process one row: the sum of the layers' per-sample estimates; None if unknown."""
    total = sum(layer.flops_per_sample for layer in program.layers)
    return total if total > 0 else None


class ThroughputModel:
    """Per (program ref, target type key) measured rates, with the catalog as the fallback.

    Thread-safe: shards finish on many threads and each records its rate while planners read.
    """

    def __init__(self, *, efficiency: float = CATALOG_EFFICIENCY, smoothing: float = MEASURED_SMOOTHING):
        if not 0 < efficiency <= 1:
            raise InvalidArgument(f"efficiency must be in (0, 1], got {efficiency!r}")
        if not 0 < smoothing <= 1:
            raise InvalidArgument(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.efficiency = efficiency
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._measured: dict[tuple[str, str], tuple[float, float]] = {}  # decayed (rows, seconds) sums

    def record(self, program_ref: str, target_type: str, rows: int, seconds: float) -> float:
        """Fold a finished shard in; returns the new rate.

        The rate is decayed total rows over decayed total seconds, so each shard counts in
        proportion to its size: a tiny shard, whose time is mostly fixed costs and contention,
        cannot drag the estimate the way an average of per-shard rates would let it.
        """
        if rows <= 0:
            raise InvalidArgument(f"rows must be positive to record a rate, got {rows!r}")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise InvalidArgument(f"seconds must be a positive finite number to record a rate, got {seconds!r}")
        key = (program_ref, target_type)
        keep = 1.0 - self.smoothing
        with self._lock:
            total_rows, total_seconds = self._measured.get(key, (0.0, 0.0))
            total_rows, total_seconds = keep * total_rows + rows, keep * total_seconds + seconds
            self._measured[key] = (total_rows, total_seconds)
        return total_rows / total_seconds

    def measured(self, program_ref: str, target_type: str) -> float | None:
        with self._lock:
            sums = self._measured.get((program_ref, target_type))
        return None if sums is None else sums[0] / sums[1]

    def rate(
        self,
        program_ref: str,
        target_type: str,
        performance: Performance,
        compute_dtype: str,
        *,
        flops_per_row: float | None = None,
    ) -> RateEstimate:
        """Rows/s of one device of ``target_type`` running ``program_ref`` built with ``compute_dtype``.

        Without a measurement: peak TFLOP/s at the rule's compute dtype x efficiency / FLOPs per row.
        Without a FLOP estimate either, the peak rate itself stands in: not rows per second, but
        a relative speed, which is all the proportions of a split need as long as no other device
        of the job has a measured rate; ``rates`` prices a mixed job consistently.
        """
        measured = self.measured(program_ref, target_type)
        if measured is not None:
            return RateEstimate(measured, SOURCE_MEASURED)
        return RateEstimate(self.catalog_rate(performance, compute_dtype, flops_per_row=flops_per_row), SOURCE_CATALOG)

    def rates(self, program_ref: str, targets: Sequence[Target], *,
              flops_per_row: float | None = None) -> dict[str, RateEstimate]:
        """Rates of every target type of one job, all in rows per second.

        Without a FLOP estimate, catalog figures are relative speeds (TFLOP/s) and would be out of
        scale next to measured rows/s. So measured types calibrate the program's FLOPs per row
        (peak x efficiency / measured rate; geometric mean over them) and the unmeasured types
        are priced with it: one slow type measured still lets the fast unmeasured ones get their
        share.
        """
        measured = {t.target_type: self.measured(program_ref, t.target_type) for t in targets}
        if flops_per_row is None:
            implied = [math.log(self.catalog_rate(t.performance, t.compute_dtype, flops_per_row=1.0) / rate)
                       for t in targets if (rate := measured[t.target_type]) is not None]
            flops_per_row = math.exp(sum(implied) / len(implied)) if implied else None
        estimates = {}
        for t in targets:
            rate = measured[t.target_type]
            estimates[t.target_type] = RateEstimate(rate, SOURCE_MEASURED) if rate is not None else RateEstimate(
                self.catalog_rate(t.performance, t.compute_dtype, flops_per_row=flops_per_row), SOURCE_CATALOG)
        return estimates

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
