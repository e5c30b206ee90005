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
they all belong to the N earliest; a heap picks the rest (fewer than one per device).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def proportional_rows(total_rows: int, rates: Sequence[float]) -> list[int]:
    """Rows per device proportional to ``rates``, rounded by largest remainder (ties: earlier first)."""
    total_rate = math.fsum(rates)
    quotas = [total_rows * rate / total_rate for rate in rates]
    rows = [int(quota) for quota in quotas]
    order = sorted(range(len(rates)), key=lambda i: (-(quotas[i] - rows[i]), i))
    # In exact arithmetic fewer rows than devices are left over, so one pass suffices; the loop
    # and the trim only guard against float rounding of the quotas: rows always sum to total_rows.
    while (leftover := total_rows - sum(rows)) > 0:
        for i in order[:leftover]:
            rows[i] += 1
    _trim(rows, total_rows, rates)
    return rows


def min_makespan_rows(total_rows: int, rates: Sequence[float]) -> list[int]:
    """The integer split with the smallest makespan max_i rows_i / rate_i (ties: earlier device)."""
    total_rate = math.fsum(rates)
    rows = [int(total_rows * rate / total_rate) for rate in rates]
    _trim(rows, total_rows, rates)
    heap = [((rows[i] + 1) / rate, i) for i, rate in enumerate(rates)]
    heapq.heapify(heap)
    for _ in range(total_rows - sum(rows)):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        heapq.heappush(heap, ((rows[i] + 1) / rates[i], i))
    return rows


def makespan(rows: Sequence[int], rates: Sequence[float]) -> float:
    """Seconds until the slowest device finishes its rows (devices run in parallel)."""
    return max((n / rate for n, rate in zip(rows, rates) if n), default=0.0)


def equal_rows(total_rows: int, count: int) -> list[int]:
    """Equal shares, the first ``total_rows % count`` devices taking one row more."""
    base, extra = divmod(total_rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _trim(rows: list[int], total_rows: int, rates: Sequence[float]) -> None:
    """Take back rows a float overshoot handed out, from the devices that finish last."""
    while sum(rows) > total_rows:
        i = max((i for i, n in enumerate(rows) if n), key=lambda i: rows[i] / rates[i])
        rows[i] -= 1
