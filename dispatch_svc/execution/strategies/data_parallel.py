"""Data-parallel planning (MISSION A2, A5): the program built once per target type, the batch
split into shards sized by what a shard costs on each device (a fixed part plus one per row, the
throughput model's fit), executables for the shard sizes.
Shard sizes come from the job's bucket ladder (dispatch_svc.planner.buckets): the rates choose
how many of each rung a device runs, never a new size, so a program's jobs of one input size
reuse the same few executables instead of compiling one per rate-driven row count.

`plan` answers PlanJob as well as SubmitJob; `start` then reserves the devices and hands the
job to its strategy (inference or training), which streams the shards.
"""

from __future__ import annotations

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from dispatch_svc.jobs import records as m
from dispatch_svc.ports import Build, JobDevice, Mesh
from dispatch_svc.planner import BUCKET_RUNGS, DeviceColumns, Target, ThroughputModel, flops_per_row, plan_shards
from dispatch_svc.execution.strategies import inference, training
from dispatch_svc.execution.strategies.context import JobContext, Limits
from dispatch_svc.jobs.validation import check_inputs, check_program_kind

# Distinct shard sizes one job compiles executables for (within the compile service's default
# 16 per call). A bucketed plan uses at most BUCKET_RUNGS + 1 (6), always compiled; a training job's
# last, partial mini-batch adds its sizes only while the total stays within this.
MAX_EXECUTABLE_SIZES = 8


def plan(mesh: Mesh, throughput: ThroughputModel, limits: Limits, spec: m.JobSpec,
         keep: m.Plan | None = None,
         only: frozenset[str] | None = None) -> tuple[Program, m.Plan, list[Build], list[JobDevice]]:
    """`keep`: the plan a job taken over goes on with; executables are built for its shard sizes.
    `only`: the devices a queue's scheduling round gave the job (None: all its constraints allow)."""
    program = mesh.describe_program(spec.program, spec.version)
    check_program_kind(program, spec)
    rows = check_inputs(program, spec)
    devices = mesh.candidate_devices(spec.constraints)
    if only is not None:
        devices = [d for d in devices if d.id in only]
    if not devices:
        raise errors.FailedPrecondition(
            f"no device can run {program.ref}: the inventory has no healthy device matching the job's "
            f"constraints ({_describe_constraints(spec.constraints)})"
        )
    devices = mesh.refresh(devices)  # real-time status of exactly the candidates (A2)
    builds = mesh.compile(program, devices, (), spec.constraints.precision)
    by_type = {b.target_type: b for b in builds}
    type_of = {d: b.target_type for b in builds for d in b.device_ids}
    devices = [JobDevice(d.spec, d.node_address, type_of[d.id]) for d in devices]
    batch_rows = spec.training.batch_size if spec.kind == m.TRAINING else rows
    job_plan = _split(throughput, limits, program, spec, devices, by_type, min(batch_rows, rows))
    sizes = {s.rows for s in (keep or job_plan).shards}  # the ladder's: at most BUCKET_RUNGS + 1
    if spec.kind == m.TRAINING and rows % batch_rows:
        last = {count for _, count, _ in training.plan_rows(job_plan, rows % batch_rows)}
        if len(sizes | last) <= MAX_EXECUTABLE_SIZES:  # else the last mini-batch of an epoch runs portable
            sizes |= last
    if len(sizes) <= MAX_EXECUTABLE_SIZES:
        builds = mesh.compile(program, devices, sorted(sizes), spec.constraints.precision)  # portables come from the cache
    return program, job_plan, builds, devices


def start(ctx: JobContext):
    """Plan shards, build per target type, reserve; returns the strategy's collecting work."""
    job = ctx.job
    if ctx.kept is not None:
        return _resume(ctx)
    try:
        program, job_plan, builds, devices = plan(ctx.mesh, ctx.throughput, ctx.limits, job.spec,
                                                  only=ctx.narrowing.device_ids if ctx.narrowing else None)
    except errors.FailedPrecondition:
        if ctx.narrowing is None:
            raise
        # The devices the queue's round gave it went meanwhile: it plans on all its constraints allow.
        ctx.narrowing = None
        program, job_plan, builds, devices = plan(ctx.mesh, ctx.throughput, ctx.limits, job.spec)
    ctx.book.update(job, plan=job_plan, state=m.COMPILING)
    given = f" ({ctx.narrowing.describe()})" if ctx.narrowing is not None else ""
    ctx.book.emit(job, m.PLANNED, plan=job_plan,
                  message=f"{len(job_plan.shards)} shards on {len(devices)} devices{given}")
    ctx.book.emit(job, m.COMPILED, message=", ".join(f"{b.target_type}: {b.rule_name}" for b in builds))
    used = {s.device_id for s in job_plan.shards} if job.spec.kind == m.INFERENCE else {d.id for d in devices}
    spares = devices  # retries may go to any candidate: each type has its own build
    params = ctx.parameters(program)
    param_bytes = sum(v.nbytes for _, v in params)
    ctx.reserve([(d.id, param_bytes + ctx.limits.max_shard_bytes) for d in devices if d.id in used])
    if job.spec.kind == m.TRAINING:
        # A training step's parameters change every step (ShardWork.params): they always travel in full.
        pool = ctx.open_pool(spares, lambda attempt: ctx.execute(program, builds, params, attempt))
        return training.collect(ctx, program, pool, [v for _, v in params])
    # An inference job's parameters are the same for every shard: each worker gets them once.
    pool = ctx.open_pool(spares, lambda attempt: ctx.execute(program, builds, params, attempt, held="params"))
    return inference.collect(ctx, program, pool)


