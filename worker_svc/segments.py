"""The segment files of a worker's object store (objects.py), and the pool that keeps freed ones.

A segment is a file under the store's root (/dev/shm), mode 0600, named for the worker's pid and
128 random bits: unguessable, and `sweep_stale` tells a killed worker's leftovers from a live
worker's. It is allocated in full when made (posix_fallocate): writing into a sparse tmpfs file
that has no room left kills the process with SIGBUS. Mappings are made with MAP_POPULATE, so the
kernel maps every page at once instead of taking a fault per 4 KiB page on first touch.

Making a segment costs more than copying into it: the kernel allocates and zeroes its pages
(4 ms per 16 MiB here), every first touch of a page through a new mapping faults, and even a
small one takes five system calls. A freed object's segment of at least POOL_MIN_BYTES (a page)
therefore goes to a pool instead of being unlinked, and the next object of about its size (up
to half of it unused) *of the same owner* takes it:
mapped again, its pages are there already. Only an owner's own objects reuse its segments, so
what a segment held before (a client's mapping of it, bytes a later write does not cover) stays
that tenant's. Pooled bytes count against the store's bound: a create that needs their room
unlinks the oldest pooled segments first, and a segment left unused for POOL_IDLE_S goes too.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import re
import secrets
import stat
import sys
from dataclasses import dataclass

SEGMENT_PREFIX = "accelmesh-obj-"
# Smaller segments are unlinked when freed. Even a small one costs more to make than to take
# again: 65 us to make and 14 us to unlink a 32 KiB segment here, 15 us to map a pooled one, and
# a job of small direct shards makes two a shard (its input and its output).
POOL_MIN_BYTES = 4096
POOL_IDLE_S = 60.0  # a pooled segment unused this long is unlinked
POOL_MAX_SEGMENTS = 1024  # pooled segments hold no descriptor or mapping; this bounds the lists
_SEGMENT = re.compile(rf"^{SEGMENT_PREFIX}(\d+)-[0-9a-f]{{32}}$")
_FLAGS = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in as they are touched
# From 3.13 a mapping need not keep a duplicate of its file descriptor.
_MMAP_OPTIONS = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def make_segment(root: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """A new segment of `nbytes` under `root`, allocated in full, and its mapping."""
    path = os.path.join(root, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, _FLAGS, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:  # a umask may have narrowed it
            os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        return path, _map(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_segment(path: str, nbytes: int) -> mmap.mmap:
    """A pooled segment mapped again for an object of `nbytes` (at most its size)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE, **_MMAP_OPTIONS)


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True)
class Pooled:
    path: str
    capacity: int  # the file's size: objects of capacity // 2 + 1 .. capacity bytes take it
    since: float  # when it was pooled (the store's clock)


class SegmentPool:
    """Freed segments by owner, and within an owner by capacity (sorted, so a take is a bisection
    however many are pooled). Not thread-safe: the store calls it under its lock."""

    def __init__(self):
        self._by_owner: dict[str, dict[int, list[Pooled]]] = {}  # owner -> capacity -> pooled, oldest first
        self._capacities: dict[str, list[int]] = {}  # owner -> its pooled capacities, ascending
        self.bytes = self.count = 0

    def give(self, owner: str, path: str, capacity: int, now: float) -> bool:
        """Keep a freed segment (its mapping closed) for `owner`; False when it is not kept (the caller unlinks)."""
        if capacity < POOL_MIN_BYTES or self.count >= POOL_MAX_SEGMENTS:
            return False
        sizes = self._by_owner.setdefault(owner, {})
        if capacity not in sizes:
            sizes[capacity] = []
            bisect.insort(self._capacities.setdefault(owner, []), capacity)
        sizes[capacity].append(Pooled(path, capacity, now))
        self.bytes += capacity
        self.count += 1
        return True

    def take(self, owner: str, nbytes: int, room: int) -> Pooled | None:
        """The smallest of `owner`'s segments that holds `nbytes` with at most half of it unused,
        and no more than `room` bytes (what the store's bound has left); of those, the one
        pooled last (its pages are the likeliest to be in a cache)."""
        capacities = self._capacities.get(owner)
        if not capacities:
            return None
        at = bisect.bisect_left(capacities, nbytes)
        if at == len(capacities) or capacities[at] > min(2 * nbytes, room):
            return None
        return self._remove(owner, self._by_owner[owner][capacities[at]][-1], last=True)

    def _all(self):
        return ((owner, p) for owner, sizes in self._by_owner.items() for ps in sizes.values() for p in ps)

    def evict(self, excess: int) -> None:
        """Unlink the oldest pooled segments until at least `excess` bytes of them are gone."""
        while excess > 0 and self.count:
            owner, oldest = min(self._all(), key=lambda op: op[1].since)
            self._remove(owner, oldest)
            unlink(oldest.path)
            excess -= oldest.capacity

    def trim(self, now: float, idle_s: float = POOL_IDLE_S) -> None:
        """Unlink the segments pooled for `idle_s` or longer."""
        for owner, p in [(o, p) for o, p in self._all() if now - p.since >= idle_s]:
            self._remove(owner, p)
            unlink(p.path)

    def clear(self) -> None:
        self.evict(self.bytes + 1)

    def _remove(self, owner: str, pooled: Pooled, last: bool = False) -> Pooled:
        sizes = self._by_owner[owner]
        entries = sizes[pooled.capacity]
        if last:  # a take: no search among the segments of its size
            entries.pop()
        else:
            entries.remove(pooled)
        if not entries:
            del sizes[pooled.capacity]
            self._capacities[owner].remove(pooled.capacity)
        if not sizes:
            del self._by_owner[owner], self._capacities[owner]
        self.bytes -= pooled.capacity
        self.count -= 1
        return pooled


def sweep_stale(root: str = "/dev/shm") -> int:
    """Remove the segments of workers that are gone (killed before `close`): files of this uid
    named for a pid that no process has. A reused pid keeps its files until the next sweep after
    that process ends. The count removed."""
    removed = 0
    with os.scandir(root) as entries:
        for entry in entries:
            match = _SEGMENT.match(entry.name)
            if match is None or int(match.group(1)) <= 0:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    continue
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
            except (OSError, OverflowError):  # alive under another uid, or gone meanwhile
                continue
    return removed
