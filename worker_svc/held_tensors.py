"""Tensors a worker holds for a job between its shards (ShardHeader.keep_tensors).

A dispatcher sends a job's parameters to a worker once and refers to them by a key of its own
afterwards. They stay host numpy arrays: a device's memory belongs to the shard running on it,
and every shard puts its inputs on the device anyway. Within a byte limit and a count limit the
least recently used go first; a job's tensors go once the job has used none of them for `idle_s`,
because nothing tells a worker that a job ended. Only the dispatcher knows what a key means, and
a key's content never changes within a job (new parameters get new keys): so a key once held
takes no other content (`hold` refuses it), and what a call held goes again if that call fails
(`forget`), so that no refused call changes what a running job's later shards compute with.

Everything the store keeps is bounded: tensors by `max_bytes` (their data) and `max_tensors`
(their entries, which cost memory even for empty tensors), jobs by the tensors (a job is known
only while it holds one), keys and job ids by MAX_KEY_CHARS (checked where requests are read).
A dropped tensor is no error here: the dispatcher's next reference to it is answered
TENSOR_NOT_HELD and it sends the tensor in full (dispatch_svc/dataplane/held_keys.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Default for ACCELMESH_WORKER_HELD_TENSORS: tensors held at once, over all jobs. An entry costs
# about a kilobyte beside its data (keys, bookkeeping, the array object), so this caps that part
# near 16 MiB, far above a model's parameter count (a transformer has hundreds of leaves).
MAX_HELD_TENSORS = 16384
# Longest key or job id a tensor is held under (ShardHeader.keep_tensors[].key, ShardHeader.job_id):
# the dispatcher's are "<job>:<parameter path>"; a longer one is refused, not stored.
MAX_KEY_CHARS = 1024


# What HeldTensors.hold did.
KEPT, HELD, OTHER = "kept", "held", "other"


def same_content(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit: the same dtype, shape and bytes (NaNs included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


@dataclass(frozen=True)
class HeldStats:
    tensors: int  # held now
    bytes: int  # held now
    kept: int  # tensors kept since the start
    used: int  # references answered
    missed: int  # references to a tensor not held
    evicted: int  # dropped for the byte or count limit (a tensor larger than the byte limit counts here too)
    expired: int  # dropped because their job went idle
    jobs: int  # jobs holding at least one tensor now


class HeldTensors:
    """Thread-safe: shards of several jobs keep and use tensors at once."""

    def __init__(self, max_bytes: int, idle_s: float, *, max_tensors: int = MAX_HELD_TENSORS,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.max_tensors = max_tensors
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tensors: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()  # least recently used first
        self._jobs: dict[str, set[str]] = {}  # job id -> its keys
        self._last_used: dict[str, float] = {}  # job id -> when one of its tensors was last kept or used
        self._bytes = 0
        self._kept = self._used = self._missed = self._evicted = self._expired = 0

    def keep(self, job_id: str, key: str, array: np.ndarray) -> bool:
        """Hold `array` under (job, key), replacing what was there; False if it is over the byte limit.
        Beyond either limit the least recently used tensors (of any job) are dropped."""
        with self._lock:
            return self._keep(job_id, key, array)

    def hold(self, job_id: str, key: str, array: np.ndarray) -> str:
        """Hold `array` under (job, key) unless that key holds a tensor already: KEPT (held now,
        as `keep`), HELD (the same content was there: only its use is noted) or OTHER (different
        content is there, which stays; nothing is held)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            there = self._tensors.get((job_id, key))
            if there is not None:
                if not same_content(there, array):
                    return OTHER
                self._tensors.move_to_end((job_id, key))
                self._last_used[job_id] = now
                return HELD
            self._keep(job_id, key, array)
            return KEPT

    def forget(self, job_id: str, key: str, array: np.ndarray) -> None:
        """Drop (job, key) if it still holds this very `array` (the one a failed call held)."""
        with self._lock:
            if self._tensors.get((job_id, key)) is array:
                self._drop((job_id, key))

    def get(self, job_id: str, key: str) -> np.ndarray | None:
        """The tensor held under (job, key), or None (never kept, evicted, expired)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            array = self._tensors.get((job_id, key))
            if array is None:
                self._missed += 1
                return None
            self._tensors.move_to_end((job_id, key))
            self._last_used[job_id] = now
            self._used += 1
            return array

    def release(self, job_id: str) -> tuple[int, int]:
        """Drop every tensor held for `job_id` (its scope): the job ended. (tensors, bytes) dropped."""
        with self._lock:
            keys = list(self._jobs.get(job_id, ()))
            before = self._bytes
            for key in keys:
                self._drop((job_id, key))
            self._last_used.pop(job_id, None)
            return len(keys), before - self._bytes

    def expire(self) -> None:
        """Drop the tensors of jobs idle for `idle_s`; keep and get do it too, this is for idle times."""
        with self._lock:
            self._expire(self._clock())

    def stats(self) -> HeldStats:
        with self._lock:
            return HeldStats(len(self._tensors), self._bytes, self._kept, self._used, self._missed, self._evicted,
                             self._expired, len(self._jobs))

    def _keep(self, job_id: str, key: str, array: np.ndarray) -> bool:
        now = self._clock()
        self._expire(now)
        self._drop((job_id, key))
        if array.nbytes > self.max_bytes:
            self._evicted += 1
            return False
        self._tensors[(job_id, key)] = array
        self._jobs.setdefault(job_id, set()).add(key)
        self._last_used[job_id] = now
        self._bytes += array.nbytes
        self._kept += 1
        while self._bytes > self.max_bytes or len(self._tensors) > self.max_tensors:
            oldest = next(iter(self._tensors))
            self._drop(oldest)
            self._evicted += 1
        return True

    def _expire(self, now: float) -> None:
        idle = [job for job, last in self._last_used.items() if now - last >= self.idle_s]
        for job in idle:
            for key in list(self._jobs.get(job, ())):
                self._drop((job, key))
                self._expired += 1
            self._last_used.pop(job, None)

    def _drop(self, entry: tuple[str, str]) -> None:
        array = self._tensors.pop(entry, None)
        if array is None:
            return
        self._bytes -= array.nbytes
        job, key = entry
        keys = self._jobs[job]
        keys.discard(key)
        if not keys:
            del self._jobs[job]
            self._last_used.pop(job, None)
