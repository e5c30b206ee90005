"""Content-addressed on-disk artifact cache with single-flight builds and LRU eviction by size.

Layout: `<root>/<key[:2]>/<key>.bin` (payload) and `<key>.json` (sidecar: digest, size,
created time, caller metadata). The sidecar is written last, so its presence commits an entry.
Recency is the payload's mtime, set explicitly from a fine-grained clock because filesystem
timestamps are coarse enough to tie on back-to-back writes.

Single-flight holds across processes too: the builder of a key holds a lock on `<key>.building`
next to the entry, so compile replicas sharing one folder (a ReadWriteMany volume) build a key
once and the others wait, then read it. Where the filesystem cannot lock, two builds of a key
are harmless: the second write replaces the first (both are valid). A file lock serialises reads,
writes and eviction across processes so a reader never pairs one writer's sidecar with another's
payload, and every read checks the payload against the digest its sidecar recorded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

from accelmesh.artifacts import EXECUTABLE_SCHEMA
from accelmesh.errors import InvalidArgument, NotFound, quoted
from accelmesh.security.files import open_private, private_dir

_SCHEMA = 1  # bump when the key recipe or layout changes so old entries stop matching


@dataclass(frozen=True)
class CachedArtifact:
    key: str
    payload: bytes
    metadata: dict[str, Any]  # what the builder returned alongside the payload
    digest: str  # sha256 hex of payload
    created: float  # unix seconds

    @property
    def size(self) -> int:
        return len(self.payload)


@cache
def _versions() -> dict[str, str]:
    # An artifact from one jax/jaxlib may not load in another, so versions are part of every key.
    return {"jax": version("jax"), "jaxlib": version("jaxlib")}


def _canonical(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _canonical(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def key_for(**parts: Any) -> str:
    """sha256 over canonical JSON of the parts plus jax/jaxlib versions, the cache schema and the
    executable format's schema (a cache written before a format change never serves the old one)."""
    doc = _canonical({**parts, "_versions": _versions(), "_schema": _SCHEMA, "_executable": EXECUTABLE_SCHEMA})
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int):
        self.root = private_dir(root)  # compiled programs of every tenant
        self.max_bytes = max_bytes
        self.builds = 0  # times a build function ran (raising or not)
        self.hits = 0  # requests answered without building
        self._lock = threading.Lock()  # flock is per open file, so threads need their own lock
        self._lock_path = self.root / ".lock"
        self._inflight: dict[str, Future[CachedArtifact]] = {}
        self._waiting: dict[str, int] = {}  # callers blocked on another caller's build, per key
        self._inflight_lock = threading.Lock()
        self._last_stamp_ns = 0

    key_for = staticmethod(key_for)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, os.fdopen(open_private(self._lock_path), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def _paths(self, key: str) -> tuple[Path, Path]:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise InvalidArgument(f"cache key {quoted(key)} must be a sha256 hex digest from key_for")
        base = self.root / key[:2] / key
        return base.with_suffix(".bin"), base.with_suffix(".json")

    def _touch(self, path: Path) -> None:
        stamp = max(time.time_ns(), self._last_stamp_ns + 1)  # strictly increasing within this process
        self._last_stamp_ns = stamp
        os.utime(path, ns=(stamp, stamp))

    def get(self, key: str) -> CachedArtifact | None:
        with self._locked():
            found = self._read(key)
            if found is not None:
                self._touch(self._paths(key)[0])
                self.hits += 1
            return found

    def _read(self, key: str) -> CachedArtifact | None:
        payload_path, meta_path = self._paths(key)
        try:
            meta_text = meta_path.read_text()
        except FileNotFoundError:
            return None
        try:
            meta, payload = json.loads(meta_text), payload_path.read_bytes()
        except (OSError, ValueError):  # includes a sidecar whose payload vanished
            meta, payload = {}, b""
        if not isinstance(meta, dict) or hashlib.sha256(payload).hexdigest() != meta.get("digest"):
            self._delete(key)  # corrupt or half-written: a miss, and the next build rewrites it
            return None
        return CachedArtifact(key, payload, meta.get("metadata", {}), meta["digest"], meta["created"])

    def put(self, key: str, payload: bytes, metadata: Mapping[str, Any]) -> CachedArtifact:
        payload_path, meta_path = self._paths(key)
        # Round-trip the metadata now: a non-JSON value fails before anything is written, and
        # put returns exactly what a later get will.
        metadata = json.loads(json.dumps(dict(metadata)))
        artifact = CachedArtifact(key, bytes(payload), metadata, hashlib.sha256(payload).hexdigest(), time.time())
        sidecar = json.dumps({"digest": artifact.digest, "size": artifact.size, "created": artifact.created,
                              "metadata": metadata}, sort_keys=True).encode()
        with self._locked():
            private_dir(payload_path.parent, tighten=False)
            _write_atomic(payload_path, artifact.payload)
            _write_atomic(meta_path, sidecar)
            self._touch(payload_path)
            self._evict(keep=key)
        return artifact

    def _entries(self) -> list[tuple[int, str, int]]:
        """(recency ns, key, size) of every committed entry, oldest first."""
        out = []
        for meta_path in self.root.glob("??/*.json"):
            try:
                out.append((meta_path.with_suffix(".bin").stat().st_mtime_ns, meta_path.stem,
                            json.loads(meta_path.read_text())["size"]))
            except (OSError, ValueError, KeyError):
                continue  # half-gone entries are cleaned up when read
        return sorted(out)

    def _evict(self, keep: str) -> None:
        entries = self._entries()
        total = sum(size for _, _, size in entries)
        for _, key, size in entries:
            if total <= self.max_bytes:
                break
            if key != keep:  # the entry just written stays even if it alone exceeds max_bytes
                self._delete(key)
                total -= size

    def _delete(self, key: str) -> None:
        payload_path, meta_path = self._paths(key)
        meta_path.unlink(missing_ok=True)  # sidecar first: without it the entry is already gone
        payload_path.unlink(missing_ok=True)

    def total_bytes(self) -> int:
        with self._locked():
            return sum(size for _, _, size in self._entries())

    def get_or_build(self, key: str,
                     build: Callable[[], tuple[bytes, Mapping[str, Any]]]) -> tuple[CachedArtifact, bool]:
        """The cached artifact, building it once however many threads ask at the same time.

        Returns (artifact, True) to the caller whose build ran. A build that raises reaches
        every waiter and caches nothing, so a later call builds again.
        """
        with self._inflight_lock:
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
            else:
                self._waiting[key] = self._waiting.get(key, 0) + 1
        if not owner:
            try:
                artifact = future.result()
            finally:
                with self._inflight_lock:
                    self._waiting[key] -= 1
                    if not self._waiting[key]:
                        del self._waiting[key]
            with self._lock:
                self.hits += 1
            return artifact, False
        try:
            artifact = self.get(key)
            if artifact is None:
                with self._building(key):  # another process building it: wait for it, then read it
                    artifact = self.get(key)
                    if artifact is None:
                        with self._lock:
                            self.builds += 1
                        payload, metadata = build()
                        artifact = self.put(key, payload, metadata)
                        built = True
                    else:
                        built = False
            else:
                built = False
            future.set_result(artifact)
            return artifact, built
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._inflight_lock:
                del self._inflight[key]

    @contextmanager
    def _building(self, key: str) -> Iterator[None]:
        """Held while this process builds `key` (one thread per key here: the in-process single
        flight). The lock file goes when its holder is done; a process that opened it before then
        still waits for the holder, and one that comes later finds the artifact (or builds again)."""
        payload_path, _ = self._paths(key)
        private_dir(payload_path.parent, tighten=False)
        lock_path = payload_path.with_suffix(".building")
        with os.fdopen(open_private(lock_path), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError:  # a filesystem without locks: build anyway, the duplicate is harmless
                pass
            try:
                yield
            finally:
                lock_path.unlink(missing_ok=True)

    def waiting(self, key: str) -> int:
        """Callers currently waiting for another caller's build of `key` (for tests and telemetry)."""
        with self._inflight_lock:
            return self._waiting.get(key, 0)

    def open_stream(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """Chunks of a verified payload, for FetchArtifact; NotFound now, not at the first chunk."""
        if chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
        artifact = self.get(key)
        if artifact is None:
            raise NotFound(f"artifact {key} is not cached; build it first")
        view = memoryview(artifact.payload)
        return (bytes(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes))


def _write_atomic(path: Path, data: bytes) -> None:
    # Same directory as the target so os.replace is a rename, never a cross-device copy.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
