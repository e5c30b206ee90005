"""A job's results on disk, next to the job book's database: each result tensor a raw file of
little-endian rows plus an entry in the job's manifest, written as shards finish and read a slab
at a time, so no result is ever held whole in the dispatcher's memory."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy for results
import numpy as np

from accelmesh import errors
from accelmesh.runtime.tensors import WriteAt
from accelmesh.security.files import open_private, private_dir, write_private

PARTS = "parts"  # a leased job's folded parts (outputs.py), in its results folder, until it ends


@dataclass(frozen=True)
class ResultEntry:
    """One result tensor on disk: raw little-endian rows, read a slab at a time."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path

    @functools.cached_property  # asked for every shard written and every slab read: np.prod is not free
    def row_elements(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize

    def read_rows(self, first: int, last: int) -> np.ndarray:
        if not self.shape:
            return self._read(0, 1).reshape(())
        rows = last - first
        return self._read(first * self.row_bytes, rows * self.row_elements).reshape((rows, *self.shape[1:]))

    def _read(self, at: int, count: int) -> np.ndarray:
        """`count` elements from byte `at`, read straight into their array (os.preadv: a small
        shard's rows cost 8 us here, where np.fromfile's file object cost 40)."""
        out = np.empty(count, self.dtype)
        view, done = memoryview(out.view(np.uint8)), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(view):  # preadv may read less than asked
                got = os.preadv(fd, [view[done:]], at + done)
                if got == 0:
                    raise errors.FailedPrecondition(
                        f"result '{self.name}' ends {len(view) - done} bytes short of the rows asked for on disk "
                        f"({self.path}); the job's results are incomplete, run it again")
                done += got
        finally:
            os.close(fd)
        return out

    def read(self) -> np.ndarray:
        return self.read_rows(0, self.shape[0] if self.shape else 1)


class ResultWriter:
    """Writes rows in place (pwrite, not a memory map: written results never count against the
    dispatcher's memory)."""

    def __init__(self, entry: ResultEntry):
        self.entry = entry
        self._fd = open_private(entry.path)  # tenants' data: the owner's alone

    def write_rows(self, first_row: int, rows: np.ndarray) -> None:
        # From the array's own memory (no bytes copy of it).
        self._write(first_row * self.entry.row_bytes,
                    memoryview(np.ascontiguousarray(rows, dtype=self.entry.dtype).reshape(-1).view(np.uint8)))

    def rows_from(self, first_row: int) -> WriteAt:
        """write(offset, data): bytes of rows from `first_row` on, `offset` bytes into them (a
        shard's output written as its chunks arrive: accelmesh.runtime.tensors.PlaceTensor)."""
        base = first_row * self.entry.row_bytes
        return lambda offset, data: self._write(base + offset, memoryview(data))

    def _write(self, at: int, data: memoryview) -> None:
        while data:  # pwrite may write less than asked
            written = os.pwrite(self._fd, data, at)
            data, at = data[written:], at + written

    def close(self) -> None:
        os.close(self._fd)


class ResultStore:
    """Each result tensor is a raw file plus a manifest entry, written as shards finish."""

    def __init__(self, root: Path):
        self.root = private_dir(root)

    def _dir(self, job_id: str) -> Path:
        return self.root / job_id

    def create(self, job_id: str, name: str, dtype: str, shape: tuple[int, ...]) -> ResultWriter:
        folder = self._dir(job_id)
        private_dir(folder, tighten=False)
        manifest = self._manifest(job_id)
        manifest.append({"name": name, "dtype": dtype, "shape": list(shape)})
        # Whole or not at all: a reader (FetchResult, a run streaming its outputs) never sees a
        # manifest half written.
        write_private(folder / "manifest.json", json.dumps(manifest))
        return ResultWriter(self._entry(job_id, len(manifest) - 1, manifest[-1]))

    def reopen(self, job_id: str, name: str, dtype: str, shape: tuple[int, ...]) -> ResultWriter:
        """The writer of result `name`, as written so far (a job taken over goes on writing it);
        created when the job has none of that name yet."""
        for index, item in enumerate(self._manifest(job_id)):
            if item["name"] == name and item["dtype"] == dtype and tuple(item["shape"]) == tuple(shape):
                return ResultWriter(self._entry(job_id, index, item))
        return self.create(job_id, name, dtype, shape)

    def save(self, job_id: str, name: str, value: np.ndarray) -> None:
        writer = self.create(job_id, name, str(value.dtype), value.shape)
        writer.write_rows(0, value)
        writer.close()

    def _manifest(self, job_id: str) -> list[dict]:
        path = self._dir(job_id) / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else []

    def _entry(self, job_id: str, index: int, item: dict) -> ResultEntry:
        return ResultEntry(item["name"], np.dtype(item["dtype"]), tuple(item["shape"]),
                           self._dir(job_id) / f"{index}.bin")

    def entries(self, job_id: str) -> list[ResultEntry]:
        return [self._entry(job_id, i, item) for i, item in enumerate(self._manifest(job_id))]

    def delete(self, job_id: str) -> None:
        shutil.rmtree(self._dir(job_id), ignore_errors=True)
