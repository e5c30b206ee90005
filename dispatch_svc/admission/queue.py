"""The job queue: a job that cannot get its devices now, or that would take its owner over a quota
(quotas.py), waits instead of failing, and starts once there is room.

A job goes to the queue from the admission gate (admission.py): once planned, its owner's quota
is checked, then the inventory is asked for the devices. When either says no (`Wait`), the
runner stores the job's inputs whole (the rest of the client's stream read to the dispatchers'
data dir, as a leased job's are), and the job becomes QUEUED in the job book, with a QUEUED event
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
waiting, their declared inputs ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT bytes together; the next is
refused before its inputs are stored (its place is taken in the book first: quotas.py).

A RunJob client of a queued job keeps its call: it is sent the QUEUED events, then the job's
events and results once it runs, wherever it runs. Its disconnect cancels the job, queued or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

from accelmesh import errors
from accelmesh.runtime.periodic import Periodic
from dispatch_svc.admission.scheduling import SolverFailed
from dispatch_svc.admission.scheduling.rounds import Narrowing, Round, Waiting
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook

log = logging.getLogger(__name__)

QUEUE_POLL_S = 2.0  # how often a pass runs without a wake-up (another replica's job ended, a reservation lapsed)
PASS_JOBS = 64  # queued jobs a pass tries at most, from the head
RETRY_S = 60.0  # a queued job is tried at least this often, changes seen or not


class QueueSignals:
    """What the runner tells this replica's queue, made before either: a job let go of its devices
    (`wake`: every queued job is tried at the next pass, now), or a job goes to the queue with the
    pool as it was refused (`note`). The queue tries a job again only when what decides whether it
    could start may have changed since it was last refused here: a wake, a different `pool_state`
    (the reservations, the devices' health, the quotas), or RETRY_S passed (a change that a
    snapshot cannot see: devices freed and taken again between two looks)."""

    def __init__(self, pool_state: Callable[[], Hashable] = lambda: None, clock: Callable[[], float] = time.time):
        self.pool_state, self._clock = pool_state, clock
        self.woken = threading.Event()  # the queue's loop waits on it (Periodic)
        # queued job -> the pool's state when it was last refused here, when, and the number of
        # wakes before its try began (a job that ended during the try counts as a change)
        self._tried: dict[str, tuple[Hashable, float, int]] = {}
        self._wakes = 0
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            self._wakes += 1
        self.woken.set()

    def note(self, job_id: str) -> None:
        """Said before the job is queued, so no pass tries it before this is known."""
        state = self.pool_state()
        with self._lock:
            self._tried[job_id] = (state, self._clock(), self._wakes)

    def unchanged(self, job_id: str, state: Hashable, now: float) -> bool:
        """Whether nothing that decides the job's start changed since it was refused here."""
        with self._lock:
            seen, at, wakes = self._tried.get(job_id, (None, None, -1))
            return wakes == self._wakes and seen == state and now - at < RETRY_S

    def wakes(self) -> int:
        with self._lock:
            return self._wakes

    def tried(self, job_id: str, wakes_before: int) -> None:
        """A try of the job began after `wakes_before` wakes: one during the try means a change."""
        with self._lock:
            if job_id in self._tried:  # refused (`note`)
                seen, at, _ = self._tried[job_id]
                self._tried[job_id] = (seen, at, wakes_before)

    def keep(self, queued: set[str], now: float) -> None:
        """Forget the jobs no longer queued (started, ended, or beyond a pass's reach), except those
        noted and about to be queued."""
        with self._lock:
            self._tried = {job_id: seen for job_id, seen in self._tried.items()
                           if job_id in queued or now - seen[1] < RETRY_S}


class JobQueue:
    """One replica's passes over the shared queue (see the module's docstring). A job that waits
    for long is planned again once per change of the pool (QueueSignals), not once per pass."""

    def __init__(self, book: JobBook, start: Callable[[str, Narrowing | None], bool],
                 expire: Callable[[str, str], bool], signals: QueueSignals, *,
                 poll_s: float = QUEUE_POLL_S, clock: Callable[[], float] = time.time,
                 scheduling: Round | None = None):
        """`start(job_id, narrowing)` claims and starts a queued job, returning once it holds its
        devices, is queued again or ended (False: another replica took it first); `expire(job_id,
        why)` ends one past its deadline (JobRunner.start_queued and .expire_queued). `signals`:
        what the runner says of its jobs. `scheduling`: the round that gives each of several jobs
        tried at once a device type (scheduling/rounds.py); None: first fit in priority order."""
        self._book, self._start, self._expire, self._clock = book, start, expire, clock
        self._signals = signals
        self._scheduling = scheduling
        self._loop = Periodic("job-queue", self.run_pass, poll_s, "starting queued jobs", woken=signals.woken)

    def start(self) -> JobQueue:
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    def run_pass(self) -> list[str]:
        """Fail the expired queued jobs and try to start the others, in order, those the pool has
        changed for since they were last tried here; returns the jobs tried and claimed here (each
        running now, queued again, or ended)."""
        tried = []
        now = self._clock()
        queued = self._book.queue_rows.queued(PASS_JOBS)
        state = self._signals.pool_state() if queued else None
        candidates = []
        for job_id, _owner, _priority, since, deadline in queued:
            if deadline is not None and deadline <= now:
                self._expire(job_id, "it waited in the queue past its deadline (spec.queue_timeout)")
                continue
            if not self._signals.unchanged(job_id, state, now):
                candidates.append((job_id, since))
        for job_id, narrowing in self._order(candidates):
            before = self._signals.wakes()
            if self._start(job_id, narrowing):
                tried.append(job_id)
            self._signals.tried(job_id, before)
        self._signals.keep({row[0] for row in queued}, now)
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
