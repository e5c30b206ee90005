"""What a job hands back to its client, in the order it is sent: events as they happen, rows of
concatenated outputs as soon as they are final, the folded outputs once the job succeeded, and
the final record. Results are read from the job book a slab at a time, so no result is held
whole; the servicer only turns each piece into its message. IDLE among the pieces says the job
has nothing more ready for now (the servicer sends what it gathered for a batch then).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from accelmesh import errors
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.events import BATCHED_EVENTS, WATCH_POLL_S
from dispatch_svc.jobs.results import ResultEntry
from dispatch_svc.ports import InputFeed, LiveJob


@dataclass(frozen=True)
class EventOut:
    event: m.Event


@dataclass(frozen=True)
class TensorOut:
    """A result tensor begins: its name, dtype and whole shape."""

    entry: ResultEntry


@dataclass(frozen=True)
class RowsOut:
    """Rows [first_row, first_row + len(rows)) of the tensor begun last."""

    entry: ResultEntry
    first_row: int
    rows: np.ndarray


@dataclass(frozen=True)
class JobOut:
    job: m.JobRecord


@dataclass(frozen=True)
class WantedOut:
    """DATA_PATH_DIRECT: shards whose inputs the client is to put where each says."""

    shards: list


@dataclass(frozen=True)
class OutputsOut:
    """DATA_PATH_DIRECT: where every shard's outputs lie, in row order (the job succeeded)."""

    shards: list


Piece = EventOut | TensorOut | RowsOut | JobOut | WantedOut | OutputsOut
IDLE = object()  # a piece: nothing more is ready until the job's next event
# A live RunJob stream's shard events and result rows wait this long at most for more to send
# with them, not only until nothing more is ready: a job of small shards went out in about one
# message a shard (185 for 200), each costing the dispatcher and the client a gRPC message.
# Anything else (where to put or fetch a direct job's bytes, the job's end, its other events)
# goes as soon as nothing more is ready.
LINGER_S = 0.01


class _Linger:
    """When `run` lets what it yielded since its last IDLE go (see LINGER_S)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock, self._since, self._urgent = clock, None, False

    def added(self, urgent: bool) -> None:
        if urgent:
            self._urgent = True
        elif self._since is None:
            self._since = self._clock()

    def due(self) -> bool:
        """At an IDLE: whether what was gathered goes now (the next gathering then starts)."""
        if not self._urgent and self._since is not None and self._clock() - self._since < LINGER_S:
            return False
        self._since, self._urgent = None, False
        return True

    def wait_s(self) -> float:
        """How long the events' next wait may last before an IDLE must come again."""
        if self._urgent or self._since is None:
            return WATCH_POLL_S
        return max(0.0, LINGER_S - (self._clock() - self._since))


