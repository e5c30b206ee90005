"""Jobs and their event logs, kept in a database (a SQLite file by default, or PostgreSQL by URL)
so a client can reconnect (and a restart loses no finished result); results live as raw arrays on
disk under the data dir (results.py). A record and an event are stored as the JSON of
codec.py; the tables and their migrations are in schema/.

`JobBook` is the one place job state changes: every change is written through, and watchers
wait on a condition for new events instead of polling.

A shard's events (SHARD_STARTED, SHARD_FINISHED: two a shard, thousands a job) are not written one
transaction each: they wait in memory, at most FLUSH_S or FLUSH_EVENTS of them, and go in one
transaction; any other event or change of the record writes them first, so the log's order holds.
A watcher in this process reads the waiting ones from memory. A dispatcher that stops loses at
most those: alone, its running jobs end FAILED at its restart anyway; sharing the book with other
replicas (leased), it writes them before a watcher sees them, so no client is told of a finished
shard that a replica taking the job over would not keep (one nobody saw is run again there).

A record stays small whatever its job declared (codec.py stores a plan's shards as runs), and
a record read back longer than MAX_RECORD_CHARS (one written before the limits existed) is read
without its plan, shard records and losses, with a log line, so it can never make GetJob or
ListJobs fail for everyone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from accelmesh import errors
from accelmesh.runtime import database
from accelmesh.errors import quoted
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.codec import event_from, event_text, record_from, record_text
from dispatch_svc.jobs.results import PARTS, ResultStore
from dispatch_svc.jobs.schema import SCRIPTS, VERSION_TABLE
from dispatch_svc.jobs.schema.tables import events as events_table
from dispatch_svc.jobs.schema.tables import jobs as jobs_table

log = logging.getLogger(__name__)

RESTART_ERROR = "the dispatcher restarted while the job was running; submit it again"
INPUTS_LOST_ERROR = ("the dispatch replica running this job stopped before the job's inputs had all arrived, so no "
                     "other replica could take it over; submit it again")
# A stored record or event longer than this is read without its plan, shards and losses: a
# Job message about half as long (JSON is the wordier), far below the 16 MiB message limit. A job
# within the dispatcher's limits (config.JobLimits) stays well under it.
MAX_RECORD_CHARS = 4 * 1024 * 1024
WATCH_POLL_S = 0.5  # how often a watcher looks for events another process (a dispatch replica) wrote
# Records longer than this are trimmed by SQLite for a listing, which shows no per-shard lists:
# the dispatcher then parses kilobytes per listed job, not megabytes.
LISTING_TRIM_CHARS = 64 * 1024
LISTING_READ_ROWS = 50  # rows a listing reads from the database at a time (see JobBook.listing)
# What a listing leaves out of a record (its `summary`), and so what one too long to read lacks too.
_LISTING_DROPS = ("shards", "losses", ("plan", "shards"), ("plan", "shard_runs"), ("plan", "placement", "layers"))
OVERSIZED_ERROR = "this job's stored record was too large to read in full; its plan and shard records are left out"
UNREADABLE_ERROR = "this job's stored record could not be read; only its state and times are known"
# A shard's events are written in batches (see above): this long at most after they happened, or
# once this many wait, whichever comes first.
BATCHED_EVENTS = frozenset({m.SHARD_STARTED, m.SHARD_FINISHED})
FLUSH_S = 0.05
FLUSH_EVENTS = 256


# The book's statements, built once: SQLAlchemy then compiles each once and a call only binds values.
_J, _E = jobs_table.c, events_table.c
_BY_REQUEST = sa.select(_J.job_id).where(_J.owner == sa.bindparam("owner"), _J.request_id == sa.bindparam("request_id"))
_EVENT_COUNT = sa.select(sa.func.count()).select_from(events_table).where(_E.job_id == sa.bindparam("job_id"))
_INSERT_EVENT = events_table.insert()
# Leased: an event is logged only by the replica that holds the job (none back: another one does).
_INSERT_HELD_EVENT = events_table.insert().from_select(
    ["job_id", "idx", "event", "brief"],
    sa.select(sa.bindparam("e_job", type_=sa.Text), sa.bindparam("e_idx", type_=sa.Integer),
              sa.bindparam("e_event", type_=sa.Text), sa.bindparam("e_brief", type_=sa.Text)).where(
        sa.exists().where(_J.job_id == sa.bindparam("e_job"), _J.runner == sa.bindparam("me")))).returning(_E.idx)
# A queued job is not interrupted by a restart: its inputs are stored and the queue starts it.
_UNFINISHED = sa.select(_J.job_id).where(_J.state.not_in((*m.FINAL_STATES, m.QUEUED)))
# Leased: the unfinished jobs no replica leases (from before leases, or an unleased dispatcher),
# taken by this one to be ended, with a lease so that a replica starting with it leaves them be.
_CLAIM_UNLEASED = jobs_table.update().where(_J.state.not_in((*m.FINAL_STATES, m.QUEUED)),
                                             _J.runner_until.is_(None)).values(
    runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id)
_EXPIRED = sa.select(_J.job_id).where(_J.expires.is_not(None), _J.expires <= sa.bindparam("now"))
# Leases (takeover.py): renewed in one statement for every job a replica runs; a lapsed one claimed
# in one statement, so two replicas never both take a job over.
_RENEW = jobs_table.update().where(_J.runner == sa.bindparam("me"), _J.runner_until.is_not(None)).values(
    runner_until=sa.bindparam("until")).returning(_J.job_id, _J.cancel_requested)
_CLAIM = jobs_table.update().where(_J.runner_until.is_not(None), _J.runner_until < sa.bindparam("now")).values(
    runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id, _J.inputs_stored)
_INPUTS_STORED = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(inputs_stored=True)
_REQUEST_CANCEL = jobs_table.update().where(_J.job_id == sa.bindparam("job"), _J.runner_until.is_not(None)).values(
    cancel_requested=sa.bindparam("reason"))
_RUNNER = sa.select(_J.runner, _J.runner_until).where(_J.job_id == sa.bindparam("job_id"))
_ALL_EVENTS = sa.select(_E.event).where(_E.job_id == sa.bindparam("job_id")).order_by(_E.idx)
_DELETE_EVENTS = events_table.delete().where(_E.job_id.in_(sa.bindparam("ids", expanding=True)))
_DELETE_JOBS = jobs_table.delete().where(_J.job_id.in_(sa.bindparam("ids", expanding=True)))
_RECORD = sa.select(sa.case((sa.func.length(_J.record) <= MAX_RECORD_CHARS, _J.record)), _J.summary).where(
    _J.job_id == sa.bindparam("job_id"))
_COLUMNS = sa.select(_J.created, _J.state, _J.expires, _J.owner, _J.program).where(_J.job_id == sa.bindparam("job_id"))
_STATE = sa.select(_J.state).where(_J.job_id == sa.bindparam("job_id"))
_LISTING = sa.select(_J.job_id, _J.created, sa.case((sa.func.length(_J.record) <= LISTING_TRIM_CHARS, _J.record),
                                        else_=_J.summary)).order_by(_J.created.desc(), _J.job_id.desc())
_EVENTS_FROM = sa.select(_E.idx, sa.case((sa.func.length(_E.event) <= MAX_RECORD_CHARS, _E.event), else_=_E.brief)).where(
    _E.job_id == sa.bindparam("job_id"), _E.idx >= sa.bindparam("from_index")).order_by(_E.idx)


# The queue (dispatch_svc/admission/queue.py). Its order: priority first, then when a job was first queued.
_QUEUE_ORDER = (_J.priority.desc(), _J.queued_at, _J.job_id)
_QUEUED_JOBS = sa.select(_J.job_id, _J.owner, _J.priority, _J.queued_at, _J.queue_deadline).where(
    _J.state == m.QUEUED).order_by(*_QUEUE_ORDER)
_ENQUEUE = jobs_table.update().where(_J.job_id == sa.bindparam("job")).values(
    priority=sa.bindparam("priority"), queued_at=sa.bindparam("since"), queue_deadline=sa.bindparam("deadline"),
    queue_reason=sa.bindparam("reason"), held_devices=0, held_bytes=0, runner_until=None)
# Taken from the queue by one replica only: the state moves on in the same statement.
_CLAIM_QUEUED = jobs_table.update().where(_J.job_id == sa.bindparam("job"), _J.state == m.QUEUED).values(
    state=m.PLANNING, runner=sa.bindparam("me"), runner_until=sa.bindparam("until")).returning(_J.job_id)
_QUEUE_KEY = sa.select(_J.priority, _J.queued_at).where(_J.job_id == sa.bindparam("job"), _J.state == m.QUEUED)


def _ahead(priority: int, since: float, job_id: str):
    return sa.select(sa.func.count()).select_from(jobs_table).where(_J.state == m.QUEUED, sa.or_(
        _J.priority > priority, sa.and_(_J.priority == priority, sa.or_(
            _J.queued_at < since, sa.and_(_J.queued_at == since, _J.job_id < job_id)))))


def job_not_found(job_id: str) -> errors.NotFound:
    return errors.NotFound(f"job {quoted(job_id)} does not exist (or its results expired); ListJobs shows the jobs kept")


class JobBook:
    def __init__(self, data_dir: Path, *, retention_s: float, clock=time.time, database_url: str = "",
                 lease_s: float = 0.0, replica: str = ""):
        """`database_url`: where records and events live; empty, the SQLite file jobs.db in `data_dir`.

        `lease_s` 0: this process is the book's only dispatcher, and a job it finds unfinished at
        start was cut off by its own restart (FAILED). Above 0, several replicas share the book:
        each job is leased to the replica running it (`replica`, a fresh id by default) for
        `lease_s`, renewed while it runs, and its inputs are stored under `data_dir` (shared by
        every replica) so that another replica can take it over once the lease lapses
        (takeover.py)."""
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.results = ResultStore(self.data_dir / "results")
        self.inputs = ResultStore(self.data_dir / "inputs")  # a leased job's inputs, until it ends
        self.lease_s = lease_s
        self.replica = replica or uuid.uuid4().hex[:12]
        self._retention_s = retention_s
        self._clock = clock
        self._engine = database.open_engine(database_url or self.data_dir / "jobs.db", service="dispatch")
        try:
            database.migrate(self._engine, SCRIPTS, version_table=VERSION_TABLE)
        except BaseException:
            self._engine.dispose()
            raise
        # Leased, fenced on the runner: a replica that lost a job's lease to another cannot overwrite it.
        self._upsert = database.upsert(self._engine, jobs_table, _record_update, same="runner" if lease_s else "")
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._live: dict[str, m.JobRecord] = {}
        self._event_counts: dict[str, int] = {}  # events logged per job: the next event's index
        # Batched events not yet written: job id -> [(index, text, brief, event)], in order (the
        # text as the database gets it, the event as a watcher here gets it); `_due` is when the
        # oldest must be written. The flusher thread starts with the first one.
        self._pending: dict[str, list[tuple[int, str, str | None, m.Event]]] = {}
        self._pending_count, self._due = 0, 0.0
        self._flusher: threading.Thread | None = None
        self._flush_wanted = threading.Condition(self._lock)  # the flusher's own: watchers are not woken by it
        self._closed = False
        # Their reservations are the caller's to release. Leased, only those no replica leases:
        # the others are takeover.py's.
        self.interrupted = self._fail_interrupted_jobs()
        self.expire_results()

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            self._flush_wanted.notify_all()
            try:
                self.flush()
            except errors.AccelmeshError as exc:  # the database went first: nothing more to do
                log.warning("%d job events could not be written at close: %s", self._pending_count, exc)
            self._engine.dispose()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    # -- writes ---------------------------------------------------------------------------

    def create(self, spec: m.JobSpec, owner: str = "") -> m.JobRecord:
        """A new job. With a request id this owner used before: AlreadyExists (`by_request` finds
        that job), decided by the database's unique index, so two replicas cannot both create it."""
        job = m.JobRecord(job_id=uuid.uuid4().hex[:16], spec=spec, created=self._clock(), owner=owner)
        with self._lock:
            try:
                self._save(job, request_id=spec.request_id or None)
            except sa.exc.IntegrityError:
                raise errors.AlreadyExists(f"a job of request_id {spec.request_id!r} exists") from None
            self._live[job.job_id] = job
        return job

    def by_request(self, owner: str, request_id: str) -> m.JobRecord | None:
        """The job `owner` created with `request_id` (AIP-155), if it is still kept."""
        if not request_id:
            return None
        with database.connected(self._engine) as connection:
            job_id = connection.execute(_BY_REQUEST, {"owner": owner, "request_id": request_id}).scalar()
        return None if job_id is None else self.get(job_id)

    # -- leases (takeover.py) ---------------------------------------------------------------

    def renew_leases(self) -> list[tuple[str, str | None]]:
        """Move this replica's leases on; (job id, cancel asked through another replica or None)
        for every unfinished job it still holds."""
        values = {"me": self.replica, "until": self._clock() + self.lease_s}
        return [tuple(row) for row in database.transaction(self._engine, lambda c: c.execute(_RENEW, values).all())]

    def claim_lapsed(self) -> list[tuple[str, bool]]:
        """Take the jobs whose runner stopped renewing: (job id, whether its inputs are stored)."""
        now = self._clock()
        values = {"me": self.replica, "now": now, "until": now + self.lease_s}
        rows = database.transaction(self._engine, lambda c: c.execute(_CLAIM, values).all())
        return [(job_id, bool(stored)) for job_id, stored in rows]

    def runner_of(self, job_id: str) -> tuple[str, float | None]:
        with database.connected(self._engine) as connection:
            row = connection.execute(_RUNNER, {"job_id": job_id}).first()
        if row is None:
            raise job_not_found(job_id)
        return row[0], row[1]

    def inputs_stored(self, job_id: str) -> None:
        """Every input of the job is in `inputs`: another replica can run it from there."""
        database.transaction(self._engine, lambda c: c.execute(_INPUTS_STORED, {"job": job_id}))

    def request_cancel(self, job_id: str, reason: str) -> bool:
        """Ask the replica running the job to cancel it (at its next renewal); False: not leased."""
        count = database.transaction(
            self._engine, lambda c: c.execute(_REQUEST_CANCEL, {"job": job_id, "reason": reason}).rowcount)
        return bool(count)

    def drop_stored(self, job_id: str) -> None:
        """What only a takeover reads: the job's stored inputs and folded parts (outputs.py)."""
        self.inputs.delete(job_id)
        shutil.rmtree(self.results.root / job_id / PARTS, ignore_errors=True)

    # -- the queue (queue.py) ----------------------------------------------------------------

    def enqueue(self, job: m.JobRecord, reason: str, deadline: float) -> m.QueueStatus:
        """The job waits in the queue (QUEUED) with its inputs stored; a job queued before keeps its
        place. A QUEUED event says where and why, unless it says what the last one did. The job is
        no longer held live here: the replica that starts it reads it from the book."""
        with self._lock:
            earlier = job.queue
            status = m.QueueStatus(reason, earlier.since if earlier else self._clock(), deadline)
            job.state, job.queue = m.QUEUED, status
            self._save(job)
            database.transaction(self._engine, lambda c: c.execute(_ENQUEUE, {
                "job": job.job_id, "priority": job.spec.priority, "since": status.since, "deadline": deadline,
                "reason": reason}))
            status.position = self.queue_position(job.job_id)
            if earlier is None or (earlier.reason, earlier.position) != (status.reason, status.position):
                self.emit(job, m.QUEUED_EVENT, queue=dataclasses.replace(status),
                          message=f"queued at position {status.position}: {reason}")
            self.flush()
            self._changed.notify_all()
        return status

    def queue_position(self, job_id: str) -> int:
        """1 for the queued job tried next; 0 for a job not queued."""
        with database.connected(self._engine) as connection:
            key = connection.execute(_QUEUE_KEY, {"job": job_id}).first()
            if key is None:
                return 0
            return 1 + connection.execute(_ahead(key[0], key[1], job_id)).scalar_one()

    def queued(self, limit: int) -> list[tuple[str, str, int, float, float]]:
        """The first `limit` queued jobs in the order they are tried: (job id, owner, priority,
        queued at, deadline)."""
        with database.connected(self._engine) as connection:
            return [tuple(row) for row in connection.execute(_QUEUED_JOBS.limit(limit)).all()]

    def claim_queued(self, job_id: str) -> m.JobRecord | None:
        """Take a queued job out of the queue to start it here (PLANNING, this replica's, leased to
        it when leases are on), held live from now on; None if another replica or a cancel took it
        first."""
        values = {"job": job_id, "me": self.replica,
                  "until": self._clock() + self.lease_s if self.lease_s else None}
        position = self.queue_position(job_id)
        if database.transaction(self._engine, lambda c: c.execute(_CLAIM_QUEUED, values).first()) is None:
            return None
        job = self._stored(job_id)  # not `get`: its place, read above, is gone with the claim
        self.adopt(job)
        job.state = m.PLANNING
        if job.queue is not None:  # as it was, to compare with if it is queued again
            job.queue.position = position
        self.update(job)
        return job

    def adopt(self, job: m.JobRecord) -> None:
        """A job this replica took over: held live here from now on, its event count from the book."""
        with self._lock:
            self._live[job.job_id] = job
            self._event_counts.pop(job.job_id, None)

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

    def wait_final(self, job_id: str, timeout_s: float) -> m.JobRecord:
        """The job once final, or as it is after `timeout_s` (a job another replica runs is read
        from the book every WATCH_POLL_S)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            left = deadline - time.monotonic()
            if job.final or left <= 0:
                return job
            with self._lock:
                self._changed.wait(min(WATCH_POLL_S, left))

    def update(self, job: m.JobRecord, **changes) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(job, key, value)
            if job.final and job.ended is None:
                job.ended = self._clock()
                job.expires = job.ended + self._retention_s
            self._save(job)
            self._changed.notify_all()

    def finish(self, job: m.JobRecord, state: str, error: str = "", message: str = "") -> None:
        """The final event and the final state in one step, so a watcher never ends early."""
        with self._lock:
            self.emit(job, m.EVENT_FOR_STATE[state], message=message or error)
            self.update(job, state=state, error=error, progress=1.0 if state == m.SUCCEEDED else job.progress)

    def emit(self, job: m.JobRecord, type_: str, **fields) -> m.Event:
        with self._lock:
            if type_ in BATCHED_EVENTS and job.job_id in self._event_counts and not self._closed:
                return self._defer(job, type_, fields)
            self.flush()  # the waiting events first: the log keeps the order they happened in
            for attempt in range(3):
                count = self._event_counts.get(job.job_id)
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
                    self._event_counts.pop(job.job_id, None)
                    if attempt == 2:
                        raise _lease_lost(job.job_id) from None
            self._event_counts[job.job_id] = count + 1
            self._changed.notify_all()
            return event

    def _defer(self, job: m.JobRecord, type_: str, fields: dict) -> m.Event:
        """A batched event: indexed and serialized now (the shard record it carries changes later),
        written with the next flush."""
        count = self._event_counts[job.job_id]
        shard = fields.pop("shard", None)
        if shard is not None:  # a copy: the record goes on changing, the event tells it as it was now
            fields["shard"] = dataclasses.replace(shard, failures=list(shard.failures))
        event = m.Event(index=count, type=type_, time=self._clock(), progress=job.progress, **fields)
        text = event_text(event)
        brief = _without(text, ("plan",)) if len(text) > MAX_RECORD_CHARS else None
        if not self._pending_count:
            self._due = time.monotonic() + FLUSH_S
            self._flush_wanted.notify()
        self._pending.setdefault(job.job_id, []).append((count, text, brief, event))
        self._pending_count += 1
        self._event_counts[job.job_id] = count + 1
        if self._pending_count >= FLUSH_EVENTS:
            self.flush()
        elif self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_when_due, name="job-events", daemon=True)
            self._flusher.start()
        self._changed.notify_all()
        return event

    def flush(self) -> None:
        """Write the batched events now, in one transaction. Leased, an event of a job this replica
        no longer holds is refused (another replica runs it now; its own writes say so)."""
        with self._lock:
            if not self._pending_count:
                return
            self._write(self._pending)  # if the database is away, they wait for the next flush
            self._pending, self._pending_count = {}, 0

    def _write(self, pending: dict[str, list[tuple[int, str, str | None, m.Event]]]) -> None:
        if not self.lease_s:
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
                    row = {"e_job": job_id, "e_idx": idx, "e_event": text, "e_brief": brief, "me": self.replica}
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
            log.warning("events of job %s were not written: %s", job_id, _lease_lost(job_id))

    def _flush_when_due(self) -> None:
        with self._lock:
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

    def _waiting(self, job_id: str, from_index: int) -> list[m.Event]:
        """The job's batched events from `from_index` on, if the first of them is that one: as
        they were made (as `events` would read them back, without parsing them again)."""
        events = self._pending.get(job_id)
        if not events or events[0][0] > from_index or events[-1][0] < from_index:
            return []
        return [event if brief is None else event_from(json.loads(brief))
                for _, _, brief, event in events[from_index - events[0][0]:]]

    def _log(self, job_id: str, event: m.Event) -> None:
        text = event_text(event)
        brief = _without(text, ("plan",)) if len(text) > MAX_RECORD_CHARS else None
        if not self.lease_s:
            row = {"job_id": job_id, "idx": event.index, "event": text, "brief": brief}
            database.transaction(self._engine, lambda c: c.execute(_INSERT_EVENT, row),
                                 reraise=(sa.exc.IntegrityError,))
            return
        row = {"e_job": job_id, "e_idx": event.index, "e_event": text, "e_brief": brief, "me": self.replica}
        if database.transaction(self._engine, lambda c: c.execute(_INSERT_HELD_EVENT, row).first(),
                                reraise=(sa.exc.IntegrityError,)) is None:
            raise _lease_lost(job_id)

    def _save(self, job: m.JobRecord, *, request_id: str | None = None) -> None:
        """Insert or update the job's row; `request_id` is written by the insert only."""
        text = record_text(job)
        row = {"job_id": job.job_id, "created": job.created, "state": job.state, "record": text,
               "expires": job.expires, "owner": job.owner, "program": job.spec.program[:256],
               "summary": _without(text, _LISTING_DROPS) if len(text) > LISTING_TRIM_CHARS else None,
               "request_id": request_id, "runner": self.replica,
               "runner_until": (None if job.final or job.state == m.QUEUED or not self.lease_s
                                else self._clock() + self.lease_s)}
        if not self.lease_s:
            database.transaction(self._engine, lambda c: c.execute(self._upsert, row), reraise=(sa.exc.IntegrityError,))
        elif database.transaction(self._engine, lambda c: c.execute(self._upsert, row).first(),
                                  reraise=(sa.exc.IntegrityError,)) is None:
            raise _lease_lost(job.job_id)

    def _fail_interrupted_jobs(self) -> list[str]:
        if self.lease_s:
            values = {"me": self.replica, "until": self._clock() + self.lease_s}
            rows = database.transaction(self._engine, lambda c: c.execute(_CLAIM_UNLEASED, values).scalars().all())
        else:
            with database.connected(self._engine) as connection:
                rows = connection.execute(_UNFINISHED).scalars().all()
        interrupted = []
        for job_id in rows:
            job = self.get(job_id)  # an oversized one is saved back summarised
            self.finish(job, m.FAILED, RESTART_ERROR)
            self._event_counts.pop(job_id, None)  # final: nothing more is logged for it
            interrupted.append(job.job_id)
        return interrupted

    def expire_results(self) -> int:
        now = self._clock()
        with self._lock:
            # Every new job sweeps: the expiry is an indexed column, so the sweep never parses a record.
            def sweep(connection) -> list[str]:
                expired = connection.execute(_EXPIRED, {"now": now}).scalars().all()
                if expired:
                    connection.execute(_DELETE_EVENTS, {"ids": expired})
                    connection.execute(_DELETE_JOBS, {"ids": expired})
                return expired

            expired = database.transaction(self._engine, sweep)
            for job_id in expired:
                self._live.pop(job_id, None)
                self._event_counts.pop(job_id, None)
                self.results.delete(job_id)
                self.inputs.delete(job_id)
        return len(expired)

    # -- reads ----------------------------------------------------------------------------

    def get(self, job_id: str) -> m.JobRecord:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
        return self._placed(self._stored(job_id))

    def _stored(self, job_id: str) -> m.JobRecord:
        with database.connected(self._engine) as connection:
            row = connection.execute(_RECORD, {"job_id": job_id}).first()
        if row is None:
            raise job_not_found(job_id)
        return self._parsed(job_id, row[0], row[1])

    def _placed(self, job: m.JobRecord) -> m.JobRecord:
        """A job read from the book, with its place in the queue now if it is queued."""
        if job.state == m.QUEUED and job.queue is not None:
            job.queue.position = self.queue_position(job.job_id)
        return job

    def _parsed(self, job_id: str, text: str | None, summary: str | None = None) -> m.JobRecord:
        """`text` as a record. None, too long to read: its summary, without the plan (the record
        without its per-shard lists, kept beside it), with a log line; a record that does not parse:
        what its columns say. So one bad record never breaks a read, or a listing of everyone's."""
        if text is not None:
            try:
                return record_from(json.loads(text))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("job %s: its stored record does not parse (%s); read from its columns", job_id, exc)
                return self._minimal(job_id, UNREADABLE_ERROR)
        log.warning("job %s: its stored record is over %d characters: read without its plan, shard records and "
                    "losses", job_id, MAX_RECORD_CHARS)
        if summary is None or len(summary) > MAX_RECORD_CHARS:
            return self._minimal(job_id, OVERSIZED_ERROR)
        try:
            record = record_from({**json.loads(summary), "plan": None})
        except (ValueError, TypeError, KeyError):
            return self._minimal(job_id, UNREADABLE_ERROR)
        record.error = record.error or OVERSIZED_ERROR
        return record

    def _minimal(self, job_id: str, why: str) -> m.JobRecord:
        with database.connected(self._engine) as connection:
            created, state, expires, owner, program = connection.execute(_COLUMNS, {"job_id": job_id}).one()
        return m.JobRecord(job_id=job_id, spec=m.JobSpec(program=program or ""), created=created, state=state,
                           error=why, expires=expires, owner=owner)

    def list(self, limit: int, owner: str | None = None, after: tuple[float, str] | None = None,
             states: frozenset[str] | None = None) -> list[m.JobRecord]:
        """The newest ``limit`` jobs, as `listing` reads them."""
        return list(self.listing(limit, owner, after, states))

    def listing(self, limit: int, owner: str | None = None, after: tuple[float, str] | None = None,
                states: frozenset[str] | None = None) -> Iterator[m.JobRecord]:
        """The newest ``limit`` jobs, newest first; with ``owner``, only that owner's; with
        ``states``, only those in them (as the book has them: a job ending meanwhile is listed as it
        ended); with ``after`` (a listed job's created time and id), those listed after it. Read LISTING_READ_ROWS rows at a
        time and parsed one by one as the caller takes them, so a caller that stops early (ListJobs
        at its message budget) never reads the rest, and a page of a thousand jobs is never in
        memory as records at once. A record over LISTING_TRIM_CHARS is read from its summary (no
        per-shard lists, which a listing leaves out anyway); one still too long (or not JSON) is
        read as `_parsed` says."""
        while limit > 0:
            query = _LISTING.limit(min(limit, LISTING_READ_ROWS))
            if owner is not None:
                query = query.where(_J.owner == owner)
            if states is not None:
                query = query.where(_J.state.in_(sorted(states)))
            if after is not None:
                created, job_id = after
                query = query.where(sa.or_(_J.created < created, sa.and_(_J.created == created, _J.job_id < job_id)))
            with database.connected(self._engine) as connection:
                rows = connection.execute(query).all()
            for job_id, created, text in rows:
                with self._lock:
                    live = self._live.get(job_id)
                if live is not None:
                    yield live
                    continue
                yield self._placed(self._parsed(
                    job_id, text if text is not None and len(text) <= MAX_RECORD_CHARS else None))
            if len(rows) < min(limit, LISTING_READ_ROWS):
                return
            limit -= len(rows)
            after = (rows[-1][1], rows[-1][0])

    def active(self, owner: str | None, limit: int) -> list[m.JobRecord]:
        """The unfinished jobs (running and queued; `owner`'s only, if given), oldest first, at most
        `limit`; a queued one with its place in the queue."""
        query = sa.select(_J.job_id).where(_J.state.not_in(m.FINAL_STATES)).order_by(_J.created, _J.job_id).limit(limit)
        if owner is not None:
            query = query.where(_J.owner == owner)
        with database.connected(self._engine) as connection:
            ids = connection.execute(query).scalars().all()
        jobs = []
        for job_id in ids:
            try:
                jobs.append(self.get(job_id))
            except errors.NotFound:  # expired between the two reads
                continue
        return jobs

    def events(self, job_id: str, from_index: int = 0, *, idle: object = None) -> Iterator[m.Event]:
        """Every event from `from_index` on; blocks for new ones until the job is final. `idle`, if
        given, is yielded before each wait for more: a caller gathering what it sends (a RunJob
        batch) sends it then, so nothing it gathered waits on the next event."""
        self.get(job_id)
        index = from_index
        said_idle = False
        while True:
            with self._lock:
                # Batched events not written yet come from memory; the database has those before them.
                # An event too long to send (an old plan event of a huge job) comes without its plan.
                waiting = self._waiting(job_id, index)
                if waiting and self.lease_s:
                    # Shared with other replicas: what a client saw is written before it sees it,
                    # so a replica taking the job over keeps every shard a client was told finished.
                    self.flush()
                rows = []
                if not waiting and not self._caught_up(job_id, index):
                    with database.connected(self._engine) as connection:
                        rows = connection.execute(_EVENTS_FROM, {"job_id": job_id, "from_index": index}).all()
                if not rows and not waiting:
                    if self._final(job_id):
                        return
                    if said_idle or idle is None:
                        # Woken at once by this process's writes; another replica's (a job it runs,
                        # watched through this one) are read at the next look, WATCH_POLL_S on.
                        self._changed.wait(WATCH_POLL_S)
                        continue
            if not rows and not waiting:  # about to wait: said outside the lock, then looked at again
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

    def _final(self, job_id: str) -> bool:
        """Whether the job has ended: its live record, else its state column (not its whole record,
        which a job of many shards takes milliseconds to parse)."""
        live = self._live.get(job_id)
        if live is not None:
            return live.final
        with database.connected(self._engine) as connection:
            state = connection.execute(_STATE, {"job_id": job_id}).scalar_one_or_none()
        if state is None:
            raise job_not_found(job_id)
        return state in m.FINAL_STATES

    def _caught_up(self, job_id: str, index: int) -> bool:
        """Whether a watcher at `index` has had every event of a job this process logs, so the
        database has none for it either (asking it would cost a query per wake, per shard). Only
        unleased: a leased job can pass to another replica, whose events only the database has."""
        return not self.lease_s and self._event_counts.get(job_id, -1) == index

    @property
    def live_count(self) -> int:
        """Jobs this book holds in memory (records, event counts): the running ones only."""
        with self._lock:
            return len(self._live.keys() | self._event_counts.keys())

    def forget_live(self, job_id: str) -> None:
        """A final job: read from the database from now on (its event count too, if ever needed)."""
        with self._lock:
            self._live.pop(job_id, None)
            self._event_counts.pop(job_id, None)

    def wake_watchers(self) -> None:
        with self._lock:
            self._changed.notify_all()


class LeaseLost(errors.FailedPrecondition):
    """Another dispatch replica runs the job now: this one's writes to it are refused."""


def _lease_lost(job_id: str) -> LeaseLost:
    return LeaseLost(f"job {job_id} is run by another dispatch replica now: this one lost its lease on it (it did "
                     "not renew in time) and stops")


def _record_update(new) -> dict:
    """What saving a job again changes in its row: not its creation, owner, request id or runner."""
    return {name: new[name] for name in ("state", "record", "expires", "program", "summary", "runner_until")}


def _without(text: str, paths) -> str:
    """The JSON `text` with the fields at `paths` (a key, or a tuple of keys into nested objects) left out."""
    data = json.loads(text)
    for path in paths:
        path = (path,) if isinstance(path, str) else path
        parent = data
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return json.dumps(data)
