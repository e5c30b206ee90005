"""Running a job: plan on the refreshed inventory, build per target type, reserve, stream shards,
retry, combine, release (MISSION A2, A3, A5-A7).

The runner reaches the other services only through the `Mesh` port (dispatch_svc.mesh_client
implements it over gRPC) and reads a job's inputs through an `InputFeed`, row block by row
block, so inputs are never held whole: at most `inflight_bytes` of shard inputs are in memory.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time

import numpy as np
from opentelemetry import trace

from accelmesh import errors
from accelmesh.runtime import attributes as attr
from accelmesh.programs import Program
from dispatch_svc import records as m
from dispatch_svc.device_queues import Attempt, Cancelled, CancelScope, DevicePool
from dispatch_svc.jobs import JobBook
from dispatch_svc.outputs import JobOutputs
from dispatch_svc.planner import PlannedDevice, Target, ThroughputModel, flops_per_row, plan_shards
from dispatch_svc.pipeline import PipelineMixin
from dispatch_svc.interface import (  # noqa: F401 - re-exported: the runner's types
    RESERVATION_TTL_S, ArtifactRef, Build, InputFeed, JobDevice, LiveJob, Mesh, RuleChoice, ScoredStatus, Scoring,
    ShardOutput, ShardWork,
)
from dispatch_svc.validation import check_inputs, check_parameters, check_program_kind

log = logging.getLogger(__name__)

MAX_EXECUTABLE_SIZES = 8  # distinct shard sizes worth a compiled executable each


class JobRunner(PipelineMixin):
    def __init__(self, mesh: Mesh, book: JobBook, throughput: ThroughputModel, *,
                 max_shard_bytes: int, inflight_bytes: int, tracer: trace.Tracer | None = None):
        self.mesh = mesh
        self._tracer = tracer or trace.NoOpTracer()
        self.book = book
        self.throughput = throughput
        self.max_shard_bytes = max_shard_bytes
        self.inflight_bytes = inflight_bytes
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

    # -- planning --------------------------------------------------------------------------

    def plan(self, spec: m.JobSpec) -> tuple[Program, m.Plan, list[Build], list[JobDevice]]:
        if spec.placement is not None:
            program, placed = self._place(spec)
            return program, placed.plan, [], list(placed.devices.values())
        program = self.mesh.describe_program(spec.program, spec.version)
        check_program_kind(program, spec)
        rows = check_inputs(program, spec)
        devices = self.mesh.candidate_devices(spec.constraints)
        if not devices:
            raise errors.FailedPrecondition(
                f"no device can run {program.ref}: the inventory has no healthy device matching the job's "
                f"constraints ({_describe_constraints(spec.constraints)})"
            )
        devices = self.mesh.refresh(devices)  # real-time status of exactly the candidates (A2)
        builds = self.mesh.compile(program, devices, ())
        by_type = {b.target_type: b for b in builds}
        type_of = {d: b.target_type for b in builds for d in b.device_ids}
        devices = [JobDevice(d.spec, d.node_address, type_of[d.id]) for d in devices]
        batch_rows = spec.training.batch_size if spec.kind == m.TRAINING else rows
        plan = self._split(program, spec, devices, by_type, min(batch_rows, rows))
        sizes = sorted({s.rows for s in plan.shards})
        if spec.kind == m.TRAINING and rows % batch_rows:
            sizes = sorted(set(sizes) | {count for _, count, _ in plan_rows(plan, rows % batch_rows)})
        if len(sizes) <= MAX_EXECUTABLE_SIZES:
            builds = self.mesh.compile(program, devices, sizes)  # portables come from the cache
        return program, plan, builds, devices

    def _split(self, program: Program, spec: m.JobSpec, devices: list[JobDevice], builds: dict[str, Build],
               rows: int) -> m.Plan:
        targets = {d.target_type: Target(d.target_type, d.spec.performance, builds[d.target_type].compute_dtype)
                   for d in devices}
        rates = self.throughput.rates(program.ref, list(targets.values()), flops_per_row=flops_per_row(program))
        row_bytes = sum(int(np.prod(i.shape[1:], dtype=np.int64)) * np.dtype(i.dtype).itemsize for i in spec.inputs)
        max_rows = None if spec.kind == m.TRAINING else max(1, self.max_shard_bytes // max(1, row_bytes))
        sharding = plan_shards(rows, [PlannedDevice(d.id, d.target_type, rates[d.target_type].rows_per_second)
                                      for d in devices], max_shard_rows=max_rows, exact=True)
        used = {s.device_id for s in sharding.shards}
        return m.Plan(
            targets=tuple(
                m.TargetPlan(t, builds[t].rule_name, builds[t].compute_dtype, builds[t].portable.key,
                             tuple(d.id for d in devices if d.target_type == t and d.id in used),
                             rates[t].rows_per_second, rates[t].source)
                for t in targets if any(d.target_type == t and d.id in used for d in devices)
            ),
            shards=tuple(m.ShardPlan(s.index, s.device_id, s.target_type, s.first_row, s.rows, s.predicted_seconds)
                         for s in sharding.shards),
            predicted_seconds=sharding.predicted_seconds,
            equal_split_predicted_seconds=sharding.equal_split_predicted_seconds,
        )

    # -- running ---------------------------------------------------------------------------

    def start(self, spec: m.JobSpec) -> tuple[m.JobRecord, LiveJob]:
        self.book.expire_results()  # every new job sweeps the expired ones: no extra thread needed
        job = self.book.create(spec)
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
            start = self._start_pipeline if job.spec.placement is not None else self._start_shards
            work = start(job, live, feed)
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

    def _start_shards(self, job: m.JobRecord, live: LiveJob, feed: InputFeed):
        """Data-parallel: plan shards, build per target type, reserve; returns the collecting work."""
        program, plan, builds, devices = self.plan(job.spec)
        self.book.update(job, plan=plan, state=m.COMPILING)
        self.book.emit(job, m.PLANNED, plan=plan, message=f"{len(plan.shards)} shards on {len(devices)} devices")
        self.book.emit(job, m.COMPILED, message=", ".join(f"{b.target_type}: {b.rule_name}" for b in builds))
        used = {s.device_id for s in plan.shards} if job.spec.kind == m.INFERENCE else {d.id for d in devices}
        spares = devices  # retries may go to any candidate: each type has its own build
        devices = [d for d in devices if d.id in used]
        params = self._parameters(program, job.spec, feed)
        self.mesh.reserve(job.job_id, self._claims(devices, params, plan), RESERVATION_TTL_S)
        self.book.update(job, state=m.RUNNING)
        # An inference job's parameters are the same for every shard: each worker gets them once.
        # A training step's change every step (ShardWork.params): they always travel in full.
        held = "params" if job.spec.kind == m.INFERENCE else None
        live.pool = DevicePool(spares, lambda attempt: self._execute(job, program, builds, params, attempt, held),
                               live.scope, on_retry=lambda a, cause: self._retried(job, a, cause))
        if job.spec.kind == m.TRAINING:
            return self._train(job, live, program, live.pool, feed, [v for _, v in params])
        return self._infer(job, live, program, live.pool, feed)

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

    def _parameters(self, program: Program, spec: m.JobSpec, feed: InputFeed) -> list[tuple[str, np.ndarray]]:
        if spec.client_parameters:
            given = feed.parameters()
            check_parameters(program, given)
            return given
        if not program.parameters:
            return []
        values = self.mesh.fetch_parameters(program, spec.parameter_seed)
        return [(p.name, v) for p, v in zip(program.parameters, values)]

    def _claims(self, devices, params, plan) -> list[tuple[str, int]]:
        param_bytes = sum(v.nbytes for _, v in params)
        return [(d.id, param_bytes + self.max_shard_bytes) for d in devices]

    def _execute(self, job, program, builds, params, attempt: Attempt, held: str | None = None) -> ShardOutput:
        """Run one shard; `held` prefixes the keys its parameters are held under on workers (None:
        sent in full every time)."""
        shard: ShardWork = attempt.shard
        device: JobDevice = attempt.device
        build = next(b for b in builds if b.target_type == device.target_type)
        artifact = build.executables.get(shard.rows, build.portable)
        self.book.emit(job, m.SHARD_STARTED, shard=self._record(job, shard, device, build, attempt.number),
                       message=f"shard {shard.index} on {device.id}")
        started = time.perf_counter()
        shard_params = params if shard.params is None else shard.params
        arrays = [*shard_params, *zip((i.name for i in program.inputs), shard.inputs)]
        held_keys = {name: f"{held}:{name}" for name, _ in shard_params} if held else None
        attributes = {
            attr.JOB_ID: job.job_id, attr.SHARD_INDEX: shard.index, attr.SHARD_ATTEMPT: attempt.number,
            attr.DEVICE_ID: device.id, attr.TARGET_TYPE: device.target_type, attr.RULE: build.rule_name,
            attr.ARTIFACT_KEY: artifact.key, attr.SHARD_ROWS: shard.rows,
            attr.SHARD_BYTES: sum(a.nbytes for _, a in arrays)}
        stage = getattr(shard, "stage", None)  # a pipeline stage's micro-batch (dispatch_svc.pipeline)
        if stage is not None:
            attributes[attr.PIPELINE_STAGE], attributes[attr.MICRO_BATCH] = stage.index, shard.batch.index
        with self._tracer.start_as_current_span("dispatch.shard", attributes=attributes):
            out = self.mesh.execute(job.job_id, shard.index, attempt.number, device, build, artifact, arrays,
                                    shard.rows, attempt_scope(self, job), held_keys=held_keys)
        record = self._record(job, shard, device, build, attempt.number)
        record.queue_seconds, record.load_seconds = out.queue_seconds, out.load_seconds
        record.execute_seconds, record.total_seconds = out.execute_seconds, time.perf_counter() - started
        if out.execute_seconds > 0:
            self.throughput.record(program.ref, device.target_type, shard.rows, out.execute_seconds)
        return out

    def _record(self, job, shard: ShardWork, device: JobDevice, build: Build, attempt: int) -> m.ShardRecord:
        with self._lock:
            while len(job.shards) <= shard.index:
                job.shards.append(m.ShardRecord(len(job.shards), "", "", "", 0, 0))
            record = job.shards[shard.index]
            record.device_id, record.target_type, record.rule = device.id, device.target_type, build.rule_name
            record.first_row, record.rows, record.attempts = shard.first_row, shard.rows, attempt
            return record

    def _retried(self, job, attempt: Attempt, cause: str) -> None:
        shard = attempt.shard
        with self._lock:
            if shard.index < len(job.shards):
                job.shards[shard.index].failures.append(cause)
        self.book.emit(job, m.SHARD_RETRIED, message=f"shard {shard.index} retried on {attempt.device.id}: {cause}")

    # -- inference ---------------------------------------------------------------------------

    def _infer(self, job, live: LiveJob, program: Program, pool: DevicePool, feed: InputFeed):
        plan = job.plan
        shards = [ShardWork(s.index, s.first_row, s.rows, s.device_id) for s in plan.shards]
        outputs = JobOutputs(self.book, job, live, program, shards)
        budget = threading.Condition()
        inflight = [0]
        pending = []

        def failed(error: BaseException) -> None:
            with budget:
                live.failure = live.failure or error
                budget.notify_all()

        def take(shard: ShardWork, out: ShardOutput) -> None:
            job.shards[shard.index].done = True
            outputs.take(shard, out.outputs)
            with budget:
                inflight[0] -= shard.nbytes
                budget.notify_all()
            shard.inputs = []
            self.book.emit(job, m.SHARD_FINISHED, shard=job.shards[shard.index],
                           message=f"shard {shard.index} done on {job.shards[shard.index].device_id}")

        # Results are taken on the device threads as shards finish, which frees the in-flight
        # budget while this thread is still reading input blocks.
        for shard in self._fill(shards, feed, outputs.total, budget, inflight, live):
            pending.append(pool.submit(shard, shard.device_id, on_done=lambda out, shard=shard: take(shard, out),
                                       on_error=failed))

        def work():
            for handle in pending:
                pool.wait(handle)
            outputs.close()
        return work

    def _fill(self, shards, feed: InputFeed, total: int, budget, inflight, live: LiveJob):
        """Route row blocks into shards in order; yield each shard as its rows are complete."""
        current, parts, seen = 0, [], 0
        for first_row, arrays in feed.blocks():
            live.scope.check()
            offset = 0
            rows = arrays[0].shape[0]
            while offset < rows:
                shard = shards[current]
                want = shard.first_row + shard.rows - (first_row + offset)
                take = min(want, rows - offset)
                parts.append([a[offset: offset + take] for a in arrays])
                offset += take
                if take == want:
                    shard.inputs = [np.ascontiguousarray(np.concatenate(cols)) for cols in zip(*parts)]
                    shard.nbytes = sum(a.nbytes for a in shard.inputs)
                    parts = []
                    with budget:
                        while inflight[0] and inflight[0] + shard.nbytes > self.inflight_bytes:
                            if live.failure is not None:
                                raise live.failure
                            budget.wait(0.5)
                            live.scope.check()
                        inflight[0] += shard.nbytes
                    yield shard
                    current += 1
            seen = first_row + rows
        if seen != total:
            raise errors.InvalidArgument(f"the input blocks ended after {seen} of the {total} rows the spec declares")

    # -- training ----------------------------------------------------------------------------

    def _train(self, job, live: LiveJob, program: Program, pool: DevicePool, feed: InputFeed,
               params: list[np.ndarray]):
        from dispatch_svc.training import minibatches

        rows = job.spec.inputs[0].rows
        data = [np.empty(i.shape, np.dtype(i.dtype)) for i in job.spec.inputs]
        seen = 0
        for first_row, arrays in feed.blocks():  # a training set is reused every epoch: kept whole
            for full, part in zip(data, arrays):
                full[first_row: first_row + part.shape[0]] = part
            seen = first_row + arrays[0].shape[0]
        if seen != rows:
            raise errors.InvalidArgument(f"the input blocks ended after {seen} of the {rows} rows the spec declares")
        options = job.spec.training
        optimizer = options.optimizer()
        grad_outputs = [i for i, o in enumerate(program.outputs) if o.name.startswith("grad/")]
        loss_output = next(i for i, o in enumerate(program.outputs) if o.name == "loss")
        steps = list(minibatches(rows, options.batch_size, options.epochs, options.shuffle_seed))
        names = [p.name for p in program.parameters]
        plans = {}

        def work():
            nonlocal params
            for batch in steps:
                live.scope.check()
                size = len(batch.indices)
                if size not in plans:
                    plans[size] = plan_rows(job.plan, size)
                split = plans[size]
                handles = []
                for index, (first, count, device_id) in enumerate(split):
                    idx = batch.indices[first: first + count]
                    shard = ShardWork(index, first, count, device_id, [d[idx] for d in data],
                                      params=list(zip(names, params)))
                    handles.append((shard, pool.submit(shard, device_id)))
                outs = [(s, pool.wait(h)) for s, h in handles]
                for s, _ in outs:
                    job.shards[s.index].done = True
                weights = [s.rows for s, _ in outs]
                grads = [_weighted_mean([o.outputs[i] for _, o in outs], weights) for i in grad_outputs]
                loss = float(_weighted_mean([o.outputs[loss_output] for _, o in outs], weights))
                params = optimizer.step(params, grads)
                job.losses.append(loss)
                job.progress = batch.step / len(steps)
                self.book.emit(job, m.TRAINING_STEP, step=batch.step, loss=loss, message=f"epoch {batch.epoch}")
            for spec, value in zip(program.parameters, params):
                self.book.results.save(job.job_id, spec.name, np.asarray(value, np.dtype(spec.dtype)))
            self.book.results.save(job.job_id, "losses", np.asarray(job.losses, np.float32))
        return work


def _weighted_mean(values: list[np.ndarray], weights: list[int]) -> np.ndarray:
    total = np.zeros_like(np.asarray(values[0], np.float32))
    for value, weight in zip(values, weights):
        total += np.asarray(value, np.float32) * weight
    return total / sum(weights)


def plan_rows(plan: m.Plan, rows: int) -> list[tuple[int, int, str]]:
    """Scale a plan's split of a full batch to `rows` (the last, partial mini-batch)."""
    full = sum(s.rows for s in plan.shards)
    if rows == full:
        return [(s.first_row, s.rows, s.device_id) for s in plan.shards]
    counts = [max(0, round(s.rows * rows / full)) for s in plan.shards]
    counts[int(np.argmax(counts))] += rows - sum(counts)
    out, first = [], 0
    for shard, count in zip(plan.shards, counts):
        if count > 0:
            out.append((first, count, shard.device_id))
            first += count
    return out


def attempt_scope(runner: JobRunner, job: m.JobRecord) -> CancelScope:
    live = runner.live(job.job_id)
    return live.scope if live is not None else CancelScope()


def _describe_constraints(c: m.Constraints) -> str:
    parts = [f"platforms {', '.join(c.platforms)}"] if c.platforms else []
    parts += [f"capabilities {', '.join(c.capabilities)}"] if c.capabilities else []
    parts += [f"filter {c.filter!r}"] if c.filter else []
    return "; ".join(parts) or "none"