def slabs(entry: ResultEntry, first: int, last: int, slab_bytes: int) -> Iterator[RowsOut]:
    """Rows [first, last) of a result, read from disk `slab_bytes` at a time."""
    rows_per_slab = max(1, slab_bytes // max(1, entry.row_bytes))
    for start in range(first, last, rows_per_slab):
        yield RowsOut(entry, start, entry.read_rows(start, min(last, start + rows_per_slab)))


def whole(entry: ResultEntry, slab_bytes: int) -> Iterator[TensorOut | RowsOut]:
    yield TensorOut(entry)
    yield from slabs(entry, 0, entry.shape[0] if entry.shape else 1, slab_bytes)


def results(book: JobBook, job_id: str, slab_bytes: int) -> Iterator[TensorOut | RowsOut]:
    """Every result of a finished job (FetchResult)."""
    for entry in book.results.entries(job_id):
        yield from whole(entry, slab_bytes)


def replay(book: JobBook, job_id: str, slab_bytes: int) -> Iterator[Piece]:
    """What a RunJob retried with its request id is sent (AIP-155): the job its first attempt
    created, from its first event to its end (waiting while it runs), then its results and the job."""
    yield from (IDLE if event is IDLE else EventOut(event) for event in book.events(job_id, idle=IDLE))
    yield from _ending(book, job_id, slab_bytes)


def _ending(book: JobBook, job_id: str, slab_bytes: int) -> Iterator[Piece]:
    """A job's end as `replay` sends it, once its events are out: results, or its error as a status."""
    final = book.get(job_id)
    if final.state == m.SUCCEEDED:
        yield from results(book, job_id, slab_bytes)
    elif final.state == m.CANCELLED:
        raise errors.Cancelled(final.error or "the job was cancelled")
    elif final.state == m.FAILED:
        raise errors.FailedPrecondition(_failed(final))
    yield JobOut(final)


def _failed(job: m.JobRecord) -> str:
    """What the client of a job that failed is told when the job's own error is not at hand (a
    retried request, or a job that ran from the queue): its error, and what running it again takes.
    A retry with the same request id only replays this end (AIP-155), so that needs a new one; a
    job sent without one (the queued case) is named by its id alone, and runs again if sent again."""
    request_id = job.spec.request_id
    if request_id:
        return (f"job {job.job_id} of request_id {errors.quoted(request_id)} failed: {job.error}; a retry with "
                "this request_id is answered with this same end, so send the job with a new request_id to run it "
                "again")
    return f"job {job.job_id} failed: {job.error}; submit the job again to run it again"


def run(runner: JobRunner, job: m.JobRecord, live: LiveJob, feed: InputFeed, slab_bytes: int) -> Iterator[Piece]:
    """Run the job, taking its inputs on a thread of its own, and yield what its client is sent
    (RunJob). A job that failed ends the stream with its error, after its events. A job that went
    to the queue runs later, maybe on another replica: from its QUEUED event on it is followed
    through the book as `replay` follows it, and its results are sent once it succeeded."""
    failure: list[BaseException] = []

    def feed_inputs():
        try:
            runner.run(job, live, feed)
        except Exception as exc:  # noqa: BLE001 - recorded on the job; re-raised below for the status
            failure.append(exc)

    # The feeding thread carries the caller's context, so the job joins the client's trace.
    threading.Thread(target=contextvars.copy_context().run, args=(feed_inputs,), name=f"inputs-{job.job_id}",
                     daemon=True).start()
    book, sent_rows = runner.book, 0
    concat: list[ResultEntry] | None = None  # the concatenated results, read from the manifest once
    queued = False
    linger = _Linger()
    for event in book.events(job.job_id, idle=IDLE, idle_s=linger.wait_s):
        if event is IDLE:
            if linger.due():
                yield IDLE
            continue
        yield EventOut(event)
        linger.added(event.type not in BATCHED_EVENTS)
        queued = queued or event.type == m.QUEUED_EVENT
        if queued:
            continue
        if live.direct is not None:  # no row comes this way: where the client puts inputs and fetches outputs
            if event.type == m.INPUTS_WANTED:
                wanted = live.direct.take_wanted()
                if wanted:  # INPUTS_WANTED is not a shard event: this goes at the next IDLE already
                    yield WantedOut(wanted)
            elif event.type == m.SHARD_FINISHED:
                finished = live.direct.take_finished()
                if finished:
                    yield OutputsOut(finished)
                    linger.added(True)
            continue
        if event.type in (m.SHARD_FINISHED, "succeeded"):
            released = live.released_rows
            if released > sent_rows:
                if concat is None:  # their entries were made before any shard finished (outputs.py)
                    concat = [e for e in book.results.entries(job.job_id) if e.name in live.concat_names]
                yield from _released(concat, sent_rows, released, slab_bytes)
                sent_rows = released
    live.done.wait()
    if queued:
        yield from _ending(book, job.job_id, slab_bytes)
        return
    final = book.get(job.job_id)
    if final.state == m.SUCCEEDED and live.direct is not None:
        finished = live.direct.take_finished(every=True)  # any its SHARD_FINISHED events did not bring
        if finished:
            yield OutputsOut(finished)
    elif final.state == m.SUCCEEDED:
        for entry in book.results.entries(job.job_id):
            if entry.name not in live.concat_names:
                yield from whole(entry, slab_bytes)
    elif live.error is not None or failure:
        error = live.error or failure[0]
        if isinstance(error, errors.Cancelled):  # a status, not a bug: CANCELLED with the job's reason
            raise errors.Cancelled(str(error) or final.error or "the job was cancelled") from None
        raise error
    yield JobOut(final)


def _released(concat: list[ResultEntry], sent: int, released: int, slab_bytes: int) -> Iterator[TensorOut | RowsOut]:
    for entry in concat:
        if sent == 0:
            yield TensorOut(entry)
        yield from slabs(entry, sent, released, slab_bytes)
