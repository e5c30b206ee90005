"""Programs by (name, version): built-ins, plugins found through entry points, and uploads.

Published-size models are registered deferred (see DeferredEntry): start-up only records their
names, listing builds their signatures, and get/describe builds their layer tables.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from accelmesh.errors import FailedPrecondition, NotFound
from accelmesh.programs import Program
from compile_svc.programs.builtin import builtin_deferred, builtin_entries
from compile_svc.programs.layers import DeferredEntry, LayerFn, ProgramEntry

ENTRY_POINT_GROUP = "accelmesh.programs"

log = logging.getLogger(__name__)


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Semantic-ish order: numeric runs compare as numbers ('1.10' > '1.9'), other runs as text,
    and text sorts below numbers so '2.0rc1' < '2.0.1'."""
    return tuple((1, int(tok), "") if tok.isdigit() else (0, 0, tok) for tok in re.findall(r"\d+|[^\d.\-_+]+", version))


class ProgramRegistry:
    """Thread-safe: the servicer registers uploads while other requests read. Deferred entries
    are built outside the registry lock, so one slow first build blocks no other program."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], ProgramEntry | DeferredEntry] = {}
        self._lock = threading.Lock()

    def register(self, program: Program, layer_fns: Iterable[LayerFn] = ()) -> Program:
        """Add a program; registering identical content again is a no-op, so retries are safe."""
        key = (program.name, program.version)
        with self._lock:
            existing = self._entries.get(key)
            if existing is None:
                self._entries[key] = ProgramEntry(program, tuple(layer_fns))
                return program
        current = _program(existing)
        if _content(current) != _content(program):
            raise FailedPrecondition(
                f"program {program.ref} is already registered with different content "
                f"(digest {current.digest[:12]}, new {program.digest[:12]}); "
                "register it under a new version")
        return current

    def register_deferred(self, deferred: DeferredEntry) -> None:
        """Add a program that is built when first asked for; its name and version must be free."""
        key = (deferred.name, deferred.version)
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None and existing is not deferred:
                raise FailedPrecondition(f"program {deferred.name}@{deferred.version} is already registered; "
                                         "register it under a new version")
            self._entries[key] = deferred

    def get(self, name: str, version: str = "") -> Program:
        """The named program; an empty version means the highest registered version."""
        return self._entry(name, version).program

    def layer_functions(self, name: str, version: str = "") -> tuple[LayerFn, ...]:
        """The program's pipeline stages in order; empty when it is not a layered model."""
        return self._entry(name, version).layer_fns

    def list(self) -> list[Program]:
        """Every program; deferred ones may come without their layer table (get has it)."""
        with self._lock:
            entries = list(self._entries.values())
        programs = [_program(e) for e in entries]
        programs.sort(key=lambda p: (p.name, version_key(p.version)))
        return programs

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP, *,
                          entry_points: Callable[..., Iterable[Any]] = importlib.metadata.entry_points
                          ) -> builtins.list[Program]:
        """Register the programs of every installed plugin; returns what was added.

        Each entry point names a zero-arg callable returning a Program, a ProgramEntry (a
        program with its stages) or an iterable of these. One broken plugin is logged and
        skipped so it cannot take the compile service down with it.
        """
        added: builtins.list[Program] = []
        for ep in entry_points(group=group):
            try:
                produced = ep.load()()
                items = [produced] if isinstance(produced, (Program, ProgramEntry)) else list(produced)
                entries = [_as_entry(item, ep.name) for item in items]
            except Exception:
                log.warning("skipping program plugin %r from group %r: it failed to load", ep.name, group,
                            exc_info=True)
                continue
            for entry in entries:
                try:
                    added.append(self.register(entry.program, entry.layer_fns))
                except FailedPrecondition as exc:
                    log.warning("skipping %s from plugin %r: %s", entry.program.ref, ep.name, exc)
        return added

    def _entry(self, name: str, version: str) -> ProgramEntry:
        with self._lock:
            versions = {v: e for (n, v), e in self._entries.items() if n == name}
            names = sorted({n for n, _ in self._entries})
        if not versions:
            raise NotFound(f"program {name!r} is not registered; available programs: "
                           f"{', '.join(names) or 'none'}")
        if not version:
            version = max(versions, key=version_key)
        if version not in versions:
            available = ", ".join(sorted(versions, key=version_key))
            raise NotFound(f"program {name!r} has no version {version!r}; available versions: {available}")
        found = versions[version]
        return found.entry() if isinstance(found, DeferredEntry) else found


def _program(entry: ProgramEntry | DeferredEntry) -> Program:
    return entry.summary() if isinstance(entry, DeferredEntry) else entry.program


def _content(program: Program) -> tuple[object, ...]:
    # An upload's digest covers only its bytes, so the declared signature (input names, combine
    # rules) must be compared too, or a re-upload with other rules would be silently ignored.
    return (program.digest, program.kind, program.parameters, program.inputs, program.outputs)


def _as_entry(item: object, plugin: str) -> ProgramEntry:
    if isinstance(item, ProgramEntry):
        return item
    if isinstance(item, Program):
        return ProgramEntry(item)
    raise TypeError(f"plugin {plugin!r} returned {type(item).__name__}, expected Program or ProgramEntry")


def default_registry(group: str = ENTRY_POINT_GROUP) -> ProgramRegistry:
    """A fresh registry with the built-ins and every installed plugin."""
    registry = ProgramRegistry()
    for entry in builtin_entries():
        registry.register(entry.program, entry.layer_fns)
    for deferred in builtin_deferred():
        registry.register_deferred(deferred)
    registry.load_entry_points(group)
    return registry