def _resume(ctx: JobContext):
    """An inference job taken over from a dispatch replica that stopped: its plan's shards as they
    were, those finished kept, the rest run on the devices the mesh has now (a shard whose planned
    device is no longer a candidate goes to one the job would be planned on today)."""
    job = ctx.job
    program, fresh, builds, devices = plan(ctx.mesh, ctx.throughput, ctx.limits, job.spec, keep=job.plan)
    finished = ctx.kept
    have = {d.id for d in devices}
    spare = [s.device_id for s in fresh.shards] or sorted(have)
    lost = [s for s in job.plan.shards if s.device_id not in have and s.index not in finished]
    moved = {s.index: spare[k % len(spare)] for k, s in enumerate(lost)}
    used = {moved.get(s.index, s.device_id) for s in job.plan.shards if s.index not in finished}
    ctx.book.emit(job, m.COMPILED, message=", ".join(f"{b.target_type}: {b.rule_name}" for b in builds))
    params = ctx.parameters(program)
    param_bytes = sum(v.nbytes for _, v in params)
    ctx.reserve([(d.id, param_bytes + ctx.limits.max_shard_bytes) for d in devices if d.id in used])
    pool = ctx.open_pool(devices, lambda attempt: ctx.execute(program, builds, params, attempt, held="params"))
    return inference.collect(ctx, program, pool, finished, moved)


def _split(throughput: ThroughputModel, limits: Limits, program: Program, spec: m.JobSpec,
           devices: list[JobDevice], builds: dict[str, Build], rows: int) -> m.Plan:
    # One pass over the devices each, nothing per device but the planner's own entry: a job over
    # 80,000 devices plans in tens of milliseconds (bench/scale.py).
    targets: dict[str, Target] = {}
    for d in devices:
        if d.target_type not in targets:
            targets[d.target_type] = Target(d.target_type, d.spec.performance, builds[d.target_type].compute_dtype)
    rates = throughput.rates(program.ref, list(targets.values()), flops_per_row=flops_per_row(program))
    row_bytes = sum(int(np.prod(i.shape[1:], dtype=np.int64)) * np.dtype(i.dtype).itemsize for i in spec.inputs)
    max_rows = None if spec.kind == m.TRAINING else max(1, limits.max_shard_bytes // max(1, row_bytes))
    speed = {t: rate.rows_per_second for t, rate in rates.items()}
    fixed = {t: rate.fixed_seconds for t, rate in rates.items()}
    types = [d.target_type for d in devices]
    pool = DeviceColumns([d.spec.id for d in devices], types, [speed[t] for t in types], [fixed[t] for t in types])
    sharding = plan_shards(rows, pool, max_shard_rows=max_rows, exact=True, bucket_rungs=BUCKET_RUNGS)
    used = {s.device_id for s in sharding.shards}
    used_by_type: dict[str, list[str]] = {}  # in the devices' order, as the plan lists them
    for d in devices:
        if d.spec.id in used:
            used_by_type.setdefault(d.target_type, []).append(d.spec.id)
    return m.Plan(
        targets=tuple(
            m.TargetPlan(t, builds[t].rule_name, builds[t].compute_dtype, builds[t].portable.key,
                         tuple(used_by_type[t]), rates[t].rows_per_second, rates[t].source, rates[t].fixed_seconds,
                         rates[t].samples, rates[t].residual_seconds)
            for t in targets if t in used_by_type
        ),
        shards=tuple(m.ShardPlan(s.index, s.device_id, s.target_type, s.first_row, s.rows, s.predicted_seconds)
                     for s in sharding.shards),
        predicted_seconds=sharding.predicted_seconds,
        equal_split_predicted_seconds=sharding.equal_split_predicted_seconds,
    )


def _describe_constraints(c: m.Constraints) -> str:
    parts = [f"platforms {', '.join(c.platforms)}"] if c.platforms else []
    parts += [f"capabilities {', '.join(c.capabilities)}"] if c.capabilities else []
    parts += [f"filter {c.filter!r}"] if c.filter else []
    return "; ".join(parts) or "none"
