"""A worker's object store: a job's input tensors and its shards' outputs, in shared memory.

Tensor bytes no longer pass through the dispatcher: a client puts a job's inputs on the worker
that runs its shards, the shards run on views of them, and their outputs wait here until the
client fetches them or the job ends. Each object is one segment file under `root` (/dev/shm;
segments.py), mapped once: a client on the same host (and uid) maps the one file it is handed,
which gives it that object and no other; the servicer `write`s what clients on other hosts
stream. A freed object's segment is unlinked, or, from 1 MiB, pooled for the next object of the
same owner (segments.py says why and what that keeps apart).

An object is written, sealed, then only read (`get` answers sealed ones), so no shard sees half an
input; what a same-host client does to its own mapping after the seal changes its owner's jobs
only. Everything is bounded: live and pooled segments' bytes by `limit_bytes` (a create that does
not fit waits up to `wait_s` for releases, then is refused), live objects' number by
`max_objects` (each holds a mapping and, before Python 3.13, a file descriptor), ids by
MAX_KEY_CHARS. A client may vanish without ending its job, so a scope none of whose objects was
created, sealed or got for `ttl_s` goes whole, as held_tensors' idle jobs do. A view still in use
when its object is freed keeps its pages until it is collected (its segment is not pooled).
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from accelmesh import errors
from accelmesh.runtime.tensors import check_array_shape
from worker_svc.held_tensors import MAX_KEY_CHARS
from worker_svc.segments import POOL_MIN_BYTES, SegmentPool, make_segment, map_segment, unlink

BYTES_ENV = "ACCELMESH_WORKER_STORE_BYTES"  # limit_bytes
TTL_ENV = "ACCELMESH_WORKER_STORE_TTL_S"  # ttl_s
OBJECTS_ENV = "ACCELMESH_WORKER_STORE_OBJECTS"  # max_objects
MAX_OBJECTS = 65536
MAX_DRAINING = 256  # freed objects at most waiting for their views to go before their segments are pooled
MAX_DIMS = 32  # numpy 1.x's limit; a view of more dimensions cannot be made everywhere
_NO_ROOM = {errno.ENOSPC: "its filesystem is full (a container's /dev/shm is sized by e.g. --shm-size)",
            errno.ENOMEM: "the host is out of memory",
            errno.EMFILE: "the worker has as many files open as its limit allows (ulimit -n)",
            errno.ENFILE: "the host has as many files open as it allows"}


@dataclass(frozen=True)
class StoreStats:
    objects: int  # live now, sealed or not
    used_bytes: int  # their segments' bytes
    limit_bytes: int
    waiting: int  # creates waiting for room now
    pooled_bytes: int = 0  # freed segments kept for reuse (within limit_bytes with used_bytes)


class StoredObject:
    """One object: an id within a scope (a job), its dtype and shape, and its segment."""

    def __init__(self, scope: str, object_id: str, dtype: np.dtype, shape: tuple[int, ...], nbytes: int):
        self.scope, self.object_id, self.dtype, self.shape, self.nbytes = scope, object_id, dtype, shape, nbytes
        self.path = ""  # the segment file's absolute path; "" for a 0-byte object
        self.capacity = nbytes  # the segment's bytes: more than nbytes when a pooled one was reused
        self._mmap: mmap.mmap | None = None
        self._ready = self._sealed = self._freed = False
        self._lock = threading.Lock()  # a seal waits for the writes in progress

    @property
    def sealed(self) -> bool:
        return self._sealed

    def write(self, offset: int, data) -> None:
        """Copy the bytes-like `data` into the object at byte `offset` (the store's lock is not held)."""
        try:
            source = memoryview(data).cast("B")
        except TypeError:
            raise errors.InvalidArgument("data must be contiguous bytes (bytes, bytearray, a C-ordered array)",
                                         field="data") from None
        offset = operator.index(offset)
        if offset < 0 or offset + len(source) > self.nbytes:
            raise errors.InvalidArgument(
                f"offset {offset} with {len(source)} bytes does not fall within object {self._name()}, which has "
                f"{self.nbytes} bytes: write within [0, {self.nbytes})", field="offset")
        with self._lock:
            target = self._bytes() if self.nbytes else None  # NotFound once released, sealed or not
            if self._sealed:
                raise errors.FailedPrecondition(f"object {self._name()} is sealed: objects are written once")
            if len(source):
                target[offset:offset + len(source)] = np.frombuffer(source, np.uint8)

    def array(self) -> np.ndarray:
        """A read-only view of the object's bytes as its dtype and shape; no copy."""
        view = self._bytes().view(self.dtype).reshape(self.shape) if self.nbytes else np.empty(self.shape, self.dtype)
        view.flags.writeable = False
        return view

    def _bytes(self) -> np.ndarray:
        mapping = self._mmap
        with contextlib.suppress(ValueError):  # closed by a release in the meantime
            if mapping is not None and not self._freed:
                return np.frombuffer(mapping, np.uint8, count=self.nbytes)
        raise errors.NotFound(f"object {self._name()} was released: put it again", field="object_id")

    def _copy_in(self, array: np.ndarray) -> None:
        with self._lock:
            if self.nbytes:
                np.copyto(self._bytes().view(self.dtype).reshape(self.shape), array, casting="no")

    def _name(self) -> str:
        return f"{errors.quoted(self.object_id)} of scope {errors.quoted(self.scope)}"

    def _free(self) -> bool:
        """Unmap; False when a view still exports the mapping (kept then: a later try may unmap it,
        or collecting the last view does)."""
        self._freed = True
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                return False
            self._mmap = None
        return True


class ObjectStore:
    """Thread-safe: one lock (and its condition, for creates waiting for room) over every scope."""

    def __init__(self, limit_bytes: int, *, root: str = "/dev/shm", ttl_s: float = 900.0, wait_s: float = 30.0,
                 max_objects: int = MAX_OBJECTS, clock: Callable[[], float] = time.monotonic):
        self.limit_bytes, self.max_objects = limit_bytes, max_objects
        self.root, self.ttl_s, self.wait_s = os.path.abspath(root), ttl_s, wait_s
        self._clock = clock  # for expiry; waits for room run on real time, whatever the clock
        self._changed = threading.Condition(threading.Lock())
        self._scopes: dict[str, dict[str, StoredObject]] = {}  # scope -> object id -> object
        self._last_used: dict[str, float] = {}  # scope -> when one of its objects was last created or got
        self._count = self._used = self._waiting = 0
        self._pool = SegmentPool()
        # Freed objects whose views were still in use (most often the worker's own, of a shard's
        # inputs freed as it finished): pooled once the views are gone, looked at again at each
        # create and expiry.
        self._draining: list[StoredObject] = []
        self._closed = False

    def create(self, scope: str, object_id: str, dtype, shape, *, wait_s: float | None = None) -> StoredObject:
        """A new, empty, unsealed object; waits up to `wait_s` (default the store's) for room."""
        obj = StoredObject(_checked_id("scope", scope), _checked_id("object_id", object_id), *_layout(dtype, shape))
        wait_s = self.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._drain()
            self._expire(self._clock())
            self._check_new(obj)
            if obj.nbytes > self.limit_bytes:
                raise self._full(obj, "more than the whole store holds")
            while self._used + obj.nbytes > self.limit_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._full(obj, f"and no room came free within {wait_s:g} s")
                self._waiting += 1
                try:
                    self._changed.wait(left)
                finally:
                    self._waiting -= 1
                self._expire(self._clock())
                self._check_new(obj)
            self._scopes.setdefault(scope, {})[object_id] = obj  # held while its segment is made: ids stay unique
            pooled = (self._pool.take(_owner(scope), obj.nbytes, self.limit_bytes - self._used)
                      if obj.nbytes >= POOL_MIN_BYTES else None)
            obj.capacity = pooled.capacity if pooled is not None else obj.nbytes
            self._count += 1
            self._used += obj.capacity
            self._pool.evict(self._used + self._pool.bytes - self.limit_bytes)  # pooled room the bound needs
            self._last_used[scope] = self._clock()
        try:
            path, mapping = self._segment(obj, pooled)
        except BaseException as exc:
            with self._changed:
                self._drop(obj)
            if not isinstance(exc, OSError) or exc.errno not in _NO_ROOM:
                raise
            raise errors.ResourceExhausted(
                f"no segment of {obj.nbytes} bytes for object {obj._name()} could be made under {self.root}: "
                f"{_NO_ROOM[exc.errno]}; release or fetch earlier objects, or ask an operator to make room") from exc
        with self._changed:
            obj.path, obj._mmap, obj._ready = path, mapping, True
            if self._scopes.get(scope, {}).get(object_id) is not obj:  # released or expired meanwhile
                obj._free()
                unlink(path)
                raise errors.NotFound(f"object {obj._name()} was released while it was created", field="object_id")
        return obj

    def _segment(self, obj: StoredObject, pooled) -> tuple[str, mmap.mmap | None]:
        """The object's segment: the pooled one it took, mapped again, or a new one."""
        if not obj.nbytes:
            return "", None
        if pooled is not None:
            try:
                return pooled.path, map_segment(pooled.path, obj.nbytes)
            except OSError:  # removed under the store (an operator's cleanup): make one
                unlink(pooled.path)
                with self._changed:
                    self._used -= obj.capacity - obj.nbytes
                    obj.capacity = obj.nbytes
        return make_segment(self.root, obj.nbytes)

    def seal(self, scope: str, object_id: str) -> StoredObject:
        """Mark the object written in full: from now on it is only read (`get`)."""
        with self._changed:
            obj = self._find(scope, object_id)
            if obj is None:
                raise errors.NotFound(f"no object {errors.quoted(object_id)} in scope {errors.quoted(scope)} to seal: "
                                      "create it first", field="object_id")
        with obj._lock:  # the writes in progress end first
            if obj._sealed:
                raise errors.FailedPrecondition(f"object {obj._name()} is sealed already")
            if obj._freed:
                raise errors.NotFound(f"object {obj._name()} was released before it was sealed", field="object_id")
            obj._sealed = True
        with self._changed:
            if scope in self._last_used:  # an upload that takes long keeps its scope alive
                self._last_used[scope] = self._clock()
        return obj

    def get(self, scope: str, object_id: str) -> StoredObject:
        """A sealed object."""
        with self._changed:
            self._expire(now := self._clock())
            obj = self._find(scope, object_id)
            if obj is None or not obj._sealed:
                raise errors.NotFound(
                    f"object {errors.quoted(object_id)} of scope {errors.quoted(scope)} is not on this worker: it was "
                    f"never put (or not sealed yet), was released, expired after {TTL_ENV}={self.ttl_s:g} s idle, or "
                    "the worker restarted: put it again", field="object_id")
            self._last_used[scope] = now
            return obj

    def put_array(self, scope: str, object_id: str, array: np.ndarray, *, wait_s: float | None = None) -> StoredObject:
        """Create, write and seal an object holding a copy of `array` (a shard's output)."""
        array = np.asarray(array)
        obj = self.create(scope, object_id, array.dtype, array.shape, wait_s=wait_s)
        try:
            obj._copy_in(array)
            return self.seal(scope, object_id)
        except BaseException:
            with self._changed:
                self._drop(obj)
            raise

    def release(self, scope: str, prefix: str = "") -> tuple[int, int]:
        """Free the scope's objects whose id starts with `prefix`: (objects, bytes) freed."""
        with self._changed:
            return self._dropped([obj for key, obj in self._scopes.get(scope, {}).items() if key.startswith(prefix)])

    def release_ids(self, scope: str, object_ids: Iterable[str]) -> tuple[int, int]:
        """Free those of the scope's objects that are still there: (objects, bytes) freed."""
        with self._changed:
            objects = self._scopes.get(scope, {})
            return self._dropped([obj for obj in map(objects.get, dict.fromkeys(object_ids)) if obj is not None])

    def discard(self, scope: str, object_id: str) -> None:
        """Free one object, sealed or not (a put that failed half way); nothing there is not an error."""
        with self._changed:
            obj = self._scopes.get(scope, {}).get(object_id)
            if obj is not None:
                self._drop(obj)

    def expire(self) -> int:
        """Free the objects of scopes idle for `ttl_s`; create and get do it too. Objects freed."""
        with self._changed:
            self._drain()
            self._pool.trim(self._clock())
            return self._expire(self._clock())

    def stats(self) -> StoreStats:
        with self._changed:
            return StoreStats(self._count, self._used, self.limit_bytes, self._waiting, self._pool.bytes)

    def close(self) -> None:
        """Free every object (the worker stops); creates after this are refused."""
        with self._changed:
            self._closed = True
            for obj in [obj for objects in self._scopes.values() for obj in objects.values()]:
                self._drop(obj)
            self._drain()  # closed: what is still in use goes unpooled, its file unlinked
            self._pool.clear()
            self._changed.notify_all()  # waiting creates are refused

    def _find(self, scope: str, object_id: str) -> StoredObject | None:
        obj = self._scopes.get(scope, {}).get(object_id)
        return obj if obj is not None and obj._ready else None

    def _check_new(self, obj: StoredObject) -> None:
        if self._closed:
            raise errors.Unavailable("this worker is stopping: put the object on the worker that runs its job next")
        if obj.object_id in self._scopes.get(obj.scope, {}):
            raise errors.AlreadyExists(f"object {obj._name()} of this job exists already; objects are written once",
                                       field="object_id")
        if self._count >= self.max_objects:
            raise errors.ResourceExhausted(
                f"this worker holds {self._count} objects, its limit ({OBJECTS_ENV}); release or fetch earlier "
                f"objects, put fewer, larger ones, or raise {OBJECTS_ENV}",
                metadata={"limit_objects": str(self.max_objects), "variable": OBJECTS_ENV},
                quota=errors.QuotaViolation("worker", f"{self.max_objects} objects at once ({OBJECTS_ENV})"))

    def _full(self, obj: StoredObject, why: str) -> errors.ResourceExhausted:
        return errors.ResourceExhausted(
            f"object {obj._name()} needs {obj.nbytes} bytes, {why}: the worker's store holds {self._used} of its "
            f"{self.limit_bytes} bytes ({BYTES_ENV}); release or fetch earlier objects, use smaller shards, or raise "
            f"{BYTES_ENV}", reason=errors.STORE_FULL,
            metadata={"limit_bytes": str(self.limit_bytes), "variable": BYTES_ENV},
            quota=errors.QuotaViolation("worker", f"{self.limit_bytes} bytes of objects at once ({BYTES_ENV})"))

    def _expire(self, now: float) -> int:
        idle = [scope for scope, last in self._last_used.items() if now - last >= self.ttl_s]
        freed = [obj for scope in idle for obj in self._scopes.get(scope, {}).values()]
        for obj in freed:
            self._drop(obj)
        return len(freed)

    def _dropped(self, chosen: list[StoredObject]) -> tuple[int, int]:
        """Free `chosen` (the lock is held): (objects, bytes) freed."""
        for obj in chosen:
            self._drop(obj)
        return len(chosen), sum(obj.nbytes for obj in chosen)

    def _drop(self, obj: StoredObject) -> None:
        """Free `obj` if it is still the store's (the lock is held)."""
        objects = self._scopes.get(obj.scope, {})
        if objects.get(obj.object_id) is not obj:
            return
        del objects[obj.object_id]
        if not objects:
            del self._scopes[obj.scope]
            self._last_used.pop(obj.scope, None)
        self._count -= 1
        self._used -= obj.capacity
        drains = not self._closed and obj.capacity >= POOL_MIN_BYTES and len(self._draining) < MAX_DRAINING
        if not obj._free() and drains:
            self._draining.append(obj)
        else:
            self._pooled_or_unlinked(obj)
        self._changed.notify_all()

    def _pooled_or_unlinked(self, obj: StoredObject) -> None:
        if obj.path and not (obj._mmap is None and not self._closed
                             and self._pool.give(_owner(obj.scope), obj.path, obj.capacity, self._clock())):
            unlink(obj.path)

    def _drain(self) -> None:
        """Pool the draining objects' segments whose views are gone now (the lock is held)."""
        draining, self._draining = self._draining, []
        for obj in draining:
            if obj._free() or self._closed:
                self._pooled_or_unlinked(obj)
            else:
                self._draining.append(obj)


def _owner(scope: str) -> str:
    """Whose objects a scope holds ("<owner>|<job>"): pooled segments go to that owner's alone."""
    owner, bar, _ = scope.rpartition("|")
    return owner if bar else scope


def _checked_id(field: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
        raise errors.InvalidArgument(f"{field} must be 1 to {MAX_KEY_CHARS} characters, got {errors.quoted(value)}",
                                     field=field)
    return value


def _layout(dtype, shape) -> tuple[np.dtype, tuple[int, ...], int]:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise errors.InvalidArgument(f"dtype {errors.quoted(str(dtype))} is not a numpy dtype", field="dtype") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise errors.InvalidArgument(f"dtype {dtype} holds no fixed-size values: use a numeric or fixed-size dtype",
                                     field="dtype")
    try:
        shape = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise errors.InvalidArgument(f"shape must be a sequence of integers, got {errors.quoted(shape)}",
                                     field="shape") from None
    if len(shape) > MAX_DIMS or any(n < 0 or n >= 2**63 for n in shape):
        raise errors.InvalidArgument(f"shape must be at most {MAX_DIMS} non-negative integers, got "
                                     f"{errors.quoted(shape)}", field="shape")
    check_array_shape(shape, dtype.itemsize)
    return dtype, shape, dtype.itemsize * math.prod(shape)
