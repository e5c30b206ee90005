"""What every job strategy works with: one job's context, and the shared steps of running shards.

A strategy receives a `JobContext` (the inventory, compiler and workers ports, the job book, the
throughput model, the job, what only the running dispatcher knows of it, its input feed) and
calls these steps instead of writing them again: fetch or take the parameters, open the job's
device pool (retries recorded on the job), run one shard attempt (events, trace span, the
worker's outputs checked against the program, shard record, throughput), and route the input
feed into shards within one in-flight budget. Reserving is not among them: the admission gate
reserved what the job's plan claims before the strategy starts (admission/admission.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime import attributes as attr
from dispatch_svc.dataplane.device_queues import Attempt, DevicePool, ShardFailed
from dispatch_svc.execution.device_watch import watch_devices
from dispatch_svc.execution.direct import stored_refs
from dispatch_svc.execution.output_checks import check_shard_outputs
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.jobs.validation import check_parameters
from dispatch_svc.metrics import NO_METRICS, DispatchMetrics
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.ports import (
    Build,
    Compiler,
    InputFeed,
    Inventory,
    JobDevice,
    LiveJob,
    ShardCall,
    ShardOutput,
    ShardWork,
    StoredRefs,
    Workers,
)

log = logging.getLogger(__name__)

BUDGET_POLL_S = 0.5  # how often a reader waiting for the budget checks for a cancel


class InflightBudget:
    """Bytes of a job's shard inputs in memory at once: the input reader takes, finished shards
    give back. A shard larger than the whole budget still runs, alone."""

    def __init__(self, limit: int, live: LiveJob):
        self._limit, self._live = limit, live
        self._used = 0
        self._changed = threading.Condition()

    def take(self, nbytes: int) -> None:
        with self._changed:
            while self._used and self._used + nbytes > self._limit:
                if self._live.failure is not None:
                    raise self._live.failure
                self._changed.wait(BUDGET_POLL_S)
                self._live.check()
            self._used += nbytes

    def give(self, nbytes: int) -> None:
        with self._changed:
            self._used -= nbytes
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """A shard finally failed: the job's first failure stops the reader."""
        with self._changed:
            self._live.failure = self._live.failure or error
            self._changed.notify_all()

    @property
    def used(self) -> int:
        return self._used


@dataclass
class _MakespanClock:
    """What a job's measured makespan is taken from (JobContext._ended)."""

    start: float | None = None  # perf_counter of the first shard's start (training: of this step's)
    running: int = 0  # attempts under way
    steps: int = 0  # training steps ended
    step_seconds: float = 0.0  # their makespans, summed


