"""The jobs table: a record saved as the JSON of codec.py, read back, listed, swept once expired.

A record stays small whatever its job declared (codec.py stores a plan's shards as runs), and a
record read back longer than MAX_RECORD_CHARS (one written before the limits existed) is read
without its plan, shard records and losses, with a log line, so it can never make GetJob or
ListJobs fail for everyone. Leased (dispatch replicas sharing the book), a save is fenced on the
runner: a replica that lost a job's lease to another cannot overwrite it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import sqlalchemy as sa

from accelmesh import errors
from accelmesh.errors import quoted
from accelmesh.runtime import database
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.codec import record_from, record_text
from dispatch_svc.jobs.schema.tables import events as events_table
from dispatch_svc.jobs.schema.tables import jobs as jobs_table

log = logging.getLogger(__name__)

# A stored record or event longer than this is read without its plan, shards and losses: a
# Job message about half as long (JSON is the wordier), far below the 16 MiB message limit. A job
# within the dispatcher's limits (jobs/limits.py) stays well under it.
MAX_RECORD_CHARS = 4 * 1024 * 1024
# Records longer than this are trimmed by SQLite for a listing, which shows no per-shard lists:
# the dispatcher then parses kilobytes per listed job, not megabytes.
LISTING_TRIM_CHARS = 64 * 1024
LISTING_READ_ROWS = 50  # rows a listing reads from the database at a time (see JobRows.listing)
# What a listing leaves out of a record (its `summary`), and so what one too long to read lacks too.
_LISTING_DROPS = ("shards", "losses", ("plan", "shards"), ("plan", "shard_runs"), ("plan", "placement", "layers"))
OVERSIZED_ERROR = "this job's stored record was too large to read in full; its plan and shard records are left out"
UNREADABLE_ERROR = "this job's stored record could not be read; only its state and times are known"

# The statements, built once: SQLAlchemy then compiles each once and a call only binds values.
_J, _E = jobs_table.c, events_table.c
_BY_REQUEST = sa.select(_J.job_id).where(_J.owner == sa.bindparam("owner"), _J.request_id == sa.bindparam("request_id"))
# A queued job is not interrupted by a restart: its inputs are stored and the queue starts it.
_UNFINISHED = sa.select(_J.job_id).where(_J.state.not_in((*m.FINAL_STATES, m.QUEUED)))
_EXPIRED = sa.select(_J.job_id).where(_J.expires.is_not(None), _J.expires <= sa.bindparam("now"))
_DELETE_EVENTS = events_table.delete().where(_E.job_id.in_(sa.bindparam("ids", expanding=True)))
_DELETE_JOBS = jobs_table.delete().where(_J.job_id.in_(sa.bindparam("ids", expanding=True)))
_RECORD = sa.select(sa.case((sa.func.length(_J.record) <= MAX_RECORD_CHARS, _J.record)), _J.summary).where(
    _J.job_id == sa.bindparam("job_id"))
_COLUMNS = sa.select(_J.created, _J.state, _J.expires, _J.owner, _J.program).where(_J.job_id == sa.bindparam("job_id"))
_STATE = sa.select(_J.state).where(_J.job_id == sa.bindparam("job_id"))
_LISTING = sa.select(_J.job_id, _J.created, sa.case((sa.func.length(_J.record) <= LISTING_TRIM_CHARS, _J.record),
                                        else_=_J.summary)).order_by(_J.created.desc(), _J.job_id.desc())


def job_not_found(job_id: str) -> errors.NotFound:
    return errors.NotFound(
        f"job {quoted(job_id)} does not exist (or its results expired); ListJobs shows the jobs kept")


class LeaseLost(errors.FailedPrecondition):
    """Another dispatch replica runs the job now: this one's writes to it are refused."""


def lease_lost(job_id: str) -> LeaseLost:
    return LeaseLost(f"job {job_id} is run by another dispatch replica now: this one lost its lease on it (it did "
                     "not renew in time) and stops")


