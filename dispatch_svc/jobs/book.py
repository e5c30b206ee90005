"""The job book: jobs and their event logs, kept in a database (a SQLite file by default, or
PostgreSQL by URL) so a client can reconnect and a restart loses no finished result; results and
stored inputs live as raw arrays on disk under the data dir (results.py).

`JobBook` is the one place job state changes: every change is written through. It is composed of
the jobs table (`JobRows`, rows.py), the event log (`EventLog`, events.py), the replicas' leases
(`JobLeases`, leases.py) and the queue's rows (`QueueRows`, queue_rows.py); what spans several of
them (a job's end, its going to the queue and out of it) is here. The tables and their
migrations are in schema/.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import sqlalchemy as sa

from accelmesh import errors
from accelmesh.runtime import database
from accelmesh.security.files import private_dir
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.events import WATCH_POLL_S, EventLog
from dispatch_svc.jobs.leases import JobLeases
from dispatch_svc.jobs.queue_rows import QueueRows
from dispatch_svc.jobs.results import PARTS, ResultStore
from dispatch_svc.jobs.rows import JobRows, LeaseLost, job_not_found
from dispatch_svc.jobs.schema import SCRIPTS, VERSION_TABLE

__all__ = ["INPUTS_LOST_ERROR", "RESTART_ERROR", "JobBook", "LeaseLost", "job_not_found"]

log = logging.getLogger(__name__)

RESTART_ERROR = "the dispatcher restarted while the job was running; submit it again"
INPUTS_LOST_ERROR = ("the dispatch replica running this job stopped before the job's inputs had all arrived, so no "
                     "other replica could take it over; submit it again")


class JobBook:
    def __init__(self, data_dir: Path, *, retention_s: float, clock=time.time, database_url: str = "",
                 lease_s: float = 0.0, replica: str = ""):
        """`database_url`: where records and events live; empty, the SQLite file jobs.db in `data_dir`.

        `lease_s` 0: this process is the book's only dispatcher, and a job it finds unfinished at
        start was cut off by its own restart (FAILED). Above 0, several replicas share the book:
        each job is leased to the replica running it (`replica`, a fresh id by default) for
        `lease_s`, renewed while it runs, and its inputs are stored under `data_dir` (shared by
        every replica) so that another replica can take it over once the lease lapses
        (execution/takeover.py)."""
        self.data_dir = private_dir(data_dir)  # records, results and inputs of every tenant
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
        who = {"lease_s": lease_s, "replica": self.replica, "clock": clock}
        self.rows = JobRows(self._engine, **who)
        self.leases = JobLeases(self._engine, **who)
        self.queue_rows = QueueRows(self._engine, **who)
        self._lock = threading.RLock()
        self.log = EventLog(self._engine, self._lock, **who)
        self._changed = self.log.changed
        self._live: dict[str, m.JobRecord] = {}
        self._final_logged: dict[str, str] = {}  # job -> the state whose final event `finish` logged
        # Their reservations are the caller's to release. Leased, only those no replica leases:
        # the others are takeover.py's.
        self.interrupted = self._fail_interrupted_jobs()
        self.expire_results()

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def close(self) -> None:
        with self._lock:
            self.log.close()
            self._engine.dispose()
        self.log.join()

    # -- writes ---------------------------------------------------------------------------

    def create(self, spec: m.JobSpec, owner: str = "") -> m.JobRecord:
        """A new job. With a request id this owner used before: AlreadyExists (`by_request` finds
        that job), decided by the database's unique index, so two replicas cannot both create it."""
        job = m.JobRecord(job_id=uuid.uuid4().hex[:16], spec=spec, created=self._clock(), owner=owner)
        with self._lock:
            try:
                self.rows.save(job, request_id=spec.request_id or None)
            except sa.exc.IntegrityError:
                raise errors.AlreadyExists(f"a job of request_id {spec.request_id!r} exists") from None
            self._live[job.job_id] = job
        return job

    def update(self, job: m.JobRecord, **changes) -> None:
        """The changes made to the record and saved; a save that fails leaves the record as it was,
        so what this replica shows of the job is what the book holds."""
        with self._lock:
            before = {key: getattr(job, key) for key in (*changes, "ended", "expires")}
            for key, value in changes.items():
                setattr(job, key, value)
            if job.final and job.ended is None:
                job.ended = self._clock()
                job.expires = job.ended + self._retention_s
            try:
                self.rows.save(job)
            except BaseException:
                for key, value in before.items():
                    setattr(job, key, value)
                raise
            self._changed.notify_all()

    def emit(self, job: m.JobRecord, type_: str, **fields) -> m.Event:
        return self.log.emit(job, type_, **fields)

    def finish(self, job: m.JobRecord, state: str, error: str = "", message: str = "") -> None:
        """The final event and the final state in one step, so a watcher never ends early. Asked
        again after the state's save failed (the database went away between the two), the event
        logged the first time is not logged twice."""
        with self._lock:
            if self._final_logged.get(job.job_id) != state:
                self.emit(job, m.EVENT_FOR_STATE[state], message=message or error)
                self._final_logged[job.job_id] = state
            self.update(job, state=state, error=error, progress=1.0 if state == m.SUCCEEDED else job.progress)

    def enqueue(self, job: m.JobRecord, reason: str, deadline: float) -> m.QueueStatus:
        """The job waits in the queue (QUEUED) with its inputs stored; a job queued before keeps its
        place. A QUEUED event says where and why, unless it says what the last one did. The job is
        no longer held live here: the replica that starts it reads it from the book."""
        with self._lock:
            earlier = job.queue
            status = m.QueueStatus(reason, earlier.since if earlier else self._clock(), deadline)
            job.state, job.queue = m.QUEUED, status
            self.rows.save(job)
            self.queue_rows.place(job, status)
            status.position = self.queue_rows.position(job.job_id)
            if earlier is None or (earlier.reason, earlier.position) != (status.reason, status.position):
                self.emit(job, m.QUEUED_EVENT, queue=dataclasses.replace(status),
                          message=f"queued at position {status.position}: {reason}")
            self.log.flush()
            self._changed.notify_all()
        return status

    def claim_queued(self, job_id: str) -> m.JobRecord | None:
        """Take a queued job out of the queue to start it here (PLANNING, this replica's, leased to
        it when leases are on), held live from now on; None if another replica or a cancel took it
        first."""
        position = self.queue_rows.position(job_id)
        if not self.queue_rows.claim(job_id):
            return None
        job = self.rows.read(job_id)  # not `get`: its place, read above, is gone with the claim
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
            self.log.forget(job.job_id)

    def drop_stored(self, job_id: str) -> None:
        """What only a takeover reads: the job's stored inputs and folded parts (execution/outputs.py)."""
        self.inputs.delete(job_id)
        shutil.rmtree(self.results.root / job_id / PARTS, ignore_errors=True)

    def _fail_interrupted_jobs(self) -> list[str]:
        rows = self.leases.claim_unleased() if self.lease_s else self.rows.unfinished()
        interrupted = []
        for job_id in rows:
            job = self.get(job_id)  # an oversized one is saved back summarised
            self.finish(job, m.FAILED, RESTART_ERROR)
            self.log.forget(job_id)  # final: nothing more is logged for it
            interrupted.append(job.job_id)
        return interrupted

    def expire_results(self) -> int:
        with self._lock:  # every new job sweeps
            expired = self.rows.sweep_expired()
            for job_id in expired:
                self._live.pop(job_id, None)
                self.log.forget(job_id)
                self.results.delete(job_id)
                self.inputs.delete(job_id)
        return len(expired)

    # -- reads ----------------------------------------------------------------------------

    def get(self, job_id: str) -> m.JobRecord:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
        return self._placed(self.rows.read(job_id))

    def by_request(self, owner: str, request_id: str) -> m.JobRecord | None:
        """The job `owner` created with `request_id` (AIP-155), if it is still kept."""
        if not request_id:
            return None
        job_id = self.rows.by_request(owner, request_id)
        return None if job_id is None else self.get(job_id)

    def _placed(self, job: m.JobRecord) -> m.JobRecord:
        """A job read from the book, with its place in the queue now if it is queued."""
        if job.state == m.QUEUED and job.queue is not None:
            job.queue.position = self.queue_rows.position(job.job_id)
        return job

    def list(self, limit: int, owner: str | None = None, after: tuple[float, str] | None = None,
             states: frozenset[str] | None = None) -> list[m.JobRecord]:
        """The newest ``limit`` jobs, as `listing` reads them."""
        return list(self.listing(limit, owner, after, states))

    def listing(self, limit: int, owner: str | None = None, after: tuple[float, str] | None = None,
                states: frozenset[str] | None = None) -> Iterator[m.JobRecord]:
        """The newest ``limit`` jobs, newest first; with ``owner``, only that owner's; with
        ``states``, only those in them (as the book has them: a job ending meanwhile is listed as it
        ended); with ``after`` (a listed job's created time and id), those listed after it. Read a
        few rows at a time and parsed one by one as the caller takes them, so a caller that stops
        early (ListJobs at its message budget) never reads the rest, and a page of a thousand jobs
        is never in memory as records at once. A record too long for a listing is read from its
        summary (no per-shard lists, which a listing leaves out anyway; rows.py)."""
        for job_id, read in self.rows.listing(limit, owner, after, states):
            with self._lock:
                live = self._live.get(job_id)
            yield live if live is not None else self._placed(read())

    def active(self, owner: str | None, limit: int) -> list[m.JobRecord]:
        """The unfinished jobs (running and queued; `owner`'s only, if given), oldest first, at most
        `limit`; a queued one with its place in the queue."""
        jobs = []
        for job_id in self.rows.active(owner, limit):
            try:
                jobs.append(self.get(job_id))
            except errors.NotFound:  # expired between the two reads
                continue
        return jobs

    def events(self, job_id: str, from_index: int = 0, *, idle: object = None,
               idle_s: Callable[[], float] | None = None) -> Iterator[m.Event]:
        """Every event from `from_index` on; blocks for new ones until the job is final. `idle`, if
        given, is yielded before each wait for more: a caller gathering what it sends (a RunJob
        batch) sends it then, so nothing it gathered waits on the next event. `idle_s`, if given,
        bounds each wait, after which `idle` comes again (a caller letting parts wait a little)."""
        self.get(job_id)
        return self.log.read(job_id, from_index, self._final, idle, idle_s)

    def finished_shards(self, job_id: str) -> set[int]:
        return self.log.finished_shards(job_id)

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

    def _final(self, job_id: str) -> bool:
        """Whether the job has ended: its live record, else its state column."""
        live = self._live.get(job_id)
        if live is not None:
            return live.final
        return self.rows.state(job_id) in m.FINAL_STATES

    @property
    def live_count(self) -> int:
        """Jobs this book holds in memory (records, event counts): the running ones only."""
        with self._lock:
            return len(self._live.keys() | self.log.counted)

    def forget_live(self, job_id: str) -> None:
        """A final job: read from the database from now on (its event count too, if ever needed)."""
        with self._lock:
            self._live.pop(job_id, None)
            self._final_logged.pop(job_id, None)
            self.log.forget(job_id)

    def wake_watchers(self) -> None:
        with self._lock:
            self._changed.notify_all()
