"""What every benchmark shares: progress on stderr, timing, nearest-rank statistics, ratios.

Benchmarks run as scripts (`python bench/<name>.py`), so this folder is on sys.path and they
import this module as `common`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def time_calls(call: Callable[[], object], n: int, warmup: int) -> list[float]:
    """Wall time of ``n`` calls in ms, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was really measured."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def summary_ms(values: list[float], digits: int = 3) -> dict:
    return {"p50_ms": round(percentile(values, 50), digits), "p95_ms": round(percentile(values, 95), digits),
            "n": len(values)}


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 else None


def tls_vs_plaintext(tls: float, plaintext: float) -> dict:
    """One figure measured with the mesh's security on (mutual TLS + bearer token) and off (plaintext)."""
    return {"tls": tls, "plaintext": plaintext, "ratio_tls_over_plaintext": ratio(tls, plaintext)}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def synthetic_node_ip(index: int) -> str:
    """The index-th address of 10.0.0.0/8, skipping .0: inventory data only, never dialled."""
    n = index + 1
    return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"
