"""Giving freed memory back to the system, so a service's resident memory follows what it holds.

glibc's malloc serves a block of at least its mmap threshold with a mapping of its own, unmapped
when freed; smaller blocks come from heap arenas, where freed memory stays resident for reuse.
The threshold is dynamic by default: once a mapped block is freed, blocks up to its size (as much
as 32 MiB) come from the arenas too. A service that passes tensors, shard inputs and artifacts of
megabytes through many threads then stays near its bursts' high-water mark. Measured: every
process 20-50% above its memory after the fuzz benchmark's warm-up with Python's own objects
flat; four failed 32 MiB jobs left the dispatcher at 1.41x (bench/abuse.py). So:

- ``bound_heap`` fixes the threshold at MMAP_THRESHOLD_BYTES (mallopt, which also turns the
  dynamic adjustment off): a block above it is mapped and returned when freed. 2 MiB sits above
  the mesh's 1 MiB stream chunks, which stay in the arenas and are reused at full speed: with the
  threshold at glibc's own 128 KiB every chunk paid a mapping and its page faults, and the
  dispatcher's streaming halved (54 against 115 MB/s, bench/dispatch.py --quick); at 2 MiB its
  ratio to bare gRPC was the dynamic threshold's (0.248 against 0.247) and the failed jobs left
  it at 1.02x. MALLOC_MMAP_THRESHOLD_ in the environment still wins;
- ``bound_heap(arenas=N)`` also caps glibc's malloc arenas at N (M_ARENA_MAX). glibc gives
  each thread that allocates an arena of its own, up to eight per core, and each keeps its own
  freed memory resident. The dispatcher is a relay: gRPC's threads and its own pass the same
  chunks around under one GIL, so one arena costs it no speed and holds less. Streaming 256 MiB
  through it (its in-flight budget 64 MiB), its largest rise was 119-138 MiB with the default
  arenas and 89-106 MiB with one, at the same or better throughput and per-shard cost
  (alternating runs, 2026-12-04). Services that compute (a worker's XLA threads) keep glibc's
  default. MALLOC_ARENA_MAX in the environment still wins;
- ``bound_heap(fixed_threshold=False)`` leaves the threshold to glibc: the worker's way. Its XLA
  executions each allocate their outputs (megabytes a shard, fresh every call); with the threshold
  fixed, each is a new mapping paying a page fault per 4 KiB. A 16 MiB identity on jax's CPU ran
  in 13-15 ms so against 3-4 ms with glibc's dynamic threshold (alternating runs, 2026-12-07), and
  the worker's CPU for a 256 MiB DATA_PATH_DIRECT job fell from 0.37 to 0.26 s. Setting a larger
  fixed threshold is no cure: mallopt also fixes the trim threshold at 128 KiB, so the freed
  outputs at the heap's top are handed back and faulted in again (7 ms). What the worker's heap
  keeps after a burst goes back at the next trimming pass;
- ``start_trimming`` runs ``malloc_trim(0)`` every ``TRIM_INTERVAL_S`` on a thread, handing back
  whole free pages of the arenas (madvise), a few milliseconds a pass.

Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 2.0
TRIM_ENV = "ACCELMESH_MALLOC_TRIM_S"  # seconds between passes; 0 turns them off


M_MMAP_THRESHOLD = -3  # <malloc.h>
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 2 * 1024 * 1024  # above the 1 MiB stream chunks (see the docstring)


def _libc_function(name: str):
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def _malloc_trim():
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def bound_heap(arenas: int | None = None, fixed_threshold: bool = True) -> bool:
    """Large blocks always mapped and unmapped when freed (unless not `fixed_threshold`), and with
    `arenas`, at most that many malloc arenas (see the module docstring); whether all of it was
    set. Call it before the service's threads start."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    wanted = {M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD_BYTES)} if fixed_threshold else {}
    if arenas is not None:
        wanted[M_ARENA_MAX] = ("MALLOC_ARENA_MAX", arenas)
    # Each in turn (no short cut): the environment's value, where set, is the one left in force.
    return all([not os.environ.get(variable) and mallopt(option, value) == 1
                for option, (variable, value) in wanted.items()])


def start_trimming(interval_s: float | None = None) -> threading.Event | None:
    """Trim every ``interval_s`` (default: ``ACCELMESH_MALLOC_TRIM_S``, else TRIM_INTERVAL_S) on a
    daemon thread until the returned event is set; None where there is nothing to trim."""
    if interval_s is None:
        interval_s = float(os.environ.get(TRIM_ENV) or TRIM_INTERVAL_S)
    trim = _malloc_trim()
    if trim is None or interval_s <= 0:
        return None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=run, name="malloc-trim", daemon=True).start()
    return stop


__all__ = ["TRIM_ENV", "TRIM_INTERVAL_S", "bound_heap", "start_trimming"]
