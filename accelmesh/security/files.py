"""Files the mesh writes, owner-only (private_dir, write_private, open_private), and credential
files read again when they change: certificates, keys, tokens and token tables are
replaced in place (a Secret update, cert-manager's renewal, an edited tokens file), and every
reader notices on its next use, without a restart."""

from __future__ import annotations

import errno
import os
import stat
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


# The mesh's files hold tokens, keys, tenants' inputs and results, artifacts and databases: owner
# only, whatever the umask (a service started as root under umask 022 would otherwise leave them
# readable by every local account).
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


def _tighten(path: Path, mode: int) -> None:
    """`path` chmod-ed to `mode` when it exists and this process owns it: a folder or file another
    account owns (a shared volume's root) is not the mesh's to change, nor is a sticky folder
    shared by every account (/tmp), even one root owns and the mesh was pointed at."""
    try:
        info = os.stat(path)
        if info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EROFS:  # a read-only mount (a Secret's) is as its owner made it
            raise


def tighten_private(path: str | Path) -> None:
    """An existing file of this process's own made 0600 (a folder 0700); a missing one is left missing."""
    path = Path(path)
    _tighten(path, PRIVATE_DIR if path.is_dir() else PRIVATE_FILE)


def private_dir(path: str | Path, *, tighten: bool = True) -> Path:
    """`path` as a folder only its owner may enter: it and any missing parents are created 0700;
    an existing `path` of this process's own is tightened to 0700 unless `tighten` is False (a
    folder the caller was merely pointed into, such as a database file's)."""
    path = Path(path)
    missing: list[Path] = []
    folder = path
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # made at the same time by another replica or thread
            continue
        os.chmod(folder, PRIVATE_DIR)  # mkdir's mode is masked by the umask, which may drop owner bits
    if tighten and path not in missing:
        _tighten(path, PRIVATE_DIR)
    return path


def open_private(path: str | Path, flags: int = os.O_WRONLY) -> int:
    """A descriptor on `path`, created 0600 when missing; an existing file is tightened to 0600."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: str | Path) -> Path:
    """`path` as an owner-only file: created empty when missing, else tightened to 0600 when this
    process owns it (its contents are left as they are, and it is never opened to write)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        _tighten(Path(path), PRIVATE_FILE)
    else:
        os.close(fd)
    return Path(path)


def write_private(path: str | Path, data: bytes | str) -> None:
    """`data` as the whole of `path`, 0600: written to a fresh file beside it and renamed over it,
    so a reader never sees half a file and the old file's mode never carries over."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), PRIVATE_FILE)
            out.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
