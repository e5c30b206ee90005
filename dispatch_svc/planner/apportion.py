"""Splitting a whole number of rows among devices whose time is affine in their rows.

Device i processing n_i rows takes T_i(n_i) = f_i + n_i / r_i seconds (fixed cost f_i >= 0, rate
r_i rows/s), and nothing when n_i = 0: a device left out pays no fixed cost. With every f_i = 0
this is the plain rate model.

The continuous (LP) optimum fills devices like water: at a level T, device i takes
q_i = (T - f_i) r_i rows if f_i < T, else none, and T* is the level at which the q_i sum to N.
Sorting the devices by f_i, T* = (N + sum f_i r_i) / (sum r_i) over the k cheapest-to-start,
for the largest k whose k-th fixed cost is still below that level (adding a device whose fixed
cost is above the level would only raise it). No integer split can beat T*; with every f_i = 0,
q_i = N r_i / R and T* = N / R.

``proportional_rows`` (largest remainder of the q_i) gives each device floor(q_i) or floor(q_i) + 1
rows, so device i finishes by T* + 1 / r_i: at most one of its own row-times after the LP optimum,
hence within one row-time of the integer optimum too; a device with q_i = 0 gets none. It can
still hand a very slow device its single row (q_i = 0.6 rounds up) and make it the bottleneck.

``min_makespan_rows`` is the exact integer optimum: a device's j-th row finishes at f_i + j / r_i,
which grows with j, and the makespan of any split is the latest row it uses, so the best split
takes the N earliest (device, j) slots. All slots j <= floor(q_i) finish by T*, and there are at
most N of them, so they all belong to the N earliest; the rest (fewer than one per device) are the
earliest of the later slots, ties to the earlier device.

Both work on numpy arrays (a job over 80,000 devices is split in milliseconds) and, with no fixed
costs, reproduce operation for operation the float arithmetic of the plain loops they replaced,
so a split does not depend on which of the two computed it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def proportional_rows(total_rows: int, rates: Sequence[float], fixed: Sequence[float] | None = None) -> list[int]:
    """Rows per device from the LP optimum's quotas, rounded by largest remainder (ties: earlier first)."""
    return proportional_array(total_rows, np.asarray(rates, float), _fixed(fixed)).tolist()


def min_makespan_rows(total_rows: int, rates: Sequence[float], fixed: Sequence[float] | None = None) -> list[int]:
    """The integer split with the smallest makespan max_i f_i + rows_i / rate_i over the devices
    given rows (ties: earlier device)."""
    return min_makespan_array(total_rows, np.asarray(rates, float), _fixed(fixed)).tolist()


def quotas(total_rows: int, rates: np.ndarray, fixed: np.ndarray | None = None) -> np.ndarray:
    """The LP optimum's rows per device (floats summing to ``total_rows``), by water-filling."""
    if fixed is None or not fixed.any():
        return total_rows * rates / math.fsum(rates)
    order = np.lexsort((np.arange(len(rates)), fixed))
    f, r = fixed[order], rates[order]
    with np.errstate(over="ignore", invalid="ignore"):  # rates near the float limit: _sane takes over
        levels = (total_rows + np.cumsum(f * r)) / np.cumsum(r)  # T* if the first k devices take rows
        # The devices below their level form a prefix (the first always is, as N > 0); the last one's
        # level is T*. Clamped at 0: a device at or above the level gets nothing.
        below = np.flatnonzero(f < levels)
        level = levels[int(below[-1])] if len(below) else levels[0]  # none: N / r too small to show next to f
        shares = np.maximum((level - fixed) * rates, 0.0)
    return _sane(shares, total_rows, rates)


def _sane(shares: np.ndarray, total_rows: int, rates: np.ndarray) -> np.ndarray:
    """The water-filling's shares, or, where float arithmetic lost them (a rate so large that
    N / r vanishes next to a fixed cost: a level minus a fixed cost then cancels to nothing or
    to garbage), shares by rate alone: every share finite, none above the job, summing to it
    within a row per device, which the rounding after it can settle. A device measured
    absurdly fast once made a quota of 1e183 rows, an int64 of garbage and a loop that never
    ended."""
    shares = np.clip(np.nan_to_num(shares, nan=0.0, posinf=float(total_rows)), 0.0, float(total_rows))
    if abs(math.fsum(shares) - total_rows) <= len(shares):
        return shares
    weights = rates / rates.max()  # the largest 1: no overflow in the sum
    return total_rows * weights / math.fsum(weights)


