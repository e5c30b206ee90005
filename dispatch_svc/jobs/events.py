"""A job's event log: each event numbered in the order it happened and kept in the events table,
and watchers that wait on a condition for new ones instead of polling.

A shard's events (SHARD_STARTED, SHARD_FINISHED: two a shard, thousands a job) are not written one
transaction each: they wait in memory, at most FLUSH_S or FLUSH_EVENTS of them, and go in one
transaction; any other event writes them first, so the log's order holds. A watcher in this
process reads the waiting ones from memory. A dispatcher that stops loses at most those: alone,
its running jobs end FAILED at its restart anyway; sharing the book with other replicas
(leased), it writes them before a watcher sees them, so no client is told of a finished shard
that a replica taking the job over would not keep (one nobody saw is run again there).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

import sqlalchemy as sa

from accelmesh import errors
from accelmesh.runtime import database
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.codec import event_from, event_text
from dispatch_svc.jobs.rows import MAX_RECORD_CHARS, lease_lost, without
from dispatch_svc.jobs.schema.tables import events as events_table
from dispatch_svc.jobs.schema.tables import jobs as jobs_table

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.5  # how often a watcher looks for events another process (a dispatch replica) wrote
FOLLOW_OUTAGE_S = 30.0  # how long a watcher keeps looking while the database does not answer
OUTAGE_RETRY_S = 0.5  # between those looks
# A shard's events are written in batches (see above): this long at most after they happened, or
# once this many wait, whichever comes first.
BATCHED_EVENTS = frozenset({m.SHARD_STARTED, m.SHARD_FINISHED})
FLUSH_S = 0.05
FLUSH_EVENTS = 256

_J, _E = jobs_table.c, events_table.c
_EVENT_COUNT = sa.select(sa.func.count()).select_from(events_table).where(_E.job_id == sa.bindparam("job_id"))
_INSERT_EVENT = events_table.insert()
# Leased: an event is logged only by the replica that holds the job (none back: another one does).
_INSERT_HELD_EVENT = events_table.insert().from_select(
    ["job_id", "idx", "event", "brief"],
    sa.select(sa.bindparam("e_job", type_=sa.Text), sa.bindparam("e_idx", type_=sa.Integer),
              sa.bindparam("e_event", type_=sa.Text), sa.bindparam("e_brief", type_=sa.Text)).where(
        sa.exists().where(_J.job_id == sa.bindparam("e_job"), _J.runner == sa.bindparam("me")))).returning(_E.idx)
_ALL_EVENTS = sa.select(_E.event).where(_E.job_id == sa.bindparam("job_id")).order_by(_E.idx)
_EVENTS_FROM = sa.select(
    _E.idx, sa.case((sa.func.length(_E.event) <= MAX_RECORD_CHARS, _E.event), else_=_E.brief)).where(
    _E.job_id == sa.bindparam("job_id"), _E.idx >= sa.bindparam("from_index")).order_by(_E.idx)

# A batched event not written yet: (index, its text as the database gets it, the text without
# its plan when too long, the event as a watcher here gets it).
_Pending = tuple[int, str, "str | None", m.Event]


class EventLog:
    """The events of one book's jobs, under the book's `lock`. Watchers wait on `changed`, which
    the book notifies when a record changes too."""

    def __init__(self, engine: sa.Engine, lock: threading.RLock, *, lease_s: float, replica: str,
                 clock: Callable[[], float]):
        self._engine = engine
        self.changed = threading.Condition(lock)
        self._lease_s, self._replica, self._clock = lease_s, replica, clock
        self._counts: dict[str, int] = {}  # events logged per job: the next event's index
        # Batched events not yet written, by job, in order; `_due` is when the oldest must be
        # written. The flusher thread starts with the first one.
        self._pending: dict[str, list[_Pending]] = {}
        self._pending_count, self._due = 0, 0.0
        self._flusher: threading.Thread | None = None
        self._flush_wanted = threading.Condition(lock)  # the flusher's own: watchers are not woken by it
        self._closed = False

    def close(self) -> None:
        """Write what waits and stop the flusher; called with the book's lock held."""
        self._closed = True
        self.changed.notify_all()
        self._flush_wanted.notify_all()
        try:
            self.flush()
        except errors.AccelmeshError as exc:  # the database went first: nothing more to do
            log.warning("%d job events could not be written at close: %s", self._pending_count, exc)

    def join(self) -> None:
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    @property
    def counted(self) -> set[str]:
        """The jobs whose next event index this process knows (the running ones)."""
        return set(self._counts)

    def forget(self, job_id: str) -> None:
        """The job is final here or another replica's: its count is read from the database if ever needed."""
        self._counts.pop(job_id, None)

    def emit(self, job: m.JobRecord, type_: str, **fields) -> m.Event:
        with self.changed:
            if type_ in BATCHED_EVENTS and job.job_id in self._counts and not self._closed:
                return self._defer(job, type_, fields)
            self.flush()  # the waiting events first: the log keeps the order they happened in
            for attempt in range(3):
                count = self._counts.get(job.job_id)
                if count is None:  # first event of this job in this process: counted once, then kept
                    with database.connected(self._engine) as connection:
                        count = connection.execute(_EVENT_COUNT, {"job_id": job.job_id}).scalar_one()
                event = m.Event(index=count, type=type_, time=self._clock(), progress=job.progress, **fields)
                try:
                    self._log(job.job_id, event)
                    break
                except sa.exc.IntegrityError:
                    # That index is taken: the replica this one took the job over from logged it
                    # as the job changed hands. Counted again.
                    self._counts.pop(job.job_id, None)
                    if attempt == 2:
                        raise lease_lost(job.job_id) from None
            self._counts[job.job_id] = count + 1
            self.changed.notify_all()
            return event

    def _defer(self, job: m.JobRecord, type_: str, fields: dict) -> m.Event:
        """A batched event: indexed and serialized now (the shard record it carries changes later),
        written with the next flush."""
        count = self._counts[job.job_id]
        shard = fields.pop("shard", None)
        if shard is not None:  # a copy: the record goes on changing, the event tells it as it was now
            fields["shard"] = dataclasses.replace(shard, failures=list(shard.failures))
        event = m.Event(index=count, type=type_, time=self._clock(), progress=job.progress, **fields)
        text = event_text(event)
        brief = without(text, ("plan",)) if len(text) > MAX_RECORD_CHARS else None
        if not self._pending_count:
            self._due = time.monotonic() + FLUSH_S
            self._flush_wanted.notify()
        self._pending.setdefault(job.job_id, []).append((count, text, brief, event))
        self._pending_count += 1
        self._counts[job.job_id] = count + 1
        if self._pending_count >= FLUSH_EVENTS:
            self.flush()
        elif self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_when_due, name="job-events", daemon=True)
            self._flusher.start()
        self.changed.notify_all()
        return event

    def flush(self) -> None:
        """Write the batched events now, in one transaction. Leased, an event of a job this replica
        no longer holds is refused (another replica runs it now; its own writes say so)."""
        with self.changed:
            if not self._pending_count:
                return
            self._write(self._pending)  # if the database is away, they wait for the next flush
            self._pending, self._pending_count = {}, 0

    def read(self, job_id: str, from_index: int, final: Callable[[str], bool], idle: object = None,
             idle_s: Callable[[], float] | None = None) -> Iterator[m.Event]:
        """Every event of the job from `from_index` on; blocks for new ones until `final(job_id)`
        says it ended. `idle`, if given, is yielded before each wait for more (JobBook.events);
        with `idle_s` too, each wait lasts at most what it says and `idle` comes again after it.
        A database that does not answer is looked at again for FOLLOW_OUTAGE_S before its
        Unavailable is raised: a watcher (RunJob, WatchJob) rides out a restart of a few seconds
        rather than end its call, which, for RunJob, would have stopped the job."""
        index, said_idle, outage_since = from_index, False, None
        while True:
            try:
                waiting, rows, ended = self._look(job_id, index, final, wait=said_idle or idle is None,
                                                  wait_s=WATCH_POLL_S if idle_s is None else idle_s())
            except errors.Unavailable:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since >= FOLLOW_OUTAGE_S:
                    raise
                with self.changed:
                    self.changed.wait(OUTAGE_RETRY_S)  # a back-off while the database restarts
                continue
            outage_since = None
            if ended:
                return
            if not rows and not waiting:
                # About to wait: said outside the lock, then looked at again; with idle_s, said
                # again after each wait.
                if idle is not None and (not said_idle or idle_s is not None):
                    said_idle = True
                    yield idle
                continue
            said_idle = False
            for event in waiting:
                index = event.index + 1
                yield event
            for idx, text in rows:
                index = idx + 1
                try:
                    event = event_from(json.loads(text))
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning("job %s: event %d does not parse (%s); skipped", job_id, idx, exc)
                    continue
                yield event

    def _look(self, job_id: str, index: int, final: Callable[[str], bool], *, wait: bool,
              wait_s: float = WATCH_POLL_S) -> tuple[list[m.Event], list, bool]:
        """The events from `index` on (batched ones from memory, the rest from the database), and
        whether the job ended with none left; with none, not ended and `wait`, it then waits up to
        `wait_s` under the same lock as the look, so no write in between goes unnoticed."""
        with self.changed:
            # Batched events not written yet come from memory; the database has those before them.
            # An event too long to send (an old plan event of a huge job) comes without its plan.
            waiting = self._waiting(job_id, index)
            if waiting and self._lease_s:
                # Shared with other replicas: what a client saw is written before it sees it,
                # so a replica taking the job over keeps every shard a client was told finished.
                self.flush()
            rows = []
            if not waiting and not self._caught_up(job_id, index):
                with database.connected(self._engine) as connection:
                    rows = connection.execute(_EVENTS_FROM, {"job_id": job_id, "from_index": index}).all()
            if rows or waiting:
                return waiting, rows, False
            if final(job_id):
                return [], [], True
            if wait:
                # Woken at once by this process's writes; another replica's (a job it runs,
                # watched through this one) are read at the next look, WATCH_POLL_S on.
                self.changed.wait(wait_s)
            return [], [], False

    def finished_shards(self, job_id: str) -> set[int]:
        """The shards a SHARD_FINISHED event says are done (their outputs were written before it)."""
        self.flush()
        with database.connected(self._engine) as connection:
            texts = connection.execute(_ALL_EVENTS, {"job_id": job_id}).scalars().all()
        done = set()
        for text in texts:
            try:
                data = json.loads(text)
            except ValueError:
                continue
            if data.get("type") == m.SHARD_FINISHED and isinstance(data.get("shard"), dict):
                done.add(int(data["shard"]["index"]))
        return done

    def _waiting(self, job_id: str, from_index: int) -> list[m.Event]:
        """The job's batched events from `from_index` on, if the first of them is that one: as
        they were made (as `read` would read them back, without parsing them again)."""
        events = self._pending.get(job_id)
        if not events or events[0][0] > from_index or events[-1][0] < from_index:
            return []
        return [event if brief is None else event_from(json.loads(brief))
                for _, _, brief, event in events[from_index - events[0][0]:]]

    def _caught_up(self, job_id: str, index: int) -> bool:
        """Whether a watcher at `index` has had every event of a job this process logs, so the
        database has none for it either (asking it would cost a query per wake, per shard). Only
        unleased: a leased job can pass to another replica, whose events only the database has."""
        return not self._lease_s and self._counts.get(job_id, -1) == index

    def _log(self, job_id: str, event: m.Event) -> None:
        text = event_text(event)
        brief = without(text, ("plan",)) if len(text) > MAX_RECORD_CHARS else None
        if not self._lease_s:
            row = {"job_id": job_id, "idx": event.index, "event": text, "brief": brief}
            database.transaction(self._engine, lambda c: c.execute(_INSERT_EVENT, row),
                                 reraise=(sa.exc.IntegrityError,))
            return
        row = {"e_job": job_id, "e_idx": event.index, "e_event": text, "e_brief": brief, "me": self._replica}
        if database.transaction(self._engine, lambda c: c.execute(_INSERT_HELD_EVENT, row).first(),
                                reraise=(sa.exc.IntegrityError,)) is None:
            raise lease_lost(job_id)

    def _write(self, pending: dict[str, list[_Pending]]) -> None:
        if not self._lease_s:
            rows = [{"job_id": job_id, "idx": idx, "event": text, "brief": brief}
                    for job_id, events in pending.items() for idx, text, brief, _ in events]
            try:
                database.transaction(self._engine, lambda c: c.execute(_INSERT_EVENT, rows),
                                     reraise=(sa.exc.IntegrityError,))
            except sa.exc.IntegrityError:  # not expected unleased: another process writes this book
                log.warning("%d job events were not written: their indexes were taken", len(rows))
            return

        def insert(connection) -> list[str]:
            refused = []
            for job_id, events in pending.items():
                for idx, text, brief, _ in events:
                    row = {"e_job": job_id, "e_idx": idx, "e_event": text, "e_brief": brief, "me": self._replica}
                    try:
                        with connection.begin_nested():
                            taken = connection.execute(_INSERT_HELD_EVENT, row).first() is not None
                    except sa.exc.IntegrityError:
                        taken = False
                    if not taken:
                        refused.append(job_id)
                        break
            return refused

        for job_id in database.transaction(self._engine, insert):
            log.warning("events of job %s were not written: %s", job_id, lease_lost(job_id))

    def _flush_when_due(self) -> None:
        with self.changed:
            while not self._closed:
                if not self._pending_count:
                    self._flush_wanted.wait()
                    continue
                left = self._due - time.monotonic()
                if left > 0:
                    self._flush_wanted.wait(left)
                    continue
                try:
                    self.flush()
                except errors.AccelmeshError as exc:  # the database is away: the events wait for the next try
                    log.warning("job events could not be written (%s); tried again in %.2f s", exc, FLUSH_S)
                    self._due = time.monotonic() + FLUSH_S
