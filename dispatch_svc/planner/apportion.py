"""Splitting a whole number of rows among devices by their rates.

With rates r_i (sum R) and N rows, the continuous (LP) optimum gives device i exactly
q_i = N r_i / R rows, and every device finishes at T* = N / R, so no integer split can beat T*.

``proportional_rows`` (largest remainder) gives each device floor(q_i) or floor(q_i) + 1 rows,
so device i finishes by (q_i + 1) / r_i = T* + 1 / r_i: at most one of its own row-times after
the LP optimum, hence within one row-time of the integer optimum too. It can still hand a very
slow device its single row (q_i = 0.6 rounds up) and make that device the bottleneck.

``min_makespan_rows`` is the exact integer optimum: a device's j-th row finishes at j / r_i, and
the makespan of any split is the latest row it uses, so the best split takes the N earliest
(device, j) slots. All slots j <= floor(q_i) finish by T*, and there are at most N of them, so
they all belong to the N earliest; the rest (fewer than one per device) are the earliest of the
later slots, ties to the earlier device.

Both work on numpy arrays (a job over 80,000 devices is split in milliseconds) and reproduce,
operation for operation, the float arithmetic of the plain loops they replaced, so a split does
not depend on which of the two computed it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def proportional_rows(total_rows: int, rates: Sequence[float]) -> list[int]:
    """Rows per device proportional to ``rates``, rounded by largest remainder (ties: earlier first)."""
    return proportional_array(total_rows, np.asarray(rates, float)).tolist()


def min_makespan_rows(total_rows: int, rates: Sequence[float]) -> list[int]:
    """The integer split with the smallest makespan max_i rows_i / rate_i (ties: earlier device)."""
    return min_makespan_array(total_rows, np.asarray(rates, float)).tolist()


def proportional_array(total_rows: int, rates: np.ndarray) -> np.ndarray:
    """``proportional_rows`` over an array of rates; an int64 array of rows."""
    quotas = total_rows * rates / math.fsum(rates)
    rows = quotas.astype(np.int64)  # truncation, as int() of a non-negative quota
    order = np.lexsort((np.arange(len(rates)), -(quotas - rows)))
    # In exact arithmetic fewer rows than devices are left over, so one pass suffices; the loop
    # and the trim only guard against float rounding of the quotas: rows always sum to total_rows.
    while (leftover := total_rows - int(rows.sum())) > 0:
        rows[order[:leftover]] += 1
    _trim(rows, total_rows, rates)
    return rows


def min_makespan_array(total_rows: int, rates: np.ndarray) -> np.ndarray:
    """``min_makespan_rows`` over an array of rates; an int64 array of rows. The rows beyond each
    floor(q_i) go to the earliest slots (rows_i + m) / r_i, m >= 1, ties to the earlier device:
    the order a heap of each device's next slot would hand them out in."""
    rows = (total_rows * rates / math.fsum(rates)).astype(np.int64)
    _trim(rows, total_rows, rates)
    left = total_rows - int(rows.sum())
    if left <= 0:
        return rows
    # Every device's next slot; the left-th earliest of them bounds the slots to choose from.
    first = (rows + 1) / rates
    bound = np.partition(first, left - 1)[left - 1] if left < len(first) else first.max()
    slots = _slots_until(rows, rates, bound)  # per device, how many of its slots finish by the bound
    device = np.repeat(np.arange(len(rates)), slots)
    extra = np.arange(len(device)) - np.repeat(np.cumsum(slots) - slots, slots) + 1  # m = 1, 2, ... per device
    times = (rows[device] + extra) / rates[device]
    chosen = device[np.lexsort((device, times))[:left]]
    rows += np.bincount(chosen, minlength=len(rates))
    return rows


def _slots_until(rows: np.ndarray, rates: np.ndarray, bound: float) -> np.ndarray:
    """For each device the largest m >= 0 with (rows + m) / rate <= bound, in float arithmetic."""
    m = np.maximum(np.floor(bound * rates - rows), 0).astype(np.int64)
    while (up := (rows + m + 1) / rates <= bound).any():  # the estimate's rounding, corrected both ways
        m += up
    while (down := (m > 0) & ((rows + m) / rates > bound)).any():
        m -= down
    return m


def makespan(rows: Sequence[int], rates: Sequence[float]) -> float:
    """Seconds until the slowest device finishes its rows (devices run in parallel)."""
    rows, rates = np.asarray(rows, np.int64), np.asarray(rates, float)
    used = rows != 0
    return float((rows[used] / rates[used]).max()) if used.any() else 0.0


def equal_rows(total_rows: int, count: int) -> list[int]:
    """Equal shares, the first ``total_rows % count`` devices taking one row more."""
    return equal_array(total_rows, count).tolist()


def equal_array(total_rows: int, count: int) -> np.ndarray:
    base, extra = divmod(total_rows, count)
    rows = np.full(count, base, np.int64)
    rows[:extra] += 1
    return rows


def _trim(rows: np.ndarray, total_rows: int, rates: np.ndarray) -> None:
    """Take back rows a float overshoot handed out, from the devices that finish last."""
    while int(rows.sum()) > total_rows:
        finish = np.where(rows > 0, rows / rates, -np.inf)
        rows[int(np.argmax(finish))] -= 1
