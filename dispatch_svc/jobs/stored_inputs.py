"""A leased job's inputs kept on the dispatchers' shared volume, so another replica can take the
job over (takeover.py): `SpoolingFeed` writes what the client streams as the job reads it, and
`StoredFeed` reads it back a slab at a time. Both in the results' format (results.py): raw
little-endian rows and a manifest, named ``parameter:<name>`` and ``input:<name>``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.results import ResultStore

PARAMETER, INPUT = "parameter:", "input:"
SLAB_BYTES = 4 * 1024 * 1024  # rows read back at once per block


class InputFeed(Protocol):
    """Where a job's inputs come from: the client's parameters, then its rows in blocks of
    consecutive rows (the request stream, or what was stored of it)."""

    def parameters(self) -> list[tuple[str, np.ndarray]]: ...
    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]: ...


class SpoolingFeed:
    """The client's feed, written to `store` as the job reads it. Once the last row is written,
    `on_stored` says the job can be run from the store alone."""

    def __init__(self, feed: InputFeed, store: ResultStore, job: m.JobRecord, on_stored: Callable[[], None]):
        self._feed, self._store, self._job, self._on_stored = feed, store, job, on_stored
        self._parameters_done = not job.spec.client_parameters

    def __getattr__(self, name):  # close(), gone(): the client's feed's own
        return getattr(self._feed, name)

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        given = self._feed.parameters()
        self.keep_parameters(given)
        return given

    def keep_parameters(self, given: list[tuple[str, np.ndarray]]) -> None:
        for name, value in given:
            self._store.save(self._job.job_id, PARAMETER + name, value)
        self._parameters_done = True

    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        decls = self._job.spec.inputs
        writers = [self._store.create(self._job.job_id, INPUT + d.name, d.dtype, d.shape) for d in decls]
        seen = 0
        try:
            for first_row, arrays in self._feed.blocks():
                for writer, array in zip(writers, arrays):
                    writer.write_rows(first_row, array)
                seen = first_row + arrays[0].shape[0]
                yield first_row, arrays
        finally:
            for writer in writers:
                writer.close()
        if self._parameters_done and seen == (decls[0].rows if decls else 0):
            self._on_stored()


class StoredFeed:
    """A job's inputs as `SpoolingFeed` stored them: its parameters, then its rows in slabs."""

    def __init__(self, store: ResultStore, job: m.JobRecord):
        self._entries = {e.name: e for e in store.entries(job.job_id)}
        self._job = job

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        return [(name[len(PARAMETER):], entry.read()) for name, entry in self._entries.items()
                if name.startswith(PARAMETER)]

    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        decls = self._job.spec.inputs
        if not decls:
            return
        entries = [self._entries[INPUT + d.name] for d in decls]
        row_bytes = max(1, sum(e.row_bytes for e in entries))
        step = max(1, SLAB_BYTES // row_bytes)
        for first in range(0, decls[0].rows, step):
            last = min(decls[0].rows, first + step)
            yield first, [e.read_rows(first, last) for e in entries]

    def close(self) -> None:
        self._entries = {}


def store_rest(feed: InputFeed, store: ResultStore, job: m.JobRecord, on_stored: Callable[[], None]) -> None:
    """Everything of the job's inputs that `feed` has not handed out yet, written to `store` (a job
    going to the queue, before the admission gate let any of them be read): its client parameters
    and every row. `feed` may be a SpoolingFeed already (a leased job's), which keeps what it
    hands out."""
    spool = feed if isinstance(feed, SpoolingFeed) else SpoolingFeed(feed, store, job, on_stored)
    if job.spec.client_parameters:
        spool.parameters()
    for _ in spool.blocks():
        pass
