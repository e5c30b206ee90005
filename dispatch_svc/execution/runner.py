"""A job's lifecycle: start it, run its strategy, end it exactly once (requirements A2, A3, A5-A7).

The runner keeps what only the running dispatcher knows of each job (`LiveJob`), opens the job's
trace span, has its strategy (execution/strategies: data-parallel inference or training, or a
pipeline) plan it, asks the admission gate for what the plan claims, and either starts the
strategy on the grant or puts the job in the queue. Whatever happens, it ends the job once: the
devices' pool closed, the reservations released, the record finished as SUCCEEDED, CANCELLED or
FAILED. It reaches the other services only through the `Inventory`, `Compiler` and `Workers`
ports and reads a job's inputs through an `InputFeed`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import traceback
from collections.abc import Callable

from opentelemetry import trace

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime import attributes as attr
from accelmesh.runtime.errors import bounded
from dispatch_svc.admission.admission import AdmissionGate, NoCapacityNow, Wait
from dispatch_svc.admission.queue import QueueSignals
from dispatch_svc.admission.scheduling.rounds import Narrowing
from dispatch_svc.dataplane.call_scope import cancels_calls
from dispatch_svc.dataplane.device_queues import DevicePool
from dispatch_svc.execution.direct import NotQueued, check_signer, direct_job
from dispatch_svc.execution.endings import detached, failure_message, let_go, release_all
from dispatch_svc.execution.strategies import data_parallel, pipeline, strategy_for
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import INPUTS_LOST_ERROR, JobBook, LeaseLost
from dispatch_svc.jobs.limits import JobLimits, Limits
from dispatch_svc.jobs.stored_inputs import SpoolingFeed, StoredFeed, store_rest
from dispatch_svc.jobs.validation import check_limits
from dispatch_svc.metrics import NO_METRICS, DispatchMetrics
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.ports import Build, Compiler, InputFeed, Inventory, JobDevice, LiveJob, LiveJobs, Workers

log = logging.getLogger(__name__)

# A failed job's error as its record keeps it: an aggregate of shard failures can grow long, and
# the record is read by every GetJob and ListJobs.
MAX_ERROR_BYTES = 4096
# How long a job's end is tried again while the book does not answer (a database restarting takes
# a few seconds), waiting RECORD_RETRY_S, doubled each time up to 4 s, between tries. Past it the
# job is let go of unrecorded: its lease lapses, and a replica (this one too) takes it over.
RECORD_WAIT_S, RECORD_RETRY_S = 30.0, 0.25


class JobRunner:
    """Starts, runs and ends jobs. `live` holds running jobs only: a job leaves it (and the
    book's own live map) when it ends, and takes nothing of its inputs, parameters or exception
    with it into the record, which keeps the error as text."""

    def __init__(self, inventory: Inventory, compiler: Compiler, workers: Workers, book: JobBook,
                 throughput: ThroughputModel, *, limits: Limits, gate: AdmissionGate | None = None,
                 job_limits: JobLimits | None = None, live: LiveJobs | None = None,
                 signals: QueueSignals | None = None, tracer: trace.Tracer | None = None,
                 clock: Callable[[], float] = time.time, metrics: DispatchMetrics = NO_METRICS,
                 sign_ticket: Callable[..., bytes] | None = None):
        """`gate`: the owner's quota and the queue (admission/admission.py); None, a gate without
        either, where a job that cannot get its devices fails at once. `signals`: what the queue is
        told of jobs ending and going to it (None: no queue runs beside this runner)."""
        self.inventory, self.compiler, self.workers = inventory, compiler, workers
        self._tracer = tracer or trace.NoOpTracer()
        self.book = book
        self.throughput = throughput
        self.limits = limits
        self.gate = gate or AdmissionGate(inventory, reservation_ttl_s=limits.reservation_ttl_s, metrics=metrics)
        self.job_limits = job_limits or JobLimits()
        self.live_jobs = live or LiveJobs()
        self.signals = signals or QueueSignals()
        self._clock = clock
        self.metrics = metrics
        self._sign_ticket = sign_ticket  # DATA_PATH_DIRECT jobs' tickets (execution/direct.py)

    def check(self, spec: m.JobSpec, *, running: bool = True) -> None:
        """The spec within the dispatcher's limits; raises before anything is planned."""
        check_limits(spec, self.job_limits, self.limits.max_shard_bytes, running=running)
        check_signer(spec, self._sign_ticket)

    @property
    def running(self) -> int:
        """Jobs started and not yet ended."""
        return self.live_jobs.count()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every job started has ended (and let go of all it held) within `timeout_s`."""
        return self.live_jobs.wait_empty(timeout_s)

    def live(self, job_id: str) -> LiveJob | None:
        return self.live_jobs.get(job_id)

    def cancel(self, job_id: str, reason: str = "cancelled by CancelJob") -> m.JobRecord:
        """Cancel the job here if this replica runs it, else ask the one that does (takeover.py)."""
        job = self.book.get(job_id)
        live = self.live(job_id)
        if live is not None and not job.final:
            live.scope.cancel(reason)
        elif job.state == m.QUEUED:
            if not self.expire_queued(job_id, reason, m.CANCELLED):  # it started meanwhile: stop it there
                return self.cancel(job_id, reason)
        elif not job.final and self.book.lease_s:
            self.book.leases.request_cancel(job_id, reason)
        return job

    def plan(self, spec: m.JobSpec) -> tuple[Program | None, m.Plan, list[Build], list[JobDevice]]:
        """What PlanJob answers: the plan the job's strategy would run, nothing reserved or run."""
        self.check(spec, running=False)
        if spec.placement is not None:
            program, placed = pipeline.place(self.inventory, self.compiler, spec, self.throughput.stages)
            return program, placed.plan, [], list(placed.devices.values())
        return data_parallel.plan(self.inventory, self.compiler, self.throughput, self.limits, spec)

    def start(self, spec: m.JobSpec, owner: str = "") -> tuple[m.JobRecord, LiveJob]:
        self.check(spec)  # before the record: a spec over the limits is never stored
        self.gate.check_priority(owner, spec.priority)
        self.book.expire_results()  # every new job sweeps the expired ones: no extra thread needed
        job = self.book.create(spec, owner)
        live = self.live_jobs.add(job.job_id)
        if spec.data_path == m.DIRECT:
            live.direct = direct_job(job, self.book, self._sign_ticket, self.workers)
        return job, live

    def run(self, job: m.JobRecord, live: LiveJob, feed: InputFeed, *, background: bool = True,
            kept: frozenset[int] | None = None, narrowing: Narrowing | None = None) -> None:
        """Plan (its strategy's proposal), admit (the gate: quota, then reservations), start the
        strategy and take the inputs in the calling thread (so input errors reach the caller); the
        shards' results are collected in a background thread (or here). `kept`: the finished shards
        of a job taken over that its strategy keeps (None: it runs whole). A leased job (its book
        shared by dispatch replicas) stores its inputs as they are read, so another replica can
        take it over (`take_over`). A job the gate tells to wait has its inputs stored whole and
        waits in the queue: run returns then. `narrowing`: the devices a queue's scheduling round
        gave it, for this try's planning only."""
        live.span = self._tracer.start_span("dispatch.job", attributes={
            attr.JOB_ID: job.job_id, attr.JOB_KIND: job.spec.kind, attr.PROGRAM: job.spec.program})
        token = trace.use_span(live.span, end_on_exit=False)
        token.__enter__()  # everything this job does, on any thread, is part of its trace
        # A stored one: taken over, or from the queue. A direct job's inputs are the client's alone.
        if self.book.lease_s and not isinstance(feed, StoredFeed) and live.direct is None:
            feed = self._spooled(job, feed)
        try:
            ctx = JobContext(self.inventory, self.compiler, self.workers, self.book, self.throughput, self.limits,
                             job, live, feed, self._tracer, kept=kept, metrics=self.metrics)
            strategy = strategy_for(job.spec, self.job_limits.max_shards)
            # Planning waits on the compile service, seconds for a new program: the job's stop (CancelJob, its
            # client gone, its input refused as it arrived) cancels the call in flight, and a stop the planning
            # did not see (a fake port, a build that came back just then) is seen before anything is reserved.
            live.check()
            try:
                with cancels_calls(live.scope):
                    proposal = strategy.propose(ctx, narrowing)
            except NoCapacityNow as busy:  # a plan that needs what other jobs hold now: it waits as a refusal does
                live.check()
                decision = self.gate.wait_for_capacity(job, busy)
            else:
                live.check()
                decision = self.gate.admit(job, live, proposal.claims)
            if isinstance(decision, Wait):
                self._queue(job, live, feed, decision.reason)
                return
            self.book.update(job, state=m.RUNNING)
            live.settled.set()  # it holds its devices: a queue pass that started it goes on
            work = strategy.start(ctx, proposal, decision)
        except BaseException as exc:
            self._end(job, live, live.pool, exc, feed)
            if live.refused is not None and isinstance(exc, errors.Cancelled):
                raise detached(live.refused) from None  # the caller's status is the refusal, not the cancel
            raise
        finally:
            context = contextvars.copy_context()
            token.__exit__(None, None, None)
        if background:
            threading.Thread(target=context.run, args=(self._collect, job, live, live.pool, work, feed), daemon=True,
                             name=f"job-{job.job_id}").start()
        else:
            context.run(self._collect, job, live, live.pool, work, feed)

    def _spooled(self, job: m.JobRecord, feed: InputFeed) -> InputFeed:
        def stored():
            self.book.leases.inputs_stored(job.job_id)
        if not job.spec.inputs and not job.spec.client_parameters:
            stored()  # nothing comes from the client: any replica can run it from its spec
            return feed
        return SpoolingFeed(feed, self.book.inputs, job, stored)

    def take_over(self, job_id: str, inputs_stored: bool) -> None:
        """Run a job whose replica stopped renewing its lease (takeover.py claimed it for this one):
        the reservations it held released, then from its stored inputs, an inference job keeping
        the shards finished; a job whose inputs never all arrived ends FAILED, saying so."""
        job = self.book.get(job_id)
        if job.final or self.live(job_id) is not None:
            return
        # Held live from here: only the jobs this replica holds have their leases renewed.
        live = self.live_jobs.add(job_id)
        self.book.adopt(job)
        try:
            self.inventory.release(job_id)  # the stopped replica's: this one reserves what it needs anew
        except errors.AccelmeshError as exc:  # their leases lapse on their own
            log.warning("releasing the reservations of %s before taking it over failed: %s", job_id, exc)
        if not inputs_stored:
            try:
                self.book.finish(job, m.FAILED, INPUTS_LOST_ERROR)
                self.book.drop_stored(job_id)
            finally:
                self._let_go_of(job, live)
            return
        # An inference job's finished shards are kept (their outputs are on disk); the shards of
        # any other kind depend on each other: its outputs so far go, it starts again from its inputs.
        resumable = (job.plan is not None and bool(job.plan.shards) and job.spec.kind == m.INFERENCE
                     and job.spec.placement is None)
        if resumable:
            planned = {s.index for s in job.plan.shards}
            kept = frozenset(self.book.finished_shards(job_id) & planned)
        else:
            kept = None
            self.book.results.delete(job_id)
            job.shards, job.progress = [], 0.0
        self.book.emit(job, m.TAKEN_OVER, message=(
            f"dispatch replica {self.book.replica} took the job over from one that stopped renewing its lease: "
            + (f"{len(kept)} of {len(job.plan.shards)} shards were finished and are kept" if resumable
               else "it runs again from its stored inputs")))
        try:
            self.run(job, live, StoredFeed(self.book.inputs, job), background=False, kept=kept)
        except Exception:  # noqa: BLE001 - ended and recorded by run
            pass

    def _queue(self, job: m.JobRecord, live: LiveJob, feed: InputFeed, reason: str) -> None:
        """The job waits in the queue: the rest of its inputs stored (a job from the store has them
        all there), then QUEUED in the book, and let go of here until a queue pass starts it."""
        try:
            if live.direct is not None:
                raise NotQueued(reason)
            if not isinstance(feed, StoredFeed):
                store_rest(feed, self.book.inputs, job, lambda: self.book.leases.inputs_stored(job.job_id))
            self.signals.note(job.job_id)
            self.book.enqueue(job, reason, self.gate.deadline(job, self._clock()))
        except BaseException as exc:  # the client went away (or sent bad rows) while its inputs were stored
            self._end(job, live, live.pool, exc, feed)
            raise
        if live.span is not None:
            live.span.add_event("queued", {"reason": bounded(reason, MAX_ERROR_BYTES)})
            live.span.end()
        let_go(live, feed, None)
        self._let_go_of(job, live)

    def start_queued(self, job_id: str, narrowing: Narrowing | None = None) -> bool:
        """Claim a queued job and start it here from its stored inputs (JobQueue's pass), planned
        within `narrowing` if the pass's scheduling round gave it one. Returns once it holds its
        devices, went back to the queue or ended; False if another replica (or a cancel) took it
        first."""
        job = self.book.claim_queued(job_id)
        if job is None:
            return False
        live = self.live_jobs.add(job_id)

        def run():
            try:
                self.run(job, live, StoredFeed(self.book.inputs, job), background=False, narrowing=narrowing)
            except Exception:  # noqa: BLE001 - ended and recorded by run
                pass
        threading.Thread(target=contextvars.copy_context().run, args=(run,), name=f"queued-{job_id}",
                         daemon=True).start()
        live.settled.wait()
        return True

    def expire_queued(self, job_id: str, why: str, state: str = m.FAILED) -> bool:
        """End a queued job without running it (FAILED past its deadline, or CANCELLED); False if it
        was no longer queued (started, or ended, by then)."""
        job = self.book.claim_queued(job_id)
        if job is None:
            return False
        reason = job.queue.reason if job.queue is not None else ""
        message = why if state == m.CANCELLED else f"{why}; it was waiting because {reason}" if reason else why
        try:
            self.book.finish(job, state, error=bounded(message, MAX_ERROR_BYTES))
        finally:
            self.book.drop_stored(job_id)
            self.book.forget_live(job_id)  # it never ran here: the runner holds nothing of it
        return True

    def _collect(self, job, live, pool, work, feed) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, never lost
            self._end(job, live, pool, exc, feed)
            return
        self._end(job, live, pool, None, feed)

    def _end(self, job: m.JobRecord, live: LiveJob, pool: DevicePool | None, exc: BaseException | None,
             feed: InputFeed | None = None) -> None:
        if exc is not None and live.refused is not None:
            exc = live.refused  # what stopped the job, whatever the stop made fail: FAILED with it, not CANCELLED
        lease, live.lease = live.lease, None  # the keeper references the live job: no cycle outlives it
        if lease is not None:
            lease.stop()  # no renewal from here on: the release below is the last word
            if exc is not None and lease.lapse is not None:
                exc = lease.lapse  # a lapsed lease stopped the job: FAILED with why, not CANCELLED
        # Decided before this method cancels the scope itself: only a cancel from outside (CancelJob,
        # the client's deadline or disconnect) makes the job CANCELLED; a bug stays a failure.
        cancelled = isinstance(exc, errors.Cancelled) or (
            exc is not None and live.scope.cancelled.is_set() and not isinstance(exc, errors.AccelmeshError))
        if exc is not None:
            live.scope.cancel()  # stop the job's other shards on their workers
        if pool is not None:
            pool.close()
        # A replica that took the job over holds its reservations and its stored inputs now.
        ours = self._still_runs(job.job_id)
        if ours:
            release_all(self.inventory, self.workers, job.job_id, live, exc)
        recorded = True
        try:
            self._finish_when_answering(job, live, exc, cancelled)
        except LeaseLost as lost:  # another replica took the job over: its record is that one's to write
            log.warning("%s", lost)
            live.error = live.error or lost
        except errors.Unavailable as away:
            # Held here, unrecorded, the job would stay RUNNING for good: its lease renewed by this
            # replica while nothing runs it, a queue pass waiting on it. Let go of, its lease lapses
            # and the takeover runs it again from its stored inputs (an inference job keeps the
            # shards whose events were written).
            log.warning("job %s ended but the job book did not answer for %g s (%s): let go of unrecorded, "
                        "it is taken over once its lease lapses", job.job_id, RECORD_WAIT_S, away)
            live.error = live.error or away
            recorded = False
        if live.span is not None:
            if exc is not None:
                live.span.set_status(trace.Status(trace.StatusCode.ERROR, bounded(str(exc), MAX_ERROR_BYTES)))
            live.span.end()
        let_go(live, feed, exc)
        if ours and recorded:
            self.book.drop_stored(job.job_id)  # no replica takes a final job over, nor the queue starts it
        # Its devices and its quota are free now: the queue's next pass tries every queued job. Said
        # before `live.done`, so whoever saw the job let go of knows the queue was woken.
        self.signals.wake()
        # Final: the book has it all. Kept here, every job ever run (its error, traceback and
        # inputs among them) would stay in memory until the dispatcher stops.
        self._let_go_of(job, live)

    def _let_go_of(self, job: m.JobRecord, live: LiveJob) -> None:
        """The job is no longer this runner's (it ended, or went to the queue): out of every map here
        and in the book's memory, then `live.done`, last, so whoever waits on it finds it gone."""
        self.book.forget_live(job.job_id)
        self.live_jobs.remove(job.job_id)
        live.settled.set()
        live.done.set()

    def _still_runs(self, job_id: str) -> bool:
        """Whether this replica still holds the job's lease (always, unleased). A book that does not
        answer: no, since another replica may hold it; the reservations then lapse on their own
        and the stored inputs go when the job's results expire."""
        try:
            return self.book.leases.holds(job_id)
        except errors.AccelmeshError:
            return False

    def _finish_when_answering(self, job: m.JobRecord, live: LiveJob, exc: BaseException | None,
                               cancelled: bool) -> None:
        """The job's end recorded, tried again while the book does not answer, for RECORD_WAIT_S."""
        deadline, pause = time.monotonic() + RECORD_WAIT_S, RECORD_RETRY_S
        while True:
            try:
                return self._finish(job, live, exc, cancelled)
            except errors.Unavailable:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)  # a back-off, not a synchronisation: the database is restarting
            pause = min(pause * 2, 4.0)

    def _finish(self, job: m.JobRecord, live: LiveJob, exc: BaseException | None, cancelled: bool) -> None:
        try:
            self._record_end(job, live, exc, cancelled)
        finally:
            if job.final:
                self.metrics.job_ended(job.state, (job.ended or self._clock()) - job.created)

    def _record_end(self, job: m.JobRecord, live: LiveJob, exc: BaseException | None, cancelled: bool) -> None:
        if exc is None:
            self.book.finish(job, m.SUCCEEDED, message="done")
        elif cancelled:
            self.book.finish(job, m.CANCELLED, error=bounded(
                (str(exc) if isinstance(exc, errors.Cancelled) else "") or live.scope.reason or "cancelled",
                MAX_ERROR_BYTES))
        else:
            if not isinstance(exc, errors.AccelmeshError):  # a bug: its traceback as text (see endings.let_go)
                log.error("job %s failed\n%s", job.job_id, "".join(traceback.format_exception(exc)).rstrip())
            live.error = detached(exc)
            self.book.finish(job, m.FAILED, error=failure_message(exc, MAX_ERROR_BYTES))
