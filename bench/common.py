"""What every benchmark shares: progress on stderr, timing, nearest-rank statistics, ratios.

Benchmarks run as scripts (`python bench/<name>.py`), so this folder is on sys.path and they
import this module as `common`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import numpy as np

MIB = 1 << 20


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


def fresh_memory(nbytes: int = 256 * MIB, idle_s: float = 6.0) -> dict:
    """How fast this process can write memory it has just been given, twice: right after freeing
    a block of the same size (the kernel hands back pages it had a moment ago), and after `idle_s`
    seconds with the block freed. On a bare host the two are alike (a few GB/s: the kernel zeroes
    each page). On a virtual machine whose balloon reports free pages to its host (free page
    reporting), the second is what a process pays for memory it touches first after a pause, and
    it can be fifty times slower; then a streaming figure depends on how much fresh memory each
    side touches, not on its code alone. Measured on the 2-core development VM: 5-6 GB/s
    recycled, 74-125 MB/s after idle for 256 MiB blocks every time, and for 64 MiB blocks only
    some of the time (the host takes free memory back in large batches): so the default block is
    as large as the streaming benchmark's output."""
    source = np.ones(nbytes, np.uint8)

    def fill() -> float:
        start = time.perf_counter()
        block = np.empty(nbytes, np.uint8)
        block[:] = source  # every page touched once, as a received tensor's buffer is
        seconds = time.perf_counter() - start
        if int(block[-1]) != 1:
            raise AssertionError("the block was not written")
        return seconds

    fill()  # the block's pages taken once: the next fill is given them back
    recycled = fill()
    time.sleep(idle_s)
    after_idle = fill()
    return {
        "bytes": nbytes, "idle_s": idle_s,
        "recycled_mb_per_s": round(nbytes / 1e6 / recycled, 1),
        "after_idle_mb_per_s": round(nbytes / 1e6 / after_idle, 1),
        "ratio_after_idle_over_recycled": ratio(recycled, after_idle),
    }
