"""A placed model, run as a pipeline (requirements B7): one artifact per stage built for its
device's rule, each device given only its own layers' parameters, micro-batches streamed stage
to stage through the dispatcher as soon as each stage's output is back. A replicated stage
spreads its micro-batches over its devices in proportion to the plan's shares (weighted_turns:
identical replicas take turns), each device holding the stage's parameters.

A stage's micro-batch runs through the same steps as any shard (JobContext.execute): it is
retried, recorded and traced like one, and the feed is routed within the same in-flight budget.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import numpy as np

from accelmesh import errors
from accelmesh.programs import Program
from accelmesh.runtime import attributes as attr
from dispatch_svc.admission.admission import Grant
from dispatch_svc.admission.scheduling.rounds import Narrowing
from dispatch_svc.dataplane.device_queues import Attempt, DevicePool
from dispatch_svc.execution.outputs import JobOutputs
from dispatch_svc.execution.strategies.context import InflightBudget, JobContext
from dispatch_svc.execution.strategies.pipeline_plan import PlacedJob, plan_placement
from dispatch_svc.execution.strategies.pipeline_training import TrainedStage, check_training_inputs, train
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.validation import check_inputs
from dispatch_svc.planner.calibration import StageCalibration
from dispatch_svc.planner.placement import COMPUTE_FACTOR, INFERENCE, TRAINING
from dispatch_svc.ports import Build, Compiler, Inventory, ShardOutput, ShardWork

ALL_DONE_POLL_S = 0.5  # how often the collecting thread checks for a cancel while micro-batches run


def place(inventory: Inventory, compiler: Compiler, spec: m.JobSpec, calibration: StageCalibration | None = None
          ) -> tuple[Program | None, PlacedJob]:
    """A model-parallel plan (requirements B); an explicit layer table needs no registered program."""
    if spec.placement.layers:
        program = None
        rows = spec.inputs[0].rows if spec.inputs else 0
    else:
        program = compiler.describe_program(spec.program, spec.version)
        if program.kind != "model":
            raise errors.InvalidArgument(
                f"spec.placement places a model's layers, but {program.ref} is a {program.kind}; name a model "
                "program (ListPrograms shows kind MODEL) or leave spec.placement unset for data-parallel shards")
        if spec.kind == m.TRAINING:
            if spec.training is None:
                raise errors.InvalidArgument("spec.training is required for a training job (epochs, batch_size, ...)")
            rows = check_training_inputs(program, spec)
        else:
            rows = check_inputs(program, spec)
    return program, plan_placement(inventory, compiler, spec, program, rows, calibration)


@dataclass
class Proposal:
    """A placed job, built stage by stage, and what it claims: each placed device the memory its
    layers need."""

    program: Program
    placed: PlacedJob
    plan: m.Plan
    stages: list[_Stage]
    sizes: list[int]
    per_batch: int  # micro-batches of the job (training: of one step)
    claims: tuple[tuple[str, int], ...]


class Pipeline:
    """`max_shards`: micro-batches x stages at most, each a shard record of the job."""

    def __init__(self, max_shards: int | None = None):
        self.max_shards = max_shards

    def propose(self, ctx: JobContext, narrowing: Narrowing | None = None) -> Proposal:
        """Place the layers, build one artifact per stage for its device's rule (and for training
        each stage's backward pass), and say what the placement needs on each device. A placement
        ranks every device its constraints allow: a scheduling round's narrowing is not used."""
        job, spec = ctx.job, ctx.spec
        if spec.placement.layers:
            raise errors.InvalidArgument(
                "spec.placement.layers is a table of your own for PlanJob; to run a model, leave it empty and "
                "name a registered model program")
        training = spec.kind == m.TRAINING
        program, placed = place(ctx.inventory, ctx.compiler, spec, ctx.throughput.stages)
        placement = placed.plan.placement
        rows, micro = spec.inputs[0].rows, placement.micro_batch_rows
        # a shard record per micro-batch and stage (and pass, training: reused every step)
        batch = min(rows, spec.training.batch_size) if training else rows
        per_batch = -(-batch // micro)
        shards = per_batch * len(placement.stages) * (2 if training else 1)
        if self.max_shards is not None and shards > self.max_shards:  # before anything is built or reserved
            raise errors.ResourceExhausted(
                f"the job's {placement.micro_batches:,} micro-batches through {len(placement.stages)} stages are "
                f"{shards:,} shards; this dispatcher takes at most {self.max_shards:,} (raise ACCELMESH_MAX_JOB_SHARDS "
                "to allow more, or send larger spec.placement.micro_batch_rows)")
        if ctx.live.span is not None:
            ctx.live.span.set_attribute(attr.PLACEMENT_STRATEGY, placement.strategy)
        if training:  # micro-batches of a full mini-batch, and of the last, partial one
            sizes = sorted({micro, batch % micro, rows % batch % micro, min(micro, rows % batch)} - {0})
        else:
            sizes = sorted({micro, rows % micro} - {0})
        stages = _build_stages(ctx, program, placed, sizes)
        plan = dataclasses.replace(placed.plan, placement=dataclasses.replace(placement, stages=tuple(
            dataclasses.replace(st, artifact_key=stages[st.index].builds[st.target_type].portable.key,
                                rule=stages[st.index].builds[st.target_type].rule_name)
            for st in placement.stages)))
        ctx.book.update(job, plan=plan, state=m.COMPILING)
        if training:
            _build_backward(ctx, program, placed, stages, sizes)
        return Proposal(program, placed, plan, stages, sizes, per_batch,
                        tuple((d.device_id, d.memory_bytes) for d in placement.devices))

    def start(self, ctx: JobContext, proposal: Proposal, grant: Grant):
        """The admitted job's events and device pool; returns the work that streams micro-batches through."""
        job, plan, stages, program = ctx.job, proposal.plan, proposal.stages, proposal.program
        placement, layers = plan.placement, plan.placement.layers
        ctx.book.emit(job, m.PLANNED, plan=plan, message=(
            f"{len(layers)} layers in {len(stages)} stages on {placement.device_count} "
            f"devices ({placement.strategy}), {placement.micro_batches} micro-batches of {placement.micro_batch_rows} "
            "rows"))
        ctx.book.emit(job, m.COMPILED, message=", ".join(
            f"stage {st.index} ({st.layer_count} layers from {layers[st.first_layer].layer}): "
            f"{st.target_type}: {st.rule}" for st in placement.stages))
        pool = ctx.open_pool(list(proposal.placed.devices.values()),
                             lambda attempt: _execute_stage(ctx, program, proposal.sizes, attempt))
        if ctx.spec.kind == m.TRAINING:
            ctx.book.emit(job, m.COMPILED, message=f"backward passes of {len(stages)} stages built")
            return _train(ctx, program, stages, pool, proposal.per_batch)
        params = dict(ctx.parameters(program))
        for stage in stages:  # a device receives only the parameters of its own layers
            stage.params = [(p.name, params[p.name]) for p in stage.program.parameters]
        params.clear()
        return _flow(ctx, program, stages, pool)


def _build_backward(ctx: JobContext, program: Program, placed: PlacedJob, stages: list[_Stage],
                    sizes: list[int]) -> None:
    """Placed training (pipeline_training.py): each stage's backward pass built for the types its
    forward was."""
    for stage in stages:
        for target_type in list(stage.builds):
            device = next(placed.devices[d] for d in stage.device_ids if placed.devices[d].target_type == target_type)
            stage.backward, built = ctx.compiler.compile_stage(program, [device], stage.first_layer,
                                                               stage.layer_count, sizes, backward=True,
                                                               precision=ctx.spec.constraints.precision)
            stage.backward_builds.update({b.target_type: b for b in built})


def _train(ctx: JobContext, program: Program, stages: list[_Stage], pool: DevicePool, per_step: int):
    """The steps' work of placed training. `per_step`: micro-batches of a full step."""
    count = len(stages)

    def submit(stage: _Stage, k: int, backward: bool, inputs, params, held: str, on_done, on_error) -> None:
        index = (k * count + stage.index) * 2 + int(backward)
        rows, device = inputs[0].shape[0], stage.device_for(k)
        work = _StageWork(index, 0, rows, device, inputs=inputs, params=params, stage=stage,
                          batch=ShardWork(k, 0, rows, device), backward=backward, held=f"stage{stage.index}:{held}")

        def done(out: ShardOutput) -> None:
            ctx.job.shards[index].done = True
            on_done(out)
        pool.submit(work, work.device_id, on_done=done, on_error=on_error)

    ctx.ensure_records(per_step * count * 2)
    for stage in stages:  # every step's micro-batches 0.. take the same turns
        stage.take_turns(per_step)
    trained = [TrainedStage(st.index, st.device_ids, st.program, st.backward) for st in stages]
    by_index = {st.index: st for st in stages}
    return train(ctx, program, trained, pool, ctx.parameters(program), ctx.job.plan.placement.micro_batch_rows,
                 lambda t, *rest: submit(by_index[t.index], *rest))


def _build_stages(ctx: JobContext, program: Program, placed: PlacedJob, sizes: list[int]) -> list[_Stage]:
    """One build per (layer range, target type): stages on devices of one type share it."""
    stages: list[_Stage] = []
    builds: dict[tuple[int, int], tuple[Program, dict[str, Build]]] = {}
    for st in placed.plan.placement.stages:
        key = (st.first_layer, st.layer_count)
        device = placed.devices[st.device_id]
        stage_program, by_type = builds.get(key, (None, {}))
        if device.target_type not in by_type:
            stage_program, built = ctx.compiler.compile_stage(program, [device], st.first_layer, st.layer_count, sizes,
                                                          precision=ctx.spec.constraints.precision)
            by_type.update({b.target_type: b for b in built})
            builds[key] = (stage_program, by_type)
        stages.append(_Stage(st.index, st.device_ids, st.first_layer, st.layer_count, stage_program, by_type,
                             shares=st.shares, catalog_seconds={d: placed.catalog_seconds.get((st.index, d), 0.0)
                                                                for d in st.device_ids},
                             planned_seconds=st.compute_seconds))
    return stages


def _execute_stage(ctx: JobContext, program: Program, sizes: list[int], attempt: Attempt) -> ShardOutput:
    """Run one micro-batch through one stage; a retry on a device of another target type
    builds the stage for that type first (the compile service caches it)."""
    work: _StageWork = attempt.shard
    stage = work.stage
    builds = stage.backward_builds if work.backward else stage.builds
    build = builds.get(attempt.device.target_type)
    if build is None:
        _, built = ctx.compiler.compile_stage(program, [attempt.device], stage.first_layer, stage.layer_count, sizes,
                                          backward=work.backward, precision=ctx.spec.constraints.precision)
        build = builds.setdefault(attempt.device.target_type, built[0])
    # A stage's parameters serve every micro-batch: its worker gets them once, then by key.
    ran = stage.backward if work.backward else stage.program
    out = ctx.execute(ran, [build], None, attempt, held=work.held or f"stage{stage.index}",
                      span_attributes={attr.PIPELINE_STAGE: stage.index, attr.MICRO_BATCH: work.batch.index})
    record = ctx.job.shards[work.index]
    record.predicted_seconds = stage.call_seconds(attempt.device.id, work.backward, ctx.spec.kind == m.TRAINING)
    predicted = stage.catalog_seconds.get(attempt.device.id, 0.0)
    calibration = ctx.throughput.stages
    if calibration is not None and predicted > 0 and not work.backward and ctx.spec.kind != m.TRAINING:
        micro = ctx.job.plan.placement.micro_batch_rows
        calibration.record(attempt.device.target_type, predicted * work.rows / micro, out.execute_seconds,
                           record.own_seconds)  # what calibrates the next plans
    return out


def _flow(ctx: JobContext, program: Program, stages: list[_Stage], pool: DevicePool):
    """Micro-batches flow stage to stage through the dispatcher: each stage's output is the
    next stage's input, as soon as it is back; micro-batches overlap across devices."""
    job, live = ctx.job, ctx.live
    placement = job.plan.placement
    micro, total = placement.micro_batch_rows, job.spec.inputs[0].rows
    batches = [ShardWork(k, first, min(micro, total - first), stages[0].device_ids[0])
               for k, first in enumerate(range(0, total, micro))]
    for stage in stages:
        stage.take_turns(len(batches))
    outputs = JobOutputs(ctx.book, job, live, program, batches)
    budget = InflightBudget(ctx.limits.inflight_bytes, live)
    all_done = threading.Event()
    ctx.ensure_records(len(batches) * len(stages))

    def failed(error: BaseException) -> None:
        budget.fail(error)
        all_done.set()

    def submit(batch: ShardWork, s: int, x: list[np.ndarray]) -> None:
        work = _StageWork(batch.index * len(stages) + s, batch.first_row, batch.rows, stages[s].device_for(batch.index),
                          inputs=x, params=stages[s].params, stage=stages[s], batch=batch)
        pool.submit(work, work.device_id, on_done=lambda out: advanced(work, out), on_error=failed)

    def advanced(work: _StageWork, out: ShardOutput) -> None:
        job.shards[work.index].done = True
        s = work.stage.index
        if s + 1 < len(stages):
            submit(work.batch, s + 1, [out.outputs[0]])
            return
        batch = work.batch
        done = outputs.take(batch, out.outputs)
        budget.give(batch.nbytes)
        ctx.book.emit(job, m.SHARD_FINISHED, shard=job.shards[work.index],
                      message=f"micro-batch {batch.index} through all {len(stages)} stages")
        if done == len(batches):
            all_done.set()

    for batch in ctx.shards_from_feed(batches, total, budget):
        submit(batch, 0, batch.inputs)
        batch.inputs = []

    def work():
        while not all_done.wait(ALL_DONE_POLL_S):
            live.scope.check()
        if live.failure is not None:
            raise live.failure
        outputs.close()
    return work


@dataclass
class _Stage:
    """A pipeline stage as it runs: its devices (replicas after the first), its program, its
    builds by target type, its parameters."""

    index: int
    device_ids: tuple[str, ...]
    first_layer: int
    layer_count: int
    program: Program
    builds: dict[str, Build]
    params: list[tuple[str, np.ndarray]] = field(default_factory=list)
    backward: Program | None = None  # training: the stage's backward pass, and its builds
    backward_builds: dict[str, Build] = field(default_factory=dict)
    shares: tuple[float, ...] = ()  # of the micro-batches per device of device_ids (empty: one device)
    catalog_seconds: dict[str, float] = field(default_factory=dict)  # PlacedJob.catalog_seconds, by device
    turns: list[int] = field(default_factory=list)  # the device index of each micro-batch
    planned_seconds: float = 0.0  # the plan's seconds per micro-batch on the first device (StagePlan.compute_seconds)

    def call_seconds(self, device_id: str, backward: bool, training: bool) -> float:
        """What the plan predicts for one call of this stage on `device_id`: the planned seconds
        per micro-batch, scaled to the device by the catalog's figures (a replica of another type),
        and for training split as the cost model's factor is (COMPUTE_FACTOR: the forward call one
        forward of them, the backward call, which runs the forward again, the rest)."""
        first, here = self.catalog_seconds.get(self.device_ids[0], 0.0), self.catalog_seconds.get(device_id, 0.0)
        seconds = self.planned_seconds * (here / first if first > 0 and here > 0 else 1.0)
        if training:
            forward = COMPUTE_FACTOR[INFERENCE] / COMPUTE_FACTOR[TRAINING]
            seconds *= 1.0 - forward if backward else forward
        return seconds

    def take_turns(self, count: int) -> None:
        self.turns = weighted_turns(self.shares or (1.0,) * len(self.device_ids), count)

    def device_for(self, micro_batch: int) -> str:
        return self.device_ids[self.turns[micro_batch]]


def weighted_turns(shares: tuple[float, ...], count: int) -> list[int]:
    """Which of the devices takes each of `count` micro-batches, in proportion to `shares`, as
    evenly spread as can be (smooth weighted round robin: each turn every device gains its share,
    the one furthest ahead takes the micro-batch and gives back the whole); equal shares take
    turns in order."""
    credit = [0.0] * len(shares)
    total = sum(shares)
    out = []
    for _ in range(count):
        credit = [c + w for c, w in zip(credit, shares)]
        chosen = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[chosen] -= total
        out.append(chosen)
    return out


@dataclass
class _StageWork(ShardWork):
    """One micro-batch at one stage."""

    stage: _Stage | None = None
    batch: ShardWork | None = None
    backward: bool = False  # training: the stage's backward pass
    held: str = ""  # the key prefix its parameters are held under ("" : the stage's)
