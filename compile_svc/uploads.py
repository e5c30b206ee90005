"""Uploaded programs survive restarts: each is kept as the client's bytes plus a JSON sidecar.

Only serialized jax.export artifacts (StableHLO, data) are stored; nothing here is ever
unpickled or executed as Python. Files are named `<name>@<version>.json` and `.jaxexport`;
restore also reads files written before that naming and renames them to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from accelmesh import errors
from accelmesh.programs import Program
from compile_svc.programs import ProgramRegistry, program_from_export

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
META, DATA = ".json", ".jaxexport"


class UploadStore:
    """The registry's uploads and their files, changed together under one lock so a delete
    racing an upload of the same version cannot leave files behind that a restart brings back."""

    def __init__(self, root: Path, registry: ProgramRegistry, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.registry = registry
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def check(self, name: str, version: str) -> None:
        """Refuse a bad, reserved or existing name@version before the artifact is streamed."""
        for field, value in (("name", name), ("version", version)):
            if not NAME.match(value or ""):
                raise errors.InvalidArgument(
                    f"header.{field} {value!r} must be 1-128 letters, digits, '_', '-' or '.'"
                )
        self.registry.check_upload(name, version)

    def upload(
        self, name: str, version: str, data: bytes, combine: Sequence[str], input_names: Sequence[str] = (),
        description: str = "",
    ) -> Program:
        """Register and store a new upload; an existing name@version is refused (AlreadyExists)."""
        self.check(name, version)
        meta = {"name": name, "version": version, "combine": list(combine), "input_names": list(input_names),
                "description": description}
        program = self._program(meta, data)
        with self._lock:
            self.registry.add_upload(program)
            try:
                self._save(meta, data)
            except OSError:
                self.registry.remove_upload(name, version)
                raise
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
        return program

    def restore(self) -> int:
        """Register every stored upload again; a damaged, duplicate or reserved one is logged and skipped."""
        count = 0
        for meta_path in sorted(self.root.glob(f"*{META}")):
            try:
                meta = json.loads(meta_path.read_text())
                self.check(meta["name"], meta["version"])  # also keeps a tampered name inside root
                data_path = meta_path.with_suffix(DATA)
                data = data_path.read_bytes()
                program = self._program(meta, data)
                with self._lock:
                    self.registry.add_upload(program)
                    if meta_path != self._path(program.name, program.version, META):
                        self._save(meta, data)  # named before <name>@<version>: move it there
                        meta_path.unlink()
                        data_path.unlink()
                count += 1
            except (OSError, ValueError, KeyError, TypeError, errors.AccelmeshError) as exc:
                log.warning("skipping stored upload %s in %s: %s", meta_path.name, self.root, exc)
        return count

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


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
