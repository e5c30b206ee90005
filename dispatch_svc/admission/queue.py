"""The job queue: a job that cannot get its devices now, or that would take its owner over a quota
(quotas.py), waits instead of failing, and starts once there is room.

A job goes to the queue where it reserves its devices (`Admission`, from JobContext.reserve): its
owner's quota is checked first, then the inventory is asked for the devices. When either says
no, the job's inputs are stored whole (the rest of the client's stream read to the dispatchers'
data dir, as a leased job's are), and it becomes QUEUED in the job book, with a QUEUED event
saying its place and why it waits. Everything about it is in the book's database, so the queue
outlives a dispatcher's restart and is one queue for every dispatch replica sharing the book.

Every replica runs a `JobQueue` pass every QUEUE_POLL_S, and at once when one of its jobs ends
(its devices are free again). A pass walks the queued jobs in order: priority first (higher
first), then the time each was first queued. It fails those past their deadline
(spec.queue_timeout), and tries to start each of the others: the job is claimed in one statement
(so one replica starts it), planned afresh on the devices the mesh has now, and either holds its
devices (it runs) or goes back to the queue, keeping its place. When a pass has two or more jobs
to try, a scheduling round (scheduling/rounds.py, ACCELMESH_SCHEDULING_POLICY) first gives each
free devices of a type by the dispatcher's policy (by default each type to the jobs it speeds up
most); those jobs are tried first, each planned on what it was given only, then the others on
what is left. Otherwise, and with the first_fit policy, it is first fit in priority order.
Either way a job that does not fit now does not hold back the jobs behind it that do, so the pool
is never idle while a queued job could use it; a large job's wait is bounded by its
queue_timeout. A job that asks for more than its owner's quota allows at all never waits: it
fails at once, naming the limit. One tenant may have ACCELMESH_MAX_QUEUED_PER_TENANT jobs
waiting; the next is refused before its inputs are stored.

A RunJob client of a queued job keeps its call: it is sent the QUEUED events, then the job's
events and results once it runs, wherever it runs. Its disconnect cancels the job, queued or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from accelmesh import errors
from accelmesh.runtime.periodic import Periodic
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.admission.quotas import OverQuota, Quotas
from dispatch_svc.admission.scheduling import SolverFailed
from dispatch_svc.admission.scheduling.rounds import Narrowing, Round, Waiting

log = logging.getLogger(__name__)

DEFAULT_QUEUE_TIMEOUT_S = 24 * 3600.0  # a job's wait when its spec says nothing (ACCELMESH_QUEUE_TIMEOUT_S)
# Jobs one tenant may have queued at once (ACCELMESH_MAX_QUEUED_PER_TENANT): each holds its inputs on
# the dispatch dir's disk while it waits (at most ACCELMESH_MAX_JOB_BYTES each).
DEFAULT_MAX_QUEUED = 100
QUEUE_POLL_S = 2.0  # how often a pass runs without a wake-up (another replica's job ended, a reservation lapsed)
PASS_JOBS = 64  # queued jobs a pass tries at most, from the head
RETRY_S = 60.0  # a queued job is tried at least this often, changes seen or not


class Queued(Exception):
    """The job cannot start now (`reason`): it waits in the queue."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Admission:
    """What JobContext.reserve asks before and after it reserves: the owner's quota, and whether a
    refusal queues the job or fails it (spec.queue_timeout 0 s: fails, as before queues; and a
    tenant with `max_queued` jobs queued already: fails, so no tenant fills the dispatch dir's
    disk with stored inputs)."""

    def __init__(self, quotas: Quotas, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
                 max_queued: int = DEFAULT_MAX_QUEUED):
        if not queue_timeout_s > 0:
            raise errors.InvalidArgument(f"queue_timeout_s is {queue_timeout_s}; set ACCELMESH_QUEUE_TIMEOUT_S to a "
                                         "number of seconds > 0")
        if max_queued < 1:
            raise errors.InvalidArgument(f"max_queued is {max_queued}; set ACCELMESH_MAX_QUEUED_PER_TENANT to a "
                                         "number of jobs >= 1")
        self.quotas = quotas
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued

    def admit(self, job: m.JobRecord, claims: Sequence[tuple[str, int]]) -> None:
        """The owner's quota takes the job's claims (recorded as its holding), or Queued."""
        try:
            self.quotas.admit(job.job_id, job.owner, len(claims), sum(nbytes for _, nbytes in claims))
        except OverQuota as exc:
            raise self.refused(job, f"quota: {exc}") from None

    def refused(self, job: m.JobRecord, reason: str) -> Exception:
        """What to raise when the job cannot start now: Queued, or RESOURCE_EXHAUSTED for a job that
        may not wait or whose owner has as many jobs queued as one tenant may. A job that was queued
        before goes back whatever the count: its place was granted once. Two replicas queueing one
        tenant's jobs at once may each pass the last place: the bound is soft by that much."""
        if job.spec.queue_timeout_s == 0:
            return errors.ResourceExhausted(f"{reason} (the job was not queued: its spec.queue_timeout is 0 s)")
        if job.queue is None:
            waiting = self.quotas.queued_count(job.owner)
            if waiting >= self.max_queued:
                return errors.ResourceExhausted(
                    f"{reason}, and the job was not queued: {job.owner or 'its owner'} has {waiting} jobs queued "
                    f"already, the most one tenant may (ACCELMESH_MAX_QUEUED_PER_TENANT={self.max_queued}); wait "
                    "for some of them to start, or cancel some (accelmesh jobs cancel)")
        return Queued(reason)

    def deadline(self, job: m.JobRecord, now: float) -> float:
        """When the job gives up waiting: its first queueing's deadline, kept when it is queued again."""
        if job.queue is not None:
            return job.queue.deadline
        timeout = job.spec.queue_timeout_s
        return now + (self.queue_timeout_s if timeout is None else timeout)


