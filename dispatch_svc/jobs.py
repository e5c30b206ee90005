"""Jobs and their event logs, kept in SQLite so a client can reconnect (and a restart loses no
finished result); results live as raw arrays on disk next to the database (results.py). A record
and an event are stored as the JSON of job_codec.py.

`JobBook` is the one place job state changes: every change is written through, and watchers
wait on a condition for new events instead of polling.

A record stays small whatever its job declared (job_codec.py stores a plan's shards as runs), and
a record read back longer than MAX_RECORD_CHARS (one written before the limits existed) is read
without its plan, shard records and losses, with a log line, so it can never make GetJob or
ListJobs fail for everyone.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from accelmesh import errors
from accelmesh.errors import quoted
from dispatch_svc import records as m
from dispatch_svc.job_codec import event_from, event_text, record_from, record_text
from dispatch_svc.results import ResultStore

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL, expires REAL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, event TEXT NOT NULL, PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
"""
RESTART_ERROR = "the dispatcher restarted while the job was running; submit it again"
# A stored record or event longer than this is read without its plan, shards and losses: a
# Job message about half as long (JSON is the wordier), far below the 16 MiB message limit. A job
# within the dispatcher's limits (config.JobLimits) stays well under it.
MAX_RECORD_CHARS = 4 * 1024 * 1024
# Records longer than this are trimmed by SQLite for a listing, which shows no per-shard lists:
# the dispatcher then parses kilobytes per listed job, not megabytes.
LISTING_TRIM_CHARS = 64 * 1024
_LISTING_DROPS = ("$.shards", "$.losses", "$.plan.shards", "$.plan.shard_runs", "$.plan.placement.layers")
_OVERSIZE_DROPS = ("$.plan", "$.shards", "$.losses")  # what a record too long to read is read without
OVERSIZED_ERROR = "this job's stored record was too large to read in full; its plan and shard records are left out"
UNREADABLE_ERROR = "this job's stored record could not be read; only its state and times are known"
# After `_add_columns` (books from before `owner` and `expires` lack them). A listing (everyone's or
# one owner's, newest first) and the expiry sweep every new job runs read these, not the whole table.
INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created);
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created);
CREATE INDEX IF NOT EXISTS jobs_by_expiry ON jobs (expires) WHERE expires IS NOT NULL;
"""


def job_not_found(job_id: str) -> errors.NotFound:
    return errors.NotFound(f"job {quoted(job_id)} does not exist (or its results expired); ListJobs shows the jobs kept")


class JobBook:
    def __init__(self, data_dir: Path, *, retention_s: float, clock=time.time):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.results = ResultStore(self.data_dir / "results")
        self._retention_s = retention_s
        self._clock = clock
        self._db = sqlite3.connect(self.data_dir / "jobs.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL with NORMAL: a commit survives the process dying; only a power cut can lose the
        # last few, and it no longer costs an fsync per event (two events per shard).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._add_columns()
        self._db.executescript(INDEXES)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._live: dict[str, m.JobRecord] = {}
        self._event_counts: dict[str, int] = {}  # events logged per job: the next event's index
        self.interrupted = self._fail_interrupted_jobs()  # their reservations are the caller's to release
        self.expire_results()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ---------------------------------------------------------------------------

    def create(self, spec: m.JobSpec, owner: str = "") -> m.JobRecord:
        job = m.JobRecord(job_id=uuid.uuid4().hex[:16], spec=spec, created=self._clock(), owner=owner)
        with self._lock:
            self._live[job.job_id] = job
            self._save(job)
        return job

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
            count = self._event_counts.get(job.job_id)
            if count is None:  # first event of this job in this process: counted once, then kept
                (count,) = self._db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?", (job.job_id,)).fetchone()
            self._event_counts[job.job_id] = count + 1
            event = m.Event(index=count, type=type_, time=self._clock(), progress=job.progress, **fields)
            self._db.execute(
                "INSERT INTO events (job_id, idx, event) VALUES (?, ?, ?)", (job.job_id, count, event_text(event)))
            self._changed.notify_all()
            return event

    def _save(self, job: m.JobRecord) -> None:
        self._db.execute(
            "INSERT INTO jobs (job_id, created, state, record, expires, owner) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(job_id) DO UPDATE SET state = excluded.state, record = excluded.record, "
            "expires = excluded.expires",
            (job.job_id, job.created, job.state, record_text(job), job.expires, job.owner),
        )

    def _add_columns(self) -> None:
        """Books written before a column existed: add it and fill it from the records, once. Jobs
        from before owners existed get none: only operators see them."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in (("expires", "REAL"), ("owner", "TEXT NOT NULL DEFAULT ''")):
            if column in columns:
                continue
            self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
            default = None if column == "expires" else ""
            for job_id, text in self._db.execute("SELECT job_id, record FROM jobs").fetchall():
                value = json.loads(text).get(column, default)
                self._db.execute(f"UPDATE jobs SET {column} = ? WHERE job_id = ?", (value, job_id))

    def _fail_interrupted_jobs(self) -> list[str]:
        rows = self._db.execute(
            "SELECT job_id FROM jobs WHERE state NOT IN (?, ?, ?)", m.FINAL_STATES
        ).fetchall()
        interrupted = []
        for (job_id,) in rows:
            job = self.get(job_id)  # an oversized one is saved back summarised
            self.finish(job, m.FAILED, RESTART_ERROR)
            self._event_counts.pop(job_id, None)  # final: nothing more is logged for it
            interrupted.append(job.job_id)
        return interrupted

    def expire_results(self) -> int:
        now = self._clock()
        with self._lock:
            # Every new job sweeps: the expiry is a column, so the sweep never parses a record.
            expired = [job_id for (job_id,) in self._db.execute(
                "SELECT job_id FROM jobs WHERE expires IS NOT NULL AND expires <= ?", (now,)).fetchall()]
            for job_id in expired:
                self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                self._live.pop(job_id, None)
                self._event_counts.pop(job_id, None)
                self.results.delete(job_id)
        return len(expired)

    # -- reads ----------------------------------------------------------------------------

    def get(self, job_id: str) -> m.JobRecord:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
            row = self._db.execute("SELECT CASE WHEN length(record) <= ? THEN record END FROM jobs WHERE job_id = ?",
                                   (MAX_RECORD_CHARS, job_id)).fetchone()
        if row is None:
            raise job_not_found(job_id)
        return self._parsed(job_id, row[0])

    def _parsed(self, job_id: str, text: str | None) -> m.JobRecord:
        """`text` as a record (parsed outside the lock, as it may be long). None, too long to read:
        the record without its plan, shard records and losses; a record that does not parse: what
        its columns say. So one bad record never breaks a read, or a listing of everyone's."""
        if text is not None:
            try:
                return record_from(json.loads(text))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("job %s: its stored record does not parse (%s); read from its columns", job_id, exc)
                return self._minimal(job_id, UNREADABLE_ERROR)
        drops = ", ".join("?" * len(_OVERSIZE_DROPS))
        with self._lock:
            size, trimmed = self._db.execute(
                f"SELECT length(record), CASE WHEN json_valid(record) THEN json_remove(record, {drops}) END "
                "FROM jobs WHERE job_id = ?", (*_OVERSIZE_DROPS, job_id)).fetchone()
        log.warning("job %s: its stored record is %d characters, over %d: read without its plan, shard records and "
                    "losses", job_id, size, MAX_RECORD_CHARS)
        if trimmed is None or len(trimmed) > MAX_RECORD_CHARS:
            return self._minimal(job_id, OVERSIZED_ERROR)
        try:
            record = record_from(json.loads(trimmed))
        except (ValueError, TypeError, KeyError):
            return self._minimal(job_id, UNREADABLE_ERROR)
        record.error = record.error or OVERSIZED_ERROR
        return record

    def _minimal(self, job_id: str, why: str) -> m.JobRecord:
        with self._lock:
            created, state, expires, owner, program = self._db.execute(
                "SELECT created, state, expires, owner, CASE WHEN json_valid(record) THEN "
                "substr(json_extract(record, '$.spec.program'), 1, 256) END FROM jobs WHERE job_id = ?",
                (job_id,)).fetchone()
        return m.JobRecord(job_id=job_id, spec=m.JobSpec(program=program or ""), created=created, state=state,
                           error=why, expires=expires, owner=owner)

    def list(self, limit: int, owner: str | None = None) -> list[m.JobRecord]:
        """The newest ``limit`` jobs; with ``owner``, only that owner's. A stored record over
        LISTING_TRIM_CHARS comes without its per-shard lists (SQLite trims them), which a listing
        leaves out anyway; one still too long (or not JSON) comes as NULL, read as `_parsed` says."""
        drops = ", ".join("?" * len(_LISTING_DROPS))
        select = (f"SELECT job_id, CASE WHEN length(record) <= ? THEN record WHEN json_valid(record) THEN "
                  f"json_remove(record, {drops}) END FROM jobs")
        args = (LISTING_TRIM_CHARS, *_LISTING_DROPS)
        with self._lock:
            if owner is None:
                rows = self._db.execute(f"{select} ORDER BY created DESC LIMIT ?", (*args, limit)).fetchall()
            else:
                rows = self._db.execute(f"{select} WHERE owner = ? ORDER BY created DESC LIMIT ?",
                                        (*args, owner, limit)).fetchall()
            live = {job_id: self._live[job_id] for job_id, _ in rows if job_id in self._live}
        return [live[job_id] if job_id in live else
                self._parsed(job_id, text if text is not None and len(text) <= MAX_RECORD_CHARS else None)
                for job_id, text in rows]

    def events(self, job_id: str, from_index: int = 0) -> Iterator[m.Event]:
        """Every event from `from_index` on; blocks for new ones until the job is final."""
        self.get(job_id)
        index = from_index
        while True:
            with self._lock:
                # An event too long to send (an old plan event of a huge job) comes without its plan.
                rows = self._db.execute(
                    "SELECT idx, CASE WHEN length(event) <= ? THEN event WHEN json_valid(event) THEN "
                    "json_remove(event, '$.plan') END FROM events WHERE job_id = ? AND idx >= ? ORDER BY idx",
                    (MAX_RECORD_CHARS, job_id, index)).fetchall()
                if not rows:
                    if self.get(job_id).final:
                        return
                    self._changed.wait()
                    continue
            for idx, text in rows:
                index = idx + 1
                try:
                    event = event_from(json.loads(text))
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning("job %s: event %d does not parse (%s); skipped", job_id, idx, exc)
                    continue
                yield event

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
