"""Freed memory goes back to the system (accelmesh/runtime/memory.py): in a fresh process, 150 MiB
freed in 100 KiB blocks below a block still in use stays (mostly) resident until a trim pass, and the
trimming thread hands it back. Linux with glibc (what the mesh's images run); elsewhere the
module has nothing to trim and says so by returning None."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from accelmesh.runtime.memory import _malloc_trim, start_trimming

CHILD = """
import sys, time
from accelmesh.runtime.memory import start_trimming

def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10

base = rss_mib()
blocks = [bytes(100 * 1024) for _ in range(1500)]  # under the mmap threshold: from the heap
keep = blocks[-1]  # in use above the rest, so free() cannot shrink the heap by itself
del blocks
freed = rss_mib()
target = base + (freed - base) // 4
stop = start_trimming(0.05)
deadline = time.monotonic() + 30
while rss_mib() > target and time.monotonic() < deadline:
    time.sleep(0.05)
print(base, freed, rss_mib())
stop.set()
"""


def test_the_trimming_thread_hands_freed_heap_memory_back():
    if platform.system() != "Linux" or _malloc_trim() is None:
        assert start_trimming(0.05) is None
        return
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    base, freed, trimmed = map(int, out.stdout.split())
    # How much of the 150 MiB free() keeps resident by itself varies with the host's glibc and
    # kernel; the test needs a good part of it, and the trim to hand back three quarters of that.
    held = freed - base
    assert held >= 50, f"only {held} MiB of the freed blocks stayed resident: the test measures nothing"
    assert trimmed - base <= held // 4, (
        f"{base} MiB before, {freed} MiB resident after the free, {trimmed} MiB after trimming"
    )


def test_trimming_can_be_turned_off():
    assert start_trimming(0) is None


def _env_without_malloc(**extra: str) -> dict[str, str]:
    """This environment less any MALLOC_* tuning of the caller's (it would decide for the child), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **extra}


HEAP_CHILD = """
import sys
from accelmesh.runtime.memory import bound_heap

def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10

if sys.argv[1] == "bound":
    assert bound_heap()
elif sys.argv[1] == "worker":  # the threshold left to glibc: a worker's setting
    assert bound_heap(fixed_threshold=False)
big = bytearray(8 << 20)  # one big block mapped and freed: glibc's dynamic threshold rises to its size
del big
blocks = [bytearray(4 << 20) for _ in range(40)]  # above the bounded threshold, under the risen one
keep = blocks[-1]
before = rss_mib()
del blocks
print(before, rss_mib())
"""


def test_with_the_heap_bounded_freed_4_mib_blocks_leave_at_once():
    if platform.system() != "Linux" or _malloc_trim() is None:
        return
    env = _env_without_malloc()

    def freed_mib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", HEAP_CHILD, mode], capture_output=True, text=True, timeout=60,
                             check=True, env=env)
        before, after = map(int, out.stdout.split())
        return before - after

    assert freed_mib("dynamic") < 50  # what glibc does by itself: the blocks stay in the heap
    assert freed_mib("bound") >= 140  # with the threshold fixed at 2 MiB: mapped, and unmapped when freed
    assert freed_mib("worker") < 50  # a worker's heap keeps them, for its next execution's outputs


ARENA_CHILD = """
import ctypes, ctypes.util, sys, tempfile, threading
from accelmesh.runtime.memory import bound_heap

bounded = sys.argv[1] == "bound" and bound_heap(arenas=1)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
together = threading.Barrier(4)

def allocate():
    held = [bytearray(64 * 1024) for _ in range(8)]  # under the mmap threshold: from this thread's arena
    together.wait()  # all four threads alive at once, so none hands its arena on to another
    together.wait()

threads = [threading.Thread(target=allocate) for _ in range(3)]
for thread in threads:
    thread.start()
held = [bytearray(64 * 1024) for _ in range(8)]
together.wait()
with tempfile.NamedTemporaryFile() as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(bounded, open(out.name).read().count("<heap nr="))
together.wait()
for thread in threads:
    thread.join()
"""


def _arena_child(mode: str, **environment: str) -> tuple[str, int]:
    env = _env_without_malloc(**environment)
    out = subprocess.run([sys.executable, "-c", ARENA_CHILD, mode], capture_output=True, text=True, timeout=60,
                         check=True, env=env)
    bounded, heaps = out.stdout.split()
    return bounded, int(heaps)


def test_with_the_arenas_bounded_threads_share_one_malloc_arena():
    if platform.system() != "Linux" or _malloc_trim() is None:
        return
    # glibc gives each allocating thread an arena of its own, up to eight per core: four threads
    # allocating at once have more than one on any host; bounded, they share the main one.
    assert _arena_child("dynamic")[1] > 1
    assert _arena_child("bound") == ("True", 1)


def test_the_environment_s_arena_setting_is_left_in_force():
    if platform.system() != "Linux" or _malloc_trim() is None:
        return
    # The operator's MALLOC_ARENA_MAX stays, and bound_heap says it did not set everything.
    assert _arena_child("bound", MALLOC_ARENA_MAX="4") == ("False", 4)