class JobQueue:
    """One replica's passes over the shared queue (see the module's docstring).

    A job is tried again only when what decides whether it could start may have changed since it
    was last tried here: a job of this replica ended (`wake`), or `pool_state` (the reservations,
    the devices' health, the quotas) reads differently, or RETRY_S passed (a change that a
    snapshot cannot see: devices freed and taken again between two looks). So a job that waits
    for long is planned again once per change of the pool, not once per pass."""

    def __init__(self, book: JobBook, start: Callable[[str, Narrowing | None], bool],
                 expire: Callable[[str, str], bool], *, pool_state: Callable[[], Hashable] = lambda: None,
                 poll_s: float = QUEUE_POLL_S, clock: Callable[[], float] = time.time,
                 scheduling: Round | None = None):
        """`start(job_id, narrowing)` claims and starts a queued job, returning once it holds its
        devices, is queued again or ended (False: another replica took it first); `expire(job_id,
        why)` ends one past its deadline (JobRunner.start_queued and .expire_queued). `scheduling`:
        the round that gives each of several jobs tried at once a device type (scheduling/rounds.py);
        None: first fit in priority order."""
        self._book, self._start, self._expire, self._clock = book, start, expire, clock
        self._pool_state = pool_state
        self._scheduling = scheduling
        # queued job -> the pool's state when it was last refused here, when, and the number of
        # wakes before its try began (a job that ended during the try counts as a change)
        self._tried: dict[str, tuple[Hashable, float, int]] = {}
        self._wakes = 0
        self._lock = threading.Lock()
        self._loop = Periodic("job-queue", self.run_pass, poll_s, "starting queued jobs")

    def start(self) -> JobQueue:
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    def wake(self) -> None:
        """Devices are free (a job of this replica ended): every queued job is tried at the next pass, now."""
        with self._lock:
            self._wakes += 1
        self._loop.wake()

    def note(self, job_id: str) -> None:
        """The job is going to the queue here: the pool as it is refused it (said before the job is
        queued, so no pass tries it before this is known)."""
        state = self._pool_state()
        with self._lock:
            self._tried[job_id] = (state, self._clock(), self._wakes)

    def run_pass(self) -> list[str]:
        """Fail the expired queued jobs and try to start the others, in order, those the pool has
        changed for since they were last tried here; returns the jobs tried and claimed here (each
        running now, queued again, or ended)."""
        tried = []
        now = self._clock()
        queued = self._book.queue_rows.queued(PASS_JOBS)
        state = self._pool_state() if queued else None
        candidates = []
        for job_id, _owner, _priority, since, deadline in queued:
            if deadline is not None and deadline <= now:
                self._expire(job_id, "it waited in the queue past its deadline (spec.queue_timeout)")
                continue
            with self._lock:
                seen, at, wakes = self._tried.get(job_id, (None, None, -1))
                if wakes == self._wakes and seen == state and now - at < RETRY_S:
                    continue
            candidates.append((job_id, since))
        for job_id, narrowing in self._order(candidates):
            with self._lock:
                before = self._wakes
            if self._start(job_id, narrowing):
                tried.append(job_id)
            with self._lock:
                if job_id in self._tried:  # refused (`note`): a wake during the try means a change
                    seen, at, _ = self._tried[job_id]
                    self._tried[job_id] = (seen, at, before)
        with self._lock:  # forget the jobs no longer queued (started, ended, or beyond this pass's reach)
            ids = {row[0] for row in queued}
            self._tried = {job_id: seen for job_id, seen in self._tried.items()
                           if job_id in ids or now - seen[1] < RETRY_S}  # noted, about to be queued
        return tried

    def _order(self, candidates: list[tuple[str, float]]) -> list[tuple[str, Narrowing | None]]:
        """The jobs to try and the device type each may take: the scheduling round's answer for two
        or more, else the queue's order. A round that fails (the inventory does not answer, the
        solver gives up) costs nothing but its advice: the jobs are tried unnarrowed, in order."""
        plain = [(job_id, None) for job_id, _ in candidates]
        if self._scheduling is None or len(candidates) < 2:
            return plain
        try:
            waiting = []
            for job_id, since in candidates:
                job = self._book.get(job_id)  # NotFound: its results expired meanwhile
                if job.state == m.QUEUED:
                    waiting.append(Waiting(job_id, job.spec, since))
            return self._scheduling.assign(waiting)
        except (errors.AccelmeshError, SolverFailed) as exc:
            log.warning("the scheduling round failed (%s); trying the queued jobs in order, unnarrowed", exc)
            return plain