def proportional_array(total_rows: int, rates: np.ndarray, fixed: np.ndarray | None = None) -> np.ndarray:
    """``proportional_rows`` over arrays; an int64 array of rows."""
    shares = quotas(total_rows, rates, fixed)
    rows = shares.astype(np.int64)  # truncation, as int() of a non-negative quota
    order = np.lexsort((np.arange(len(rates)), -(shares - rows)))
    # In exact arithmetic fewer rows than devices with a positive remainder are left over, so one
    # pass suffices and no device without a quota gets a row; the loop and the trim only guard
    # against float rounding of the quotas: rows always sum to total_rows.
    while (leftover := total_rows - int(rows.sum())) > 0:
        rows[order[:leftover]] += 1
    _trim(rows, total_rows, rates, fixed)
    return rows


def min_makespan_array(total_rows: int, rates: np.ndarray, fixed: np.ndarray | None = None) -> np.ndarray:
    """``min_makespan_rows`` over arrays; an int64 array of rows. The rows beyond each floor(q_i)
    go to the earliest slots f_i + (rows_i + m) / r_i, m >= 1, ties to the earlier device: the
    order a heap of each device's next slot would hand them out in."""
    offset = np.zeros(len(rates)) if fixed is None else fixed
    rows = quotas(total_rows, rates, fixed).astype(np.int64)
    _trim(rows, total_rows, rates, fixed)
    left = total_rows - int(rows.sum())
    if left <= 0:
        return rows
    # Every device's next slot; the left-th earliest of them bounds the slots to choose from.
    first = offset + (rows + 1) / rates
    bound = np.partition(first, left - 1)[left - 1] if left < len(first) else first.max()
    # Per device, how many of its slots finish by the bound (none needs more than `left`). A device
    # far faster than the rest would still list (bound - T*) x rate of them, millions: then the
    # bound comes down, by bisection, to where little more than `left` slots finish by it.
    slots = np.minimum(_slots_until(rows, rates, offset, bound), left)
    if int(slots.sum()) > SLOTS_PER_ROW_LEFT * left + len(rates):
        low, high = float(first.min()), bound
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            if middle in (low, high):
                break
            if int(np.minimum(_slots_until(rows, rates, offset, middle), left).sum()) >= left:
                high = middle
            else:
                low = middle
        slots = np.minimum(_slots_until(rows, rates, offset, high), left)
    device = np.repeat(np.arange(len(rates)), slots)
    extra = np.arange(len(device)) - np.repeat(np.cumsum(slots) - slots, slots) + 1  # m = 1, 2, ... per device
    times = offset[device] + (rows[device] + extra) / rates[device]
    chosen = device[np.lexsort((device, times))[:left]]
    rows += np.bincount(chosen, minlength=len(rates))
    return rows


SLOTS_PER_ROW_LEFT = 4  # slots listed per row still to place before the bound is narrowed
BISECTIONS = 200  # halvings of the bound at most (a float interval closes within ~1,100)


def _slots_until(rows: np.ndarray, rates: np.ndarray, fixed: np.ndarray, bound: float) -> np.ndarray:
    """For each device the largest m >= 0 with f + (rows + m) / rate <= bound, in float arithmetic."""
    m = np.maximum(np.floor((bound - fixed) * rates - rows), 0).astype(np.int64)
    while (up := fixed + (rows + m + 1) / rates <= bound).any():  # the estimate's rounding, corrected both ways
        m += up
    while (down := (m > 0) & (fixed + (rows + m) / rates > bound)).any():
        m -= down
    return m


def makespan(rows: Sequence[int], rates: Sequence[float], fixed: Sequence[float] | None = None) -> float:
    """Seconds until the slowest device finishes its rows (devices run in parallel); a device
    given rows pays its fixed cost, one left out does not."""
    rows, rates = np.asarray(rows, np.int64), np.asarray(rates, float)
    used = rows != 0
    if not used.any():
        return 0.0
    seconds = rows[used] / rates[used]
    if fixed is not None:
        seconds = np.asarray(fixed, float)[used] + seconds
    return float(seconds.max())


def equal_rows(total_rows: int, count: int) -> list[int]:
    """Equal shares, the first ``total_rows % count`` devices taking one row more."""
    return equal_array(total_rows, count).tolist()


def equal_array(total_rows: int, count: int) -> np.ndarray:
    base, extra = divmod(total_rows, count)
    rows = np.full(count, base, np.int64)
    rows[:extra] += 1
    return rows


def _trim(rows: np.ndarray, total_rows: int, rates: np.ndarray, fixed: np.ndarray | None) -> None:
    """Take back rows a float overshoot handed out, from the devices that finish last."""
    while int(rows.sum()) > total_rows:
        finish = rows / rates if fixed is None else fixed + rows / rates
        rows[int(np.argmax(np.where(rows > 0, finish, -np.inf)))] -= 1


def _fixed(fixed: Sequence[float] | None) -> np.ndarray | None:
    return None if fixed is None else np.asarray(fixed, float)
