"""Credential files read again when they change: certificates, keys, tokens and token tables are
replaced in place (a Secret update, cert-manager's renewal, an edited tokens file), and every
reader notices on its next use, without a restart."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from accelmesh import errors

T = TypeVar("T")


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """Changes whenever the file is replaced (a new inode) or rewritten; None while it is missing."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class ReloadingFile(Generic[T]):
    """A file's parsed contents, parsed again when its stamp changes (checked on every use)."""

    def __init__(self, path: Path, parse: Callable[[bytes], T]):
        self._path, self._parse = Path(path), parse
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._value: T | None = None

    def get(self) -> T:
        stamp = file_stamp(self._path)
        if stamp is None:
            raise errors.FailedPrecondition(f"{self._path} is missing; restore it or point the setting elsewhere")
        with self._lock:
            if stamp != self._stamp:
                self._value, self._stamp = self._parse(self._path.read_bytes()), stamp
            return self._value