class JobRows:
    """The jobs table of one book. `lease_s` 0: this process is the book's only dispatcher; above
    0 each unfinished job's row says which replica (`replica`) runs it until when."""

    def __init__(self, engine: sa.Engine, *, lease_s: float, replica: str, clock: Callable[[], float]):
        self._engine, self._lease_s, self._replica, self._clock = engine, lease_s, replica, clock
        self._upsert = database.upsert(engine, jobs_table, _record_update, same="runner" if lease_s else "")

    def save(self, job: m.JobRecord, *, request_id: str | None = None) -> None:
        """Insert or update the job's row; `request_id` is written by the insert only. A unique
        request id taken already raises IntegrityError; leased, a row another replica holds LeaseLost."""
        text = record_text(job)
        row = {"job_id": job.job_id, "created": job.created, "state": job.state, "record": text,
               "expires": job.expires, "owner": job.owner, "program": job.spec.program[:256],
               "summary": without(text, _LISTING_DROPS) if len(text) > LISTING_TRIM_CHARS else None,
               "request_id": request_id, "runner": self._replica,
               "runner_until": (None if job.final or job.state == m.QUEUED or not self._lease_s
                                else self._clock() + self._lease_s)}
        if not self._lease_s:
            database.transaction(self._engine, lambda c: c.execute(self._upsert, row), reraise=(sa.exc.IntegrityError,))
        elif database.transaction(self._engine, lambda c: c.execute(self._upsert, row).first(),
                                  reraise=(sa.exc.IntegrityError,)) is None:
            raise lease_lost(job.job_id)

    def by_request(self, owner: str, request_id: str) -> str | None:
        with database.connected(self._engine) as connection:
            return connection.execute(_BY_REQUEST, {"owner": owner, "request_id": request_id}).scalar()

    def unfinished(self) -> list[str]:
        """The jobs neither final nor queued: unleased, those a restart cut off."""
        with database.connected(self._engine) as connection:
            return list(connection.execute(_UNFINISHED).scalars().all())

    def sweep_expired(self) -> list[str]:
        """Delete the jobs whose results expired, with their events; returns their ids. The expiry
        is an indexed column, so the sweep never parses a record."""
        now = self._clock()

        def sweep(connection) -> list[str]:
            expired = connection.execute(_EXPIRED, {"now": now}).scalars().all()
            if expired:
                connection.execute(_DELETE_EVENTS, {"ids": expired})
                connection.execute(_DELETE_JOBS, {"ids": expired})
            return expired

        return database.transaction(self._engine, sweep)

    def read(self, job_id: str) -> m.JobRecord:
        with database.connected(self._engine) as connection:
            row = connection.execute(_RECORD, {"job_id": job_id}).first()
        if row is None:
            raise job_not_found(job_id)
        return self._parsed(job_id, row[0], row[1])

    def state(self, job_id: str) -> str:
        """The state column alone (not the record, which a job of many shards takes milliseconds to parse)."""
        with database.connected(self._engine) as connection:
            state = connection.execute(_STATE, {"job_id": job_id}).scalar_one_or_none()
        if state is None:
            raise job_not_found(job_id)
        return state

    def listing(self, limit: int, owner: str | None, after: tuple[float, str] | None,
                states: frozenset[str] | None) -> Iterator[tuple[str, Callable[[], m.JobRecord]]]:
        """(job id, a reader of its record) for the newest `limit` jobs, newest first, read
        LISTING_READ_ROWS rows at a time; a record is parsed only when its reader is called, so a
        caller that stops early never reads the rest (see JobBook.listing)."""
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
            for job_id, _created, text in rows:
                yield job_id, lambda job_id=job_id, text=text: self._parsed(
                    job_id, text if text is not None and len(text) <= MAX_RECORD_CHARS else None)
            if len(rows) < min(limit, LISTING_READ_ROWS):
                return
            limit -= len(rows)
            after = (rows[-1][1], rows[-1][0])

    def active(self, owner: str | None, limit: int) -> list[str]:
        """The unfinished jobs' ids (`owner`'s only, if given), oldest first, at most `limit`."""
        query = sa.select(_J.job_id).where(_J.state.not_in(m.FINAL_STATES)).order_by(_J.created, _J.job_id).limit(limit)
        if owner is not None:
            query = query.where(_J.owner == owner)
        with database.connected(self._engine) as connection:
            return list(connection.execute(query).scalars().all())

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


def _record_update(new) -> dict:
    """What saving a job again changes in its row: not its creation, owner, request id or runner."""
    return {name: new[name] for name in ("state", "record", "expires", "program", "summary", "runner_until")}


def without(text: str, paths) -> str:
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
