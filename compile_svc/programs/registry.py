"""Programs by (name, version): built-ins, plugins found through entry points, and uploads.

Every name belongs to one origin: built-in, plugin or uploaded. Built-in names are reserved
from plugins and uploads, plugin names from uploads, so an unpinned reference (empty version,
meaning the name's highest version) to a built-in or plugin program cannot be taken over by an
upload. Versions match exactly; uploaded versions are immutable until deleted.

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

from accelmesh.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    quoted,
)
from accelmesh.programs import Program
from compile_svc.programs.builtin import builtin_deferred, builtin_entries
from compile_svc.programs.layers import DeferredEntry, LayerFn, ProgramEntry

ENTRY_POINT_GROUP = "accelmesh.programs"
BUILTIN, PLUGIN, UPLOADED = "built-in", "plugin", "uploaded"  # a name's origin

log = logging.getLogger(__name__)

# The longest name and version any request may give (uploads.py allows new uploads shorter
# versions, so that their file names fit; these are what uploads could have before that).
MAX_NAME_CHARS = 128
MAX_VERSION_CHARS = 128
LISTED_IN_ERRORS = 20  # how many names or versions a NotFound lists before "and N more"


def check_reference(name: str, version: str, *, name_field: str = "name", version_field: str = "version") -> None:
    """Refuse a name or version no program can have (too long) before looking it up, so that
    the error says so instead of quoting a megabyte back as not found."""
    for field, value, limit in ((name_field, name, MAX_NAME_CHARS), (version_field, version, MAX_VERSION_CHARS)):
        if len(value) > limit:
            raise InvalidArgument(f"{field} {quoted(value)} is longer than the {limit} characters a program "
                                  f"{field.rsplit('.', 1)[-1]} may have; ListPrograms shows what is registered",
                                  field=field)


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Semantic-ish order: numeric runs compare as numbers ('1.10' > '1.9'), other runs as text,
    and text sorts below numbers so '2.0rc1' < '2.0.1'."""
    return tuple((1, int(tok), "") if tok.isdigit() else (0, 0, tok) for tok in re.findall(r"\d+|[^\d.\-_+]+", version))


def _order(version: str) -> tuple[object, ...]:
    # Versions that version_key ties ('1.0', '1.00') fall back to their text, so "the highest"
    # is the same in every process whatever order the versions were registered in.
    return version_key(version), version


