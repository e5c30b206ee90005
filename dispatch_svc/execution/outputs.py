"""A job's outputs as its pieces finish (data-parallel shards, or micro-batches leaving the last
pipeline stage): concatenated outputs written in place on disk (a data-parallel shard's as its
chunks arrive from the worker: `placer`), the others folded by their combine rule, and
`LiveJob.released_rows` advanced over the rows that are final from row 0, so RunJob can stream
them while later pieces still run.

A job that another dispatch replica may take over (its book leases jobs) also keeps each finished
piece's folded outputs on disk beside its results (``parts``), so the replica that takes it over
folds them in again instead of running those pieces twice (`finished`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from accelmesh.programs import Program
from accelmesh.runtime.tensors import Placed, PlaceTensor, WriteAt
from dispatch_svc.execution.combine import Accumulator
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.results import PARTS, ResultStore
from dispatch_svc.ports import LiveJob, ShardWork


class JobOutputs:
    """Thread-safe: pieces finish on several device threads at once."""

    def __init__(self, book: JobBook, job: m.JobRecord, live: LiveJob, program: Program,
                 pieces: Sequence[ShardWork], finished: Iterable[int] = ()):
        self._book, self._job, self._live, self._program = book, job, live, program
        self.total = sum(p.rows for p in pieces)
        self._at_row = {p.first_row: p for p in pieces}
        concat = [(i, o) for i, o in enumerate(program.outputs) if o.combine == "concat"]
        # Reopened: a job taken over has the rows its first replica wrote, even of shards whose
        # SHARD_FINISHED never reached the book (they run again here); a new job has none yet.
        self._writers = {i: book.results.reopen(job.job_id, o.name, o.dtype, (self.total, *o.shape[1:]))
                         for i, o in concat}
        self._folds = {i: Accumulator(o.combine, [p.rows for p in pieces]) for i, o in enumerate(program.outputs)
                       if o.combine != "concat"}
        live.concat_names = tuple(o.name for _, o in concat)
        self._finished: set[int] = set()  # piece indices only: their outputs are on disk once written
        self._lock = threading.Lock()
        # A leased job's folded parts, kept until it ends (deleted with its results).
        self._parts = ResultStore(book.results.root / job.job_id) if book.lease_s and self._folds else None
        if finished:
            self._restore(set(finished))

    def _restore(self, finished: set[int]) -> None:
        """The pieces a replica that ran the job before finished: their rows are on disk, their
        folded parts beside them."""
        parts = {e.name: e for e in self._parts.entries(PARTS)} if self._parts is not None else {}
        for index in sorted(finished):
            for i, fold in self._folds.items():
                fold.add(index, parts[f"{index}.{i}"].read())
        self._finished |= finished
        self._advance()

    def _advance(self) -> None:
        live = self._live
        while live.released_rows < self.total and self._at_row[live.released_rows].index in self._finished:
            live.released_rows += self._at_row[live.released_rows].rows
        self._job.progress = live.released_rows / self.total if self.total else 0.0

    def placer(self, piece: ShardWork) -> PlaceTensor:
        """Where the piece's concatenated outputs go as their chunks arrive (a worker announces a
        shard's outputs in the program's order): their rows in the result files, for an output
        announced with the dtype and shape it must have; any other (a wrong one, which the shard's
        check then fails) is kept in memory. An attempt that fails leaves rows nobody reads (they
        are not released until the piece is taken), and the next attempt writes them again, after
        it: a shard's attempts never overlap."""
        def place(index: int, dtype: np.dtype, shape: tuple[int, ...]) -> WriteAt | None:
            writer = self._writers.get(index)
            if writer is None or dtype != writer.entry.dtype or shape != (piece.rows, *writer.entry.shape[1:]):
                return None
            return writer.rows_from(piece.first_row)
        return place

    def take(self, piece: ShardWork, outputs: Sequence[np.ndarray | Placed]) -> int:
        """Write or fold one finished piece's outputs (those `placer` placed are written already);
        returns how many pieces are in."""
        with self._lock:
            for i, writer in self._writers.items():
                if not isinstance(outputs[i], Placed):
                    writer.write_rows(piece.first_row, outputs[i])
            for i, fold in self._folds.items():
                if self._parts is not None:
                    self._parts.save(PARTS, f"{piece.index}.{i}", np.asarray(outputs[i]))
                fold.add(piece.index, outputs[i])
            self._finished.add(piece.index)
            self._advance()
            return len(self._finished)

    def close(self) -> None:
        """Every piece is in: save the folded outputs and close the written ones."""
        for i, fold in self._folds.items():
            self._book.results.save(self._job.job_id, self._program.outputs[i].name, fold.result())
        for writer in self._writers.values():
            writer.close()
