"""Uploaded programs survive restarts: each is kept as the client's bytes plus a JSON sidecar.

Only serialized jax.export artifacts (StableHLO, data) are stored; nothing here is ever
unpickled or executed as Python. Files are named `<name>@<version>.json` and `.jaxexport`.
Files written before that naming (Path.with_suffix took the version's last dot for a suffix, so
'1.0' and '1.1' shared `<name>@1`) are still read: the sidecar names its own version, so each
is registered under it and moved to its own name. Versions that shared a file then were lost to
the last one written before the restart; nothing on disk is left to bring them back.

The store keeps at most `max_uploads` versions and `max_total_bytes` of artifacts (each is held
in memory as well as on disk): past either, an upload is refused before its artifact streams in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from accelmesh import errors
from accelmesh.errors import quoted
from accelmesh.programs import Program
from accelmesh.security.files import private_dir, write_private
from compile_svc.programs import ProgramRegistry, program_from_export
from compile_svc.programs.registry import MAX_NAME_CHARS, MAX_VERSION_CHARS
from compile_svc.programs.uploaded import MAX_UPLOAD_TENSORS

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # fullmatch: also what keeps a stored name inside the folder
# A new upload's version is shorter than a name so that its file name, `.<name>@<version>.jaxexport.tmp`,
# stays within the 255 bytes a file name may have on common filesystems. Restore accepts what
# uploads could have before (MAX_VERSION_CHARS), so older files still load.
MAX_UPLOAD_VERSION_CHARS = 64
MAX_DESCRIPTION_CHARS = 4096  # header.description: listed with every ListPrograms answer
MAX_INPUT_NAME_CHARS = 128  # each of header.input_names
META, DATA = ".json", ".jaxexport"


class UploadStore:
    """The registry's uploads and their files, changed together under one lock so a delete
    racing an upload of the same version cannot leave files behind that a restart brings back."""

    def __init__(self, root: Path, registry: ProgramRegistry, max_bytes: int, *,
                 max_uploads: int = 256, max_total_bytes: int = 4 * 1024**3):
        self.root = private_dir(root)  # tenants' uploaded artifacts
        self.registry = registry
        self.max_bytes = max_bytes  # one artifact
        self.max_uploads = max_uploads
        self.max_total_bytes = max_total_bytes
        self._sizes: dict[tuple[str, str], int] = {}  # every stored upload's artifact bytes
        self._skipped: set[str] = set()  # sidecars that could not be restored: not read again
        self._lock = threading.Lock()

    def check(self, name: str, version: str, total_bytes: int = 0, input_names: Sequence[str] = (),
              description: str = "") -> None:
        """Refuse a bad, reserved or existing name@version, a header over its limits, or an upload
        the store has no room for, before the artifact is streamed."""
        _check_name(name, version, MAX_NAME_CHARS, MAX_UPLOAD_VERSION_CHARS)
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise errors.InvalidArgument(f"header.description is {len(description)} characters, over the "
                                         f"{MAX_DESCRIPTION_CHARS} allowed; shorten it", field="header.description")
        if len(input_names) > MAX_UPLOAD_TENSORS:
            raise errors.InvalidArgument(f"header.input_names has {len(input_names)} names; an upload may take at "
                                         f"most {MAX_UPLOAD_TENSORS} inputs", field="header.input_names")
        for i, input_name in enumerate(input_names):
            if len(input_name) > MAX_INPUT_NAME_CHARS:
                raise errors.InvalidArgument(f"header.input_names[{i}] {quoted(input_name)} is longer than "
                                             f"{MAX_INPUT_NAME_CHARS} characters", field=f"header.input_names[{i}]")
        self.registry.check_upload(name, version)
        with self._lock:
            self._check_room(total_bytes)

    def upload(
        self, name: str, version: str, data: bytes, combine: Sequence[str], input_names: Sequence[str] = (),
        description: str = "",
    ) -> Program:
        """Register and store a new upload; an existing name@version is refused (AlreadyExists)."""
        self.check(name, version, len(data), input_names, description)
        meta = {"name": name, "version": version, "combine": list(combine), "input_names": list(input_names),
                "description": description, "digest": hashlib.sha256(data).hexdigest()}
        program = self._program(meta, data)
        with self._lock:
            self._check_room(len(data))  # again: another upload may have taken the room meanwhile
            self.registry.add_upload(program)
            try:
                self._save(meta, data)
            except OSError:
                self.registry.remove_upload(name, version)
                raise
            self._sizes[(name, version)] = len(data)
        return program

    def delete(self, name: str, version: str) -> Program:
        """Unregister one exact uploaded version and remove its files, so a restart leaves it gone."""
        if not name or not version:
            raise errors.InvalidArgument("name and version are both required: DeleteProgram removes one exact "
                                         "uploaded version; ListPrograms shows them")
        with self._lock:
            program = self.registry.remove_upload(name, version)
            try:
                self._path(name, version, META).unlink(missing_ok=True)  # the sidecar first: restore reads it
                self._path(name, version, DATA).unlink(missing_ok=True)
            except OSError:
                self.registry.add_upload(program)
                raise
            self._sizes.pop((name, version), None)
        return program

    def restore(self) -> int:
        """Register every stored upload again; a damaged, duplicate or reserved one is logged and skipped.

        Uploads over today's limits are still restored (refusing them would lose them); new
        uploads are refused until some are deleted."""
        count = sum(self._restore_one(meta_path) for meta_path in sorted(self.root.glob(f"*{META}")))
        if len(self._sizes) > self.max_uploads or sum(self._sizes.values()) > self.max_total_bytes:
            log.warning("%d stored uploads (%d bytes) are over the limits of %d uploads and %d bytes; new "
                        "uploads are refused until some are deleted", len(self._sizes), sum(self._sizes.values()),
                        self.max_uploads, self.max_total_bytes)
        return count

    def refresh(self) -> None:
        """Bring the registry in line with the folder, which compile replicas share: register what
        another replica uploaded, drop what another deleted. A directory listing when nothing
        changed; called before every lookup of a program, so a program uploaded through one
        replica is known to the next call on any other."""
        stored = {p.name for p in self.root.glob(f"*{META}")}
        with self._lock:
            known = {self._path(name, version, META).name: (name, version) for name, version in self._sizes}
        for file_name, (name, version) in known.items():
            if file_name not in stored:
                with self._lock:
                    try:
                        self.registry.remove_upload(name, version)
                    except errors.NotFound:
                        pass
                    self._sizes.pop((name, version), None)
        for file_name in sorted(stored - known.keys() - self._skipped):
            self._restore_one(self.root / file_name)

    def _restore_one(self, meta_path: Path) -> bool:
        """Register one stored upload; a damaged, duplicate or reserved one is logged, skipped and
        not read again by `refresh`."""
        try:
            meta = json.loads(meta_path.read_text())
            _check_name(meta["name"], meta["version"], MAX_NAME_CHARS, MAX_VERSION_CHARS)  # stays inside root
            self.registry.check_upload(meta["name"], meta["version"])
            data_path = meta_path.with_name(meta_path.name.removesuffix(META) + DATA)
            data = data_path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if meta.get("digest", digest) != digest:  # sidecars written before the digest have none
                raise ValueError(f"{data_path.name} is not the artifact its sidecar was written for")
            program = self._program(meta, data)
            with self._lock:
                self.registry.add_upload(program)
                try:
                    if meta_path != self._path(program.name, program.version, META):
                        self._save(meta, data)  # named before <name>@<version>: move it there
                        meta_path.unlink()
                        data_path.unlink()
                except OSError:
                    self.registry.remove_upload(program.name, program.version)
                    raise
                self._sizes[(program.name, program.version)] = len(data)
            return True
        except (OSError, ValueError, KeyError, TypeError, errors.AccelmeshError) as exc:
            log.warning("skipping stored upload %s in %s: %s", meta_path.name, self.root, exc)
            self._skipped.add(meta_path.name)
            return False

    def _check_room(self, total_bytes: int) -> None:
        """Call under the lock."""
        if len(self._sizes) >= self.max_uploads:
            raise errors.ResourceExhausted(
                f"{len(self._sizes)} uploaded versions are kept, the limit of this compile service; "
                "DeleteProgram versions no longer used, or raise ACCELMESH_MAX_UPLOADS")
        held = sum(self._sizes.values())
        if held + total_bytes > self.max_total_bytes:
            raise errors.ResourceExhausted(
                f"uploads hold {held} bytes; {total_bytes} more would pass the limit of {self.max_total_bytes}; "
                "DeleteProgram versions no longer used, or raise ACCELMESH_MAX_UPLOADED_BYTES")

    def _program(self, meta: dict, data: bytes) -> Program:
        program = program_from_export(meta["name"], meta["version"], data, list(meta["combine"]),
                                      list(meta["input_names"]) or None, self.max_bytes)
        if meta.get("description"):
            program = dataclasses.replace(program, description=meta["description"])
        return program

    def _save(self, meta: dict, data: bytes) -> None:
        _write(self._path(meta["name"], meta["version"], DATA), data)
        _write(self._path(meta["name"], meta["version"], META), json.dumps(meta).encode())

    def _path(self, name: str, version: str, suffix: str) -> Path:
        # Not Path.with_suffix: a dot in the version ('1.0') would be taken for a suffix.
        return self.root / f"{name}@{version}{suffix}"


def _check_name(name: object, version: object, max_name: int, max_version: int) -> None:
    for field, value, limit in (("name", name, max_name), ("version", version, max_version)):
        if not isinstance(value, str) or not 0 < len(value) <= limit or not NAME.fullmatch(value):
            raise errors.InvalidArgument(
                f"header.{field} {quoted(value)} must be 1-{limit} letters, digits, '_', '-' or '.'",
                field=f"header.{field}")


def _write(path: Path, data: bytes) -> None:
    write_private(path, data)
