"""Uploaded programs survive restarts: each is kept as the client's bytes plus a JSON sidecar.

Only serialized jax.export artifacts (StableHLO, data) are stored; nothing here is ever
unpickled or executed as Python.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from accelmesh import errors
from accelmesh.programs import Program
from compile_svc.programs import ProgramRegistry, program_from_export

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class UploadStore:
    def __init__(self, root: Path, registry: ProgramRegistry, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.registry = registry
        self.max_bytes = max_bytes

    def upload(
        self, name: str, version: str, data: bytes, combine: Sequence[str], input_names: Sequence[str] = (),
        description: str = "",
    ) -> Program:
        for field, value in (("name", name), ("version", version)):
            if not NAME.match(value or ""):
                raise errors.InvalidArgument(
                    f"header.{field} {value!r} must be 1-128 letters, digits, '_', '-' or '.'"
                )
        program = program_from_export(name, version, data, list(combine), list(input_names) or None, self.max_bytes)
        if description:
            program = _with_description(program, description)
        program = self.registry.register(program)
        stem = self.root / f"{name}@{version}"
        _write(stem.with_suffix(".jaxexport"), data)
        _write(stem.with_suffix(".json"), json.dumps(
            {"name": name, "version": version, "combine": list(combine), "input_names": list(input_names),
             "description": description}
        ).encode())
        return program

    def restore(self) -> int:
        """Register every stored upload again; a damaged one is logged and skipped."""
        count = 0
        for meta_path in sorted(self.root.glob("*.json")):
            try:
                meta = json.loads(meta_path.read_text())
                data = meta_path.with_suffix(".jaxexport").read_bytes()
                program = program_from_export(meta["name"], meta["version"], data, meta["combine"],
                                              meta["input_names"] or None, self.max_bytes)
                if meta.get("description"):
                    program = _with_description(program, meta["description"])
                self.registry.register(program)
                count += 1
            except (OSError, ValueError, KeyError, errors.AccelmeshError) as exc:
                log.warning("skipping stored upload %s: %s", meta_path.name, exc)
        return count


def _with_description(program: Program, description: str) -> Program:
    return dataclasses.replace(program, description=description)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
