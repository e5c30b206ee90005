"""Data-parallel planning (requirements A2, A5): the program built once per target type, the batch
split into shards sized by what a shard costs on each device (a fixed part plus one per row, the
throughput model's fit), executables for the shard sizes.
Shard sizes come from the job's bucket ladder (dispatch_svc.planner.buckets): the rates choose
how many of each rung a device runs, never a new size, so a program's jobs of one input size
reuse the same few executables instead of compiling one per rate-driven row count.

`plan` answers PlanJob. For a job that runs, `propose` plans it and says what it claims (every
device the plan gives rows, or for training every candidate, each holding the parameters and a
shard), the admission gate reserves that, and `start` hands the job to inference or training,
which stream the shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime.beside import beside
from dispatch_svc.admission.admission import Grant
from dispatch_svc.admission.scheduling.rounds import Narrowing
from dispatch_svc.execution.strategies import direct_inference, inference, training
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.execution.strategies.verifier import ShardVerifier
from dispatch_svc.execution.verification import sample_shards
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.jobs.validation import check_inputs, check_program_kind
from dispatch_svc.planner import BUCKET_RUNGS, DeviceColumns, Target, ThroughputModel, flops_per_row, plan_shards
from dispatch_svc.ports import Build, Compiler, Inventory, JobDevice

# Distinct shard sizes one job compiles executables for (within the compile service's default
# 16 per call). A bucketed plan uses at most BUCKET_RUNGS + 1 (6), always compiled; a training job's
# last, partial mini-batch adds its sizes only while the total stays within this.
MAX_EXECUTABLE_SIZES = 8


@dataclass(frozen=True)
class Proposal:
    """A planned job, what it claims, and for a job taken over the shards that moved off devices it
    no longer has (shard index -> device)."""

    program: Program
    plan: m.Plan
    builds: list[Build]
    devices: list[JobDevice]
    claims: tuple[tuple[str, int], ...]
    given: str = ""  # what the queue's scheduling round gave the job, for its PLANNED event
    moved: dict[int, str] | None = None  # None: not a job taken over


def plan(inventory: Inventory, compiler: Compiler, throughput: ThroughputModel, limits: Limits, spec: m.JobSpec,
         keep: m.Plan | None = None,
         only: frozenset[str] | None = None) -> tuple[Program, m.Plan, list[Build], list[JobDevice]]:
    """`keep`: the plan a job taken over goes on with; executables are built for its shard sizes.
    `only`: the devices a queue's scheduling round gave the job (None: all its constraints allow);
    when none of them is a candidate any more, all its constraints allow."""
    # The program's description and the inventory's candidates are asked at once; a fault of the
    # job itself (its program, its inputs) is still the one raised when both calls fail.
    described = beside(compiler.describe_program, spec.program, spec.version)
    try:
        devices, unlisted = inventory.candidate_devices(spec.constraints), None
    except Exception as exc:  # noqa: BLE001 - raised below, after the job's own checks
        devices, unlisted = [], exc
    program = described.result()
    check_program_kind(program, spec)
    rows = check_inputs(program, spec)
    if unlisted is not None:
        raise unlisted
    if only is not None:
        devices = [d for d in devices if d.id in only] or devices
    if not devices:
        raise errors.FailedPrecondition(
            f"no device can run {program.ref}: the inventory has no healthy device matching the job's "
            f"constraints ({_describe_constraints(spec.constraints)})"
        )
    # Real-time status of exactly the candidates (A2), asked beside their builds (a build for a
    # candidate the refresh drops goes unused); its error first, as when it was asked first.
    refreshed = beside(inventory.refresh, devices)
    try:
        builds = compiler.compile(program, devices, (), spec.constraints.precision)
    finally:
        devices = refreshed.result()
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
        # portables come from the cache
        builds = compiler.compile(program, devices, sorted(sizes), spec.constraints.precision)
    return program, job_plan, builds, devices


def parameter_bytes(program: Program) -> int:
    """What the program's parameters take on a device: a client's own have these shapes too
    (validation.check_parameters refuses others)."""
    return sum(math.prod(d or 0 for d in p.shape) * np.dtype(p.dtype).itemsize for p in program.parameters)


def propose(ctx: JobContext, narrowing: Narrowing | None) -> Proposal:
    """Plan the job within what the queue's scheduling round gave it (`narrowing`), and say what
    it claims. Nothing is read from its inputs, reserved or sent."""
    job = ctx.job
    if ctx.kept is not None:
        return _resume(ctx)
    only = narrowing.device_ids if narrowing is not None else None
    program, job_plan, builds, devices = plan(ctx.inventory, ctx.compiler, ctx.throughput, ctx.limits, job.spec,
                                              only=only)
    if job.spec.data_path == m.DIRECT:  # refused before anything is reserved
        direct_inference.check_direct(program, max(ctx.limits.verify_fraction, job.spec.verify_fraction))
    narrowed = only is not None and {d.id for d in devices} <= only
    ctx.book.update(job, plan=job_plan, state=m.COMPILING)
    used = {s.device_id for s in job_plan.shards} if job.spec.kind == m.INFERENCE else {d.id for d in devices}
    claim = parameter_bytes(program) + ctx.limits.max_shard_bytes
    return Proposal(program, job_plan, builds, devices, tuple((d.id, claim) for d in devices if d.id in used),
                    given=narrowing.describe() if narrowed else "")


def start(ctx: JobContext, proposal: Proposal, grant: Grant):
    """The admitted job's events, its parameters and device pool; returns the strategy's
    collecting work. Retries may go to any candidate: each type has its own build."""
    job, program, builds = ctx.job, proposal.program, proposal.builds
    if proposal.moved is None:
        given = f" ({proposal.given})" if proposal.given else ""
        ctx.book.emit(job, m.PLANNED, plan=proposal.plan,
                      message=f"{len(proposal.plan.shards)} shards on {len(proposal.devices)} devices{given}")
    ctx.book.emit(job, m.COMPILED, message=", ".join(f"{b.target_type}: {b.rule_name}" for b in builds))
    params = ctx.parameters(program)
    training_job = job.spec.kind == m.TRAINING
    # A training step's parameters change every step (ShardWork.params): they always travel in full.
    # An inference job's parameters are the same for every shard: each worker gets them once.
    held = None if training_job else "params"
    if ctx.live.direct is not None:
        # The shards queued for a device go to its worker in groups (their descriptors in one batch).
        pool = ctx.open_pool(proposal.devices, lambda attempt: ctx.execute(program, builds, params, attempt, held=held),
                             lambda attempts: ctx.execute_group(program, builds, params, attempts, held=held))
        return direct_inference.collect(ctx, program, pool, proposal.devices)
    verifier = _verifier(ctx, proposal, params, held)

    def run(attempt):
        if verifier is not None:
            verifier.refuse(attempt)
        out = ctx.execute(program, builds, params, attempt, held=held)
        if verifier is not None:
            verifier.check(attempt, out.outputs)
        return out
    pool = ctx.open_pool(proposal.devices, run)
    if training_job:
        return training.collect(ctx, program, pool, [v for _, v in params], verifier=verifier)
    if proposal.moved is not None:
        return inference.collect(ctx, program, pool, ctx.kept, proposal.moved, verifier=verifier)
    return inference.collect(ctx, program, pool, verifier=verifier)


def _verifier(ctx: JobContext, proposal: Proposal, params, held: str | None) -> ShardVerifier | None:
    """The job's spot checks, with the larger of the dispatcher's floor and the spec's fraction
    (a training job samples the same shard indices every step); None when it samples nothing."""
    fraction = max(ctx.limits.verify_fraction, ctx.spec.verify_fraction)
    ctx.book.update(ctx.job, verify_fraction=fraction)
    sampled = sample_shards(ctx.job.job_id, len(proposal.plan.shards), fraction)
    if not sampled:
        return None
    return ShardVerifier(ctx, proposal.program, proposal.builds, proposal.devices, sampled, len(proposal.plan.shards),
                         params, held)


def _resume(ctx: JobContext) -> Proposal:
    """An inference job taken over from a dispatch replica that stopped: its plan's shards as they
    were, those finished kept, the rest run on the devices the mesh has now (a shard whose planned
    device is no longer a candidate goes to one the job would be planned on today)."""
    job = ctx.job
    program, fresh, builds, devices = plan(ctx.inventory, ctx.compiler, ctx.throughput, ctx.limits, job.spec,
                                           keep=job.plan)
    finished = ctx.kept
    have = {d.id for d in devices}
    spare = [s.device_id for s in fresh.shards] or sorted(have)
    lost = [s for s in job.plan.shards if s.device_id not in have and s.index not in finished]
    moved = {s.index: spare[k % len(spare)] for k, s in enumerate(lost)}
    used = {moved.get(s.index, s.device_id) for s in job.plan.shards if s.index not in finished}
    claim = parameter_bytes(program) + ctx.limits.max_shard_bytes
    return Proposal(program, job.plan, builds, devices, tuple((d.id, claim) for d in devices if d.id in used),
                    moved=moved)


def _split(throughput: ThroughputModel, limits: Limits, program: Program, spec: m.JobSpec,
           devices: list[JobDevice], builds: dict[str, Build], rows: int) -> m.Plan:
    # One pass over the devices each, nothing per device but the planner's own entry: a job over
    # 80,000 devices plans in tens of milliseconds (bench/scale.py).
    targets: dict[str, Target] = {}
    for d in devices:
        if d.target_type not in targets:
            targets[d.target_type] = Target(d.target_type, d.spec.performance, builds[d.target_type].compute_dtype)
    rates = throughput.rates(program.ref, list(targets.values()), flops_per_row=flops_per_row(program))
    max_rows = None if spec.kind == m.TRAINING else max(1, limits.max_shard_bytes // max(1, spec.row_bytes))
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
