"""The worker's artifact cache: verified artifact bytes on local disk, fetched once per key from
the one compile service the worker is configured with (over mutual TLS, checking that the
server holds a compile certificate), never from an address a request names.

Layout: `<root>/<key>.bin`, written atomically (temporary file, then rename), so a reader sees a
whole artifact or none. Every read is checked against the digest the shard names, so a corrupt
or foreign file is fetched again rather than loaded. Concurrent shards that want the same key
share one fetch (single-flight within this process).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import grpc

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.channels import ChannelPool
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES
from accelmesh.runtime.errors import error_from_rpc
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES
from accelmesh.security.config import Security
from accelmesh.security.files import private_dir
from accelmesh.security.identity import Role
from worker_svc.executor import FetchedArtifact

log = logging.getLogger(__name__)

KEY_PATTERN = re.compile(r"[0-9a-f]{64}")  # keys are sha256 hex digests; anything else is no key
FETCH_TIMEOUT_S = 300.0


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArtifactStore:
    def __init__(self, root: str | Path, compile_address: str, security: Security, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tracer_provider=None):
        self.root = Path(root)  # made on the first write, so a worker that never executes leaves no folder
        if self.root.exists():  # one made before, maybe with wider bits: tenants' programs, the owner's alone
            private_dir(self.root)
        self.compile_address = compile_address
        self.fetches = 0  # FetchArtifact streams completed
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)
        self._channels = ChannelPool(security, Role.COMPILE, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)
        self._inflight: dict[str, Future[FetchedArtifact]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._channels.close()

    def get(self, key: str, digest: str) -> bytes:
        return self.fetch(key, digest).data

    def fetch(self, key: str, digest: str) -> FetchedArtifact:
        """The artifact's bytes, from disk if a verified copy is there, else from the compile service."""
        if not KEY_PATTERN.fullmatch(key):
            # Checked before the key becomes a file name. No artifact can have such a key.
            raise errors.NotFound(f"artifact {key!r} does not exist: artifact keys are the 64 hex digits "
                                  "CompileService.Compile returns")
        if not digest:
            raise errors.InvalidArgument(
                f"artifact_digest is required for artifact {key}; pass the digest Compile returned")
        data = self._read(key, digest)
        if data is not None:
            return FetchedArtifact(data, cached=True)
        with self._lock:
            pending = self._inflight.get(key)
            owner = pending is None
            if owner:
                pending = self._inflight[key] = Future()
        if owner:
            try:
                pending.set_result(self._download(key, digest))
            except BaseException as exc:  # noqa: BLE001 - every joiner, and this call below, re-raises it
                pending.set_exception(exc)
            finally:
                with self._lock:
                    del self._inflight[key]
        fetched = pending.result()
        if not owner:  # the owner verified against its own digest; a joiner checks against its own
            _verify(key, sha256_hex(fetched.data), digest, "the shard")
        return fetched

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.bin"

    def _read(self, key: str, digest: str) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        if sha256_hex(data) != digest:
            log.warning("cached artifact %s does not hash to %s; fetching it again", key, digest)
            return None
        return data

    def _download(self, key: str, digest: str) -> FetchedArtifact:
        data = self._read(key, digest)  # a fetch that finished just before ours began
        if data is not None:
            return FetchedArtifact(data, cached=True)
        if not self.compile_address:
            raise errors.FailedPrecondition(
                f"artifact {key} is not cached on this worker and the worker has no compile service to fetch it "
                "from: start it with --compile (ACCELMESH_COMPILE)")
        stub = compile_service_pb2_grpc.CompileServiceStub(self._channels.get(self.compile_address))
        request = compile_pb.FetchArtifactRequest(key=key, chunk_bytes=self._chunk_bytes)
        pieces, announced = [], None
        try:
            for part in stub.FetchArtifact(request, timeout=FETCH_TIMEOUT_S):
                if announced is None:
                    announced = part.digest
                pieces.append(part.chunk)
        except grpc.RpcError as exc:
            raise error_from_rpc(
                exc, f"fetching artifact {key} from the compile service at {self.compile_address}") from None
        data = b"".join(pieces)
        actual = sha256_hex(data)
        _verify(key, actual, announced or "", "the compile service")
        _verify(key, actual, digest, "the shard")
        self._write(key, data)
        with self._lock:
            self.fetches += 1
        return FetchedArtifact(data, cached=False)

    def _write(self, key: str, data: bytes) -> None:
        private_dir(self.root, tighten=False)
        fd, temporary = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self._path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

def _verify(key: str, actual: str, expected: str, source: str) -> None:
    if actual != expected:
        raise errors.FailedPrecondition(
            f"artifact {key} failed verification: its bytes hash to {actual} but {source} says "
            f"{expected or '(no digest)'}; pass the digest Compile returned for this key")