class ProgramRegistry:
    """Thread-safe: the servicer registers uploads while other requests read. Deferred entries
    are built outside the registry lock, so one slow first build blocks no other program."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], ProgramEntry | DeferredEntry] = {}
        self._origins: dict[str, str] = {}  # name -> BUILTIN, PLUGIN or UPLOADED
        self._lock = threading.Lock()

    def register(self, program: Program, layer_fns: Iterable[LayerFn] = (), *, origin: str = BUILTIN) -> Program:
        """Add a built-in or plugin program; registering identical content again is a no-op, so
        retries are safe. Uploads go through add_upload, whose versions are immutable."""
        if origin not in (BUILTIN, PLUGIN):
            raise ValueError(f"origin must be {BUILTIN!r} or {PLUGIN!r}, got {origin!r}; uploads use add_upload")
        key = (program.name, program.version)
        with self._lock:
            self._claim(program.name, origin)
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
            self._claim(deferred.name, BUILTIN)
            existing = self._entries.get(key)
            if existing is not None and existing is not deferred:
                raise FailedPrecondition(f"program {deferred.name}@{deferred.version} is already registered; "
                                         "register it under a new version")
            self._entries[key] = deferred

    def check_upload(self, name: str, version: str) -> None:
        """Raise what add_upload would for this name and version, before the artifact is read."""
        with self._lock:
            self._check_upload(name, version)

    def add_upload(self, program: Program) -> Program:
        """Add an uploaded program under a name no built-in or plugin has and a version it lacks."""
        with self._lock:
            self._check_upload(program.name, program.version)
            self._origins[program.name] = UPLOADED
            self._entries[(program.name, program.version)] = ProgramEntry(program)
        return program

    def remove_upload(self, name: str, version: str) -> Program:
        """Remove one exact uploaded version and return it; built-in and plugin programs stay."""
        with self._lock:
            origin = self._origins.get(name)
            if origin in (BUILTIN, PLUGIN):
                raise PermissionDenied(f"name {quoted(name)} is a {origin} program's; only uploaded programs can be "
                                       "deleted (built-in and plugin programs come with the service)")
            entry = self._entries.pop((name, version), None) if origin == UPLOADED else None
            if entry is None:
                raise NotFound(f"name and version: no uploaded program {quoted(f'{name}@{version}')}; "
                               "ListPrograms shows the uploaded programs and their exact versions")
            if not any(n == name for n, _ in self._entries):
                del self._origins[name]  # its last version is gone: the name is free again
        return _program(entry)

    def get(self, name: str, version: str = "") -> Program:
        """The named program at exactly `version`; empty means the name's highest version. A
        name has versions of one origin only, so for a built-in name that is the built-in."""
        return self._entry(name, version).program

    def layer_functions(self, name: str, version: str = "") -> tuple[LayerFn, ...]:
        """The program's pipeline stages in order; empty when it is not a layered model."""
        return self._entry(name, version).layer_fns

    def list(self) -> list[Program]:
        """Every program; deferred ones may come without their layer table (get has it)."""
        with self._lock:
            entries = list(self._entries.values())
        programs = [_program(e) for e in entries]
        programs.sort(key=lambda p: (p.name, _order(p.version)))
        return programs

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP, *,
                          entry_points: Callable[..., Iterable[Any]] = importlib.metadata.entry_points
                          ) -> builtins.list[Program]:
        """Register the programs of every installed plugin; returns what was added.

        Each entry point names a zero-arg callable returning a Program, a ProgramEntry (a
        program with its stages) or an iterable of these. One broken plugin is logged and
        skipped so it cannot take the compile service down with it, and so is a program whose
        name is a built-in's: a plugin cannot shadow a built-in.
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
                    added.append(self.register(entry.program, entry.layer_fns, origin=PLUGIN))
                except FailedPrecondition as exc:
                    log.warning("skipping %s from plugin %r: %s", entry.program.ref, ep.name, exc)
        return added

    def _entry(self, name: str, version: str) -> ProgramEntry:
        with self._lock:
            versions = {v: e for (n, v), e in self._entries.items() if n == name}
            names = sorted({n for n, _ in self._entries})
        if not versions:
            raise NotFound(f"program {quoted(name)} is not registered; available programs: {_listed(names)}")
        if not version:
            version = max(versions, key=_order)
        if version not in versions:
            available = _listed(sorted(versions, key=_order))
            raise NotFound(f"program {quoted(name)} has no version {quoted(version)}; available versions: {available}")
        found = versions[version]
        return found.entry() if isinstance(found, DeferredEntry) else found

    def _claim(self, name: str, origin: str) -> None:
        """Give an unowned name to `origin`; refuse a name another origin owns. Call under the lock."""
        owner = self._origins.setdefault(name, origin)
        if owner != origin:
            raise FailedPrecondition(f"program name {name!r} belongs to {owner} programs; a {origin} program "
                                     "cannot add versions to it, register it under another name")

    def _check_upload(self, name: str, version: str) -> None:
        owner = self._origins.get(name, UPLOADED)
        if owner != UPLOADED:
            raise PermissionDenied(f"name {quoted(name)} is a {owner} program's name, and built-in and plugin names "
                                   "are reserved; upload under another name")
        if (name, version) in self._entries:
            raise AlreadyExists(f"version {quoted(version)} of {quoted(name)} is already uploaded and versions are "
                                "immutable; upload under a new version, or DeleteProgram this one first")


def _listed(items: builtins.list[str]) -> str:
    shown = ", ".join(items[:LISTED_IN_ERRORS]) or "none"
    more = len(items) - LISTED_IN_ERRORS
    return f"{shown} and {more} more (ListPrograms has them all)" if more > 0 else shown


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