@dataclass
class JobContext:
    inventory: Inventory
    compiler: Compiler
    workers: Workers
    book: JobBook
    throughput: ThroughputModel
    limits: Limits
    job: m.JobRecord
    live: LiveJob
    feed: InputFeed
    tracer: trace.Tracer = field(default_factory=trace.NoOpTracer)
    # A job taken over from a dispatch replica that stopped (takeover.py), resumed: the shards of
    # its plan that one finished, kept (None: the job runs whole).
    kept: frozenset[int] | None = None
    metrics: DispatchMetrics = NO_METRICS
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _clock: _MakespanClock = field(default_factory=_MakespanClock)

    @property
    def spec(self) -> m.JobSpec:
        return self.job.spec

    def parameters(self, program: Program | None) -> list[tuple[str, np.ndarray]]:
        """The client's parameters (checked against the program), or the program's initial ones."""
        if self.spec.client_parameters:
            given = self.feed.parameters()
            check_parameters(program, given)
            return given
        if program is None or not program.parameters:
            return []
        values = self.compiler.fetch_parameters(program, self.spec.parameter_seed)
        return [(p.name, v) for p, v in zip(program.parameters, values)]

    def open_pool(self, devices: Sequence[JobDevice], run, run_group=None) -> DevicePool:
        """The job's device pool (`run_group`: DevicePool's; a direct job's shard goes in a group
        once its inputs are at its worker); every retry is recorded on the shard and as an event,
        and a device the inventory calls lost leaves it at once (device_watch.py)."""
        direct = self.live.direct
        ready = ((lambda shard, device: direct.holds(shard.index, device.node_address)) if direct is not None
                 else (lambda shard, device: True))
        self.live.pool = DevicePool(list(devices), run, self.live.scope, on_retry=self.retried, run_group=run_group,
                                    ready=ready)
        watch_devices(self.inventory, self.workers, self.live.pool, self.job.job_id, devices, self.live,
                      self.limits.device_watch_s)
        return self.live.pool

    def execute(self, program: Program, builds: Sequence[Build], params: list[tuple[str, np.ndarray]] | None,
                attempt: Attempt, held: str | None = None, span_attributes: dict | None = None) -> ShardOutput:
        """Run one shard attempt on its device. `params` None: the shard's own (`ShardWork.params`);
        `held` prefixes the keys its parameters are held under on workers (None: sent in full).
        The outputs are checked against `program` (the stage's, for a pipeline stage): a mismatch
        raises ShardFailed, so the shard is retried on another device."""
        call, attributes = self._call(program, builds, params, attempt, held, span_attributes)
        started = time.perf_counter()
        self._started(started)
        try:
            with self.tracer.start_as_current_span("dispatch.shard", attributes=attributes):
                out = self.workers.execute(call.job_id, call.shard_index, call.attempt, call.device, call.build,
                                           call.artifact, call.arrays, call.rows, self.live.scope,
                                           held_keys=call.held_keys, place_outputs=call.place_outputs,
                                           stored=call.stored)
                # Before any strategy combines them: a worker's wrong outputs fail this attempt only.
                check_shard_outputs(program, out.outputs, call.shard_index, call.device.id, call.rows)
        except BaseException:
            self._ended(started, None)
            raise
        finished = time.perf_counter()
        return self._done(program, attempt, call, out, finished - started, started, finished)

    def execute_group(self, program: Program, builds: Sequence[Build], params: list[tuple[str, np.ndarray]] | None,
                      attempts: Sequence[Attempt], held: str | None = None) -> Iterator[ShardOutput | BaseException]:
        """`execute` for attempts on one device, sent to its worker together (Workers.execute_group):
        for each, in order as its answer comes, its outputs or its ShardFailed, given, not raised
        (DevicePool's `run_group`)."""
        prepared = [self._call(program, builds, params, attempt, held, None) for attempt in attempts]
        spans = [self.tracer.start_span("dispatch.shard", attributes=attributes) for _, attributes in prepared]
        calls = [dataclasses.replace(call, span=span) for (call, _), span in zip(prepared, spans)]
        started = time.perf_counter()
        for _ in calls:
            self._started(started)
        answered = 0
        try:
            outs = self.workers.execute_group(calls, self.live.scope)
            for attempt, call, span, out in zip(attempts, calls, spans, outs):
                answered += 1
                finished = time.perf_counter()
                try:
                    if isinstance(out, BaseException):
                        raise out
                    check_shard_outputs(program, out.outputs, call.shard_index, call.device.id, call.rows)
                    # The group's time so far, shared alike: a shard's own time, as the throughput fit
                    # needs it (a worker answers a batch's small shards together).
                    result = self._done(program, attempt, call, out, (finished - started) / answered, started, finished)
                except ShardFailed as exc:
                    self._ended(started, None)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, exc.cause))
                    result = exc.with_traceback(None)
                finally:
                    span.end()
                yield result
        finally:
            for span in spans[answered:]:  # the group's call failed, or its caller stopped reading
                self._ended(started, None)
                span.end()

    def _call(self, program: Program, builds: Sequence[Build], params: list[tuple[str, np.ndarray]] | None,
              attempt: Attempt, held: str | None, span_attributes: dict | None) -> tuple[ShardCall, dict]:
        """The attempt as the worker is sent it, once its inputs are at its worker (DATA_PATH_DIRECT:
        the client puts them, so its time is the shard's own from there on, as the throughput fit
        needs), its SHARD_STARTED told; and its span's attributes."""
        shard: ShardWork = attempt.shard
        device: JobDevice = attempt.device
        build = next(b for b in builds if b.target_type == device.target_type)
        artifact = build.executables.get(shard.rows, build.portable)
        direct = self.live.direct
        stored = None if direct is None else StoredRefs(*stored_refs(
            direct, [i.name for i in program.inputs], shard.index, attempt.number, device.node_address,
            self.live.check))
        self.book.emit(self.job, m.SHARD_STARTED, shard=self.record(shard, device, build, attempt.number),
                       message=f"shard {shard.index} on {device.id}")
        shard_params = params if shard.params is None else shard.params
        arrays = [*shard_params, *zip((i.name for i in program.inputs), shard.inputs)]
        held_keys = {name: f"{held}:{name}" for name, _ in shard_params} if held else None
        attributes = {
            attr.JOB_ID: self.job.job_id, attr.SHARD_INDEX: shard.index, attr.SHARD_ATTEMPT: attempt.number,
            attr.DEVICE_ID: device.id, attr.TARGET_TYPE: device.target_type, attr.RULE: build.rule_name,
            attr.ARTIFACT_KEY: artifact.key, attr.SHARD_ROWS: shard.rows,
            attr.SHARD_BYTES: sum(a.nbytes for _, a in arrays), **(span_attributes or {})}
        return ShardCall(self.job.job_id, shard.index, attempt.number, device, build, artifact, arrays, shard.rows,
                         held_keys, shard.place_outputs, stored), attributes

    def _done(self, program: Program, attempt: Attempt, call: ShardCall, out: ShardOutput, seconds: float,
              started: float, finished: float) -> ShardOutput:
        """A shard attempt that succeeded, its own time `seconds` (its call ran from `started` to
        `finished`): where its outputs lie, its record, metrics and throughput."""
        direct = self.live.direct
        if direct is not None:
            direct.finished(call.shard_index, call.device.node_address, [o.name for o in out.outputs],
                            [o.name for o in program.outputs])
        shard, device = attempt.shard, attempt.device
        record = self.record(shard, device, call.build, attempt.number)
        record.queue_seconds, record.load_seconds = out.queue_seconds, out.load_seconds
        record.execute_seconds, record.total_seconds = out.execute_seconds, seconds
        self.metrics.shard(device.target_type, record.total_seconds)
        # What of the shard's own time was not the device's execution (sending, loading the
        # executable) is the part a shard pays whatever its rows.
        own = record.own_seconds
        if out.execute_seconds > 0 and self.throughput.warm(device.id, call.artifact.key):
            self.throughput.record(program.ref, device.target_type, shard.rows, own,
                                   fixed_seconds=own - out.execute_seconds, device_type=device.spec.type)
        self._ended(started, finished)
        return out

    def _started(self, started: float) -> None:
        with self._lock:
            clock = self._clock
            if clock.running == 0 and (clock.start is None or self.spec.kind == m.TRAINING):
                clock.start = started  # a training step's shards start together, after the last step's ended
            clock.running += 1

    def _ended(self, started: float, finished: float | None) -> None:
        """The job's measured makespan (JobRecord.measured_seconds) after an attempt ended
        (``finished`` None: it failed): inference, from the first shard's start to the latest end
        (a pipeline's stage calls are its shards); training, the mean over the steps, a step being
        the shards running together (a pipeline's steps are timed by pipeline_training.py)."""
        with self._lock:
            clock = self._clock
            clock.running -= 1
            if finished is None or (self.spec.placement is not None and self.spec.kind == m.TRAINING):
                return
            if self.spec.kind != m.TRAINING:
                self.job.measured_seconds = max(self.job.measured_seconds, finished - clock.start)
            elif clock.running == 0:
                clock.steps += 1
                clock.step_seconds += finished - clock.start
                self.job.measured_seconds = clock.step_seconds / clock.steps

    def record(self, shard: ShardWork, device: JobDevice, build: Build, attempt: int) -> m.ShardRecord:
        with self._lock:
            self.ensure_records(shard.index + 1)
            record = self.job.shards[shard.index]
            record.device_id, record.target_type, record.rule = device.id, device.target_type, build.rule_name
            record.first_row, record.rows, record.attempts = shard.first_row, shard.rows, attempt
            record.predicted_seconds = self._predicted(shard.rows, device.target_type, shard.index)
            return record

    def _predicted(self, rows: int, target_type: str, index: int) -> float:
        """What the plan predicts for ``rows`` on ``target_type``: the type's fixed seconds and rate
        (a retry on another type, a training job's last, smaller step), else the planned shard's."""
        plan = self.job.plan
        if plan is None or self.spec.placement is not None:
            return 0.0
        for target in plan.targets:
            if target.target_type == target_type and target.rows_per_second > 0:
                return target.fixed_seconds + rows / target.rows_per_second
        return plan.shards[index].predicted_seconds if index < len(plan.shards) else 0.0

    def ensure_records(self, count: int) -> None:
        """The job has at least `count` shard records (callers hold the lock or run before shards do)."""
        while len(self.job.shards) < count:
            self.job.shards.append(m.ShardRecord(len(self.job.shards), "", "", "", 0, 0))

    def retried(self, attempt: Attempt, cause: str) -> None:
        shard = attempt.shard
        self.metrics.retried(attempt.device.target_type)
        with self._lock:
            if shard.index < len(self.job.shards):
                self.job.shards[shard.index].failures.append(cause)
        self.book.emit(self.job, m.SHARD_RETRIED,
                       message=f"shard {shard.index} retried on {attempt.device.id}: {cause}")

    def shards_from_feed(self, shards: Sequence[ShardWork], total: int, budget: InflightBudget) -> Iterator[ShardWork]:
        """Route the feed's row blocks into `shards` in order; yield each shard once its rows are
        complete. A shard's bytes are taken from the budget before its first rows are copied into
        its own buffers (allocated then, filled as blocks come), so the inputs waiting in memory,
        whole or half filled, stay within the budget, and no block is kept once copied."""
        current, filling, seen = 0, None, 0
        for first_row, arrays in self.feed.blocks():
            self.live.check()
            offset = 0
            rows = arrays[0].shape[0]
            while offset < rows:
                shard = shards[current]
                if filling is None:
                    nbytes = shard.rows * sum(a.dtype.itemsize * math.prod(a.shape[1:])
                                              for a in arrays)
                    budget.take(nbytes)
                    filling = [np.empty((shard.rows, *a.shape[1:]), a.dtype) for a in arrays]
                at = first_row + offset - shard.first_row
                take = min(shard.rows - at, rows - offset)
                for buffer, array in zip(filling, arrays):
                    buffer[at: at + take] = array[offset: offset + take]
                offset += take
                if at + take == shard.rows:
                    shard.inputs, shard.nbytes, filling = filling, nbytes, None
                    yield shard
                    current += 1
            seen = first_row + rows
        if seen != total:
            raise errors.InvalidArgument(f"the input blocks ended after {seen} of the {total} rows the spec declares")
