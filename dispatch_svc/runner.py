"""A job's lifecycle: start it, run its strategy, end it exactly once (MISSION A2, A3, A5-A7).

The runner keeps what only the running dispatcher knows of each job (`LiveJob`), opens the job's
trace span, hands the job to its strategy (dispatch_svc.strategies: data-parallel inference or
training, or a pipeline) and, whatever happens, ends it once: the devices' pool closed, the
reservations released, the record finished as SUCCEEDED, CANCELLED or FAILED. It reaches the
other services only through the `Mesh` port and reads a job's inputs through an `InputFeed`.
"""

from __future__ import annotations

import contextvars
import logging
import threading

from opentelemetry import trace

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime import attributes as attr
from dispatch_svc import records as m
from dispatch_svc.device_queues import Cancelled, DevicePool
from dispatch_svc.interface import Build, InputFeed, JobDevice, LiveJob, Mesh
from dispatch_svc.jobs import JobBook
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.strategies import data_parallel, pipeline, strategy_for
from dispatch_svc.strategies.context import JobContext, Limits

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, mesh: Mesh, book: JobBook, throughput: ThroughputModel, *,
                 max_shard_bytes: int, inflight_bytes: int, tracer: trace.Tracer | None = None):
        self.mesh = mesh
        self._tracer = tracer or trace.NoOpTracer()
        self.book = book
        self.throughput = throughput
        self.limits = Limits(max_shard_bytes, inflight_bytes)
        self._live: dict[str, LiveJob] = {}
        self._lock = threading.Lock()

    def live(self, job_id: str) -> LiveJob | None:
        with self._lock:
            return self._live.get(job_id)

    def cancel(self, job_id: str) -> m.JobRecord:
        job = self.book.get(job_id)
        live = self.live(job_id)
        if live is not None and not job.final:
            live.scope.cancel()
        return job

    def plan(self, spec: m.JobSpec) -> tuple[Program | None, m.Plan, list[Build], list[JobDevice]]:
        """What PlanJob answers: the plan the job's strategy would run, nothing reserved or run."""
        if spec.placement is not None:
            program, placed = pipeline.place(self.mesh, spec)
            return program, placed.plan, [], list(placed.devices.values())
        return data_parallel.plan(self.mesh, self.throughput, self.limits, spec)

    def start(self, spec: m.JobSpec, owner: str = "") -> tuple[m.JobRecord, LiveJob]:
        self.book.expire_results()  # every new job sweeps the expired ones: no extra thread needed
        job = self.book.create(spec, owner)
        live = LiveJob()
        with self._lock:
            self._live[job.job_id] = live
        return job, live

    def run(self, job: m.JobRecord, live: LiveJob, feed: InputFeed, *, background: bool = True) -> None:
        """Plan, build, reserve and take the inputs in the calling thread (so input errors reach the
        caller); the shards' results are collected in a background thread (or here)."""
        live.span = self._tracer.start_span("dispatch.job", attributes={
            attr.JOB_ID: job.job_id, attr.JOB_KIND: job.spec.kind, attr.PROGRAM: job.spec.program})
        token = trace.use_span(live.span, end_on_exit=False)
        token.__enter__()  # everything this job does, on any thread, is part of its trace
        try:
            ctx = JobContext(self.mesh, self.book, self.throughput, self.limits, job, live, feed, self._tracer)
            work = strategy_for(job.spec)(ctx)
        except BaseException as exc:
            self._end(job, live, live.pool, exc)
            raise
        finally:
            context = contextvars.copy_context()
            token.__exit__(None, None, None)
        if background:
            threading.Thread(target=context.run, args=(self._collect, job, live, live.pool, work), daemon=True,
                             name=f"job-{job.job_id}").start()
        else:
            context.run(self._collect, job, live, live.pool, work)

    def _collect(self, job, live, pool, work) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, never lost
            self._end(job, live, pool, exc)
            return
        self._end(job, live, pool, None)

    def _end(self, job: m.JobRecord, live: LiveJob, pool: DevicePool | None, exc: BaseException | None) -> None:
        # Decided before this method cancels the scope itself: only a cancel from outside (CancelJob,
        # the client's deadline or disconnect) makes the job CANCELLED; a bug stays a failure.
        cancelled = isinstance(exc, Cancelled) or (
            exc is not None and live.scope.cancelled.is_set() and not isinstance(exc, errors.AccelmeshError))
        if exc is not None:
            live.scope.cancel()  # stop the job's other shards on their workers
        if pool is not None:
            pool.close()
        try:
            self.mesh.release(job.job_id)
        except errors.AccelmeshError as release_error:  # the lease runs out on its own
            log.warning("releasing %s failed: %s", job.job_id, release_error)
        if exc is None:
            self.book.finish(job, m.SUCCEEDED, message="done")
        elif cancelled:
            self.book.finish(job, m.CANCELLED, error="cancelled")
        else:
            if not isinstance(exc, errors.AccelmeshError):
                log.error("job %s failed", job.job_id, exc_info=exc)
            live.error = exc
            self.book.finish(job, m.FAILED, error=str(exc) or type(exc).__name__)
        if live.span is not None:
            if exc is not None:
                live.span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            live.span.end()
        live.done.set()
        # Final: the book has it all. Kept here, every job ever run (its error, traceback and
        # inputs among them) would stay in memory until the dispatcher stops.
        with self._lock:
            self._live.pop(job.job_id, None)
        self.book.forget_live(job.job_id)
