"""Planning a model-parallel job (requirements B): the layer table, the devices' status and the
task's weights from the inventory, the rule each device gets, the placement, the plan.

The weights come from the inventory's ScoreDevices (one definition, B2): the layer table gives
the task's arithmetic intensity (FLOPs over memory traffic at the job's micro-batch), which the
inventory's rule turns into weights unless the client gave its own. Statuses (B1) are the
inventory's (free memory, utilisation, reservations), except that each device's compute is its
datasheet rate at the dtype its own compile rule computes in (bf16 on an A100, fp32 on a V100),
which one ScoreDevices precision cannot express; scores combine them with the inventory's
formula (accelmesh.scoring).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from accelmesh import errors
from accelmesh.programs import Program, layer_cost_fields
from accelmesh.scoring import Weights, free_status
from dispatch_svc.admission.admission import NoCapacityNow
from dispatch_svc.jobs import records as m
from dispatch_svc.planner import placement as pl
from dispatch_svc.planner.calibration import StageCalibration
from dispatch_svc.ports import Compiler, Inventory, JobDevice, RuleChoice, Scoring


@dataclass
class PlacedJob:
    plan: m.Plan
    devices: dict[str, JobDevice]  # the devices the placement uses, with their target types
    rules: dict[str, RuleChoice]  # by device id
    layers: tuple[pl.LayerCost, ...]
    # (stage, device) -> the layer model's compute for one micro-batch before any calibration:
    # what a finished stage call is measured against (calibration.py)
    catalog_seconds: dict[tuple[int, str], float] = field(default_factory=dict)


def layer_costs(program: Program) -> tuple[pl.LayerCost, ...]:
    return tuple(pl.LayerCost(**layer_cost_fields(x)) for x in program.layers)


def plan_placement(inventory: Inventory, compiler: Compiler, spec: m.JobSpec, program: Program | None, rows: int,
                   calibration: StageCalibration | None = None) -> PlacedJob:
    """Place the model of `spec` on the healthy devices matching its constraints; raises
    InvalidArgument for a bad table or options, ResourceExhausted (with the shortfall) when no
    device set holds it, NoCapacityNow when one would once other jobs let go of it (_refusal).
    One function because it is a pipeline of plain steps (the layer table, the devices, their
    scores, the placement, its summary), each a few lines reading the last."""
    options = spec.placement
    if options.layers:
        layers = options.layers
        pl.check_layers(layers)
    else:
        if not program.layers:
            raise errors.InvalidArgument(
                f"program {program.ref} has no layer table, so its layers cannot be placed; use a model program "
                "(ListPrograms shows kind MODEL) or send spec.placement.layers to plan a table of your own")
        layers = layer_costs(program)
        pl.check_layers(layers, f"the layer table of {program.ref}")
    micro = options.micro_batch_rows or max(
        1, min(rows, pl.DEFAULT_MICRO_BATCH_ROWS) if rows else pl.DEFAULT_MICRO_BATCH_ROWS)
    headroom = pl.DEFAULT_HEADROOM if options.headroom is None else options.headroom
    # training: the micro-batches of one optimizer step, over which replicated stages exchange gradients
    steps = math.ceil(spec.training.batch_size / micro) if spec.kind == m.TRAINING and spec.training else 0
    draft = pl.Task(spec.kind, micro, headroom, options.device_count, step_micro_batches=steps)
    intensity = pl.Model(layers, draft).intensity()  # also checks the options
    if options.weights is not None:
        Weights(*options.weights)  # refuses negative or all-zero weights before any call

    devices = inventory.candidate_devices(spec.constraints)
    if not devices:
        raise errors.FailedPrecondition("no healthy device matches the job's constraints, so there is nothing to place "
                                        "the model on")
    devices = inventory.refresh(devices)
    rules = _rules(compiler, devices, spec.constraints.precision)
    precision = Counter(r.compute_dtype for r in rules.values()).most_common(1)[0][0]
    scoring = inventory.score_devices(spec.kind, precision, intensity or 1.0, options.weights, spec.constraints,
                                 [d.id for d in devices])  # the devices just refreshed, not a new search
    devices = [dataclasses.replace(d, target_type=rules[d.id].target_type) for d in devices if d.id in scoring.devices]
    if not devices:
        raise errors.FailedPrecondition("the inventory scored none of the refreshed devices; retry the job")
    catalog = [_candidate(d, scoring, rules[d.id]) for d in devices]
    candidates, calibrated = _calibrated(catalog, calibration)
    task = pl.Task(spec.kind, micro, headroom, options.device_count, Weights(*scoring.weights), steps)
    model = pl.Model(layers, task)

    try:
        tried, strategy, chosen = pl.place(model, candidates, options.strategy)
    except pl.NoRoom as now:
        raise _refusal(model, devices, rules, scoring, options.strategy, now) from None
    by_id = {d.id: d for d in devices}
    summaries = tuple(
        m.PlacementSummary(s, True, p.evaluation.step_seconds, p.evaluation.cross_transfers, len(p.devices),
                           devices=_loads(model, p, by_id, scoring))
        if p is not None else m.PlacementSummary(s, False, error=str(e))
        for s, p, e in tried)
    explain = calibrated + list(chosen.explain)
    if options.strategy == pl.AUTO:
        explain.append(f"auto: took {strategy} (" + "; ".join(
            f"{x.strategy} {x.predicted_step_seconds * 1e3:.3f} ms" if x.feasible else f"{x.strategy} infeasible"
            for x in summaries) + ")")
    total_rows = rows or micro
    placement = _placement_plan(model, chosen, strategy, by_id, rules, candidates, summaries, explain,
                                math.ceil(total_rows / micro), scoring)
    used = {d: by_id[d] for d in chosen.devices}
    types = list(dict.fromkeys(by_id[d].target_type for d in chosen.devices))
    rows_per_second = micro / placement.predicted_step_seconds if placement.predicted_step_seconds > 0 else 0.0
    plan = m.Plan(
        targets=tuple(m.TargetPlan(t, rules[_first(used, t)].rule_name, rules[_first(used, t)].compute_dtype, "",
                                   tuple(d for d in used if used[d].target_type == t), rows_per_second, "catalog")
                      for t in types),
        shards=(), predicted_seconds=_job_seconds(placement, steps), equal_split_predicted_seconds=0.0,
        placement=placement)
    by_catalog = {c.id: c for c in catalog}
    seconds = {(st.index, d): sum(model.compute_seconds(i, by_catalog[d])
                                  for i in range(st.first_layer, st.first_layer + st.layer_count))
               for st in chosen.evaluation.stages for d in st.device_ids}
    return PlacedJob(plan, used, rules, tuple(model.layers), seconds)


def _refusal(model: pl.Model, devices: list[JobDevice], rules: dict[str, RuleChoice], scoring: Scoring,
             strategy: str, now: pl.NoRoom) -> errors.ResourceExhausted:
    """What a placement refused on the devices' status now (`now`) means for the job. A model that
    fits the same devices with nothing else on them (each one's whole memory, its peak rate at its
    rule's dtype) lacks only what other jobs hold now, its compute or its memory: NoCapacityNow,
    which the admission gate turns into a place in the queue, as it does a refused reservation, so
    the job runs once they let go. One that does not fit even so can never run there: refused for
    good, with the reason on the free devices (a layer or a model too big for them)."""
    free = []
    for d in devices:
        perf = d.spec.performance
        free.append(pl.Device(id=d.id, target_type=d.target_type,
                              peak_tflops=perf.rate_tflops(rules[d.id].compute_dtype),
                              memory_free_bytes=max(perf.memory_bytes, scoring.devices[d.id].memory_free_bytes),
                              memory_bandwidth_gbps=perf.memory_bandwidth_gbps,
                              link_gbps=perf.interconnect_bandwidth_gbps))
    try:
        pl.place(model, free, strategy)
    except pl.NoRoom as never:
        return never
    return NoCapacityNow(f"{now}; the model fits these devices once other jobs let go of what they hold")


def _calibrated(catalog: list[pl.Device], calibration: StageCalibration | None) -> tuple[list[pl.Device], list[str]]:
    """Each device as its type's finished stage calls measured it (calibration.py): its peak rate
    and bandwidth over the measured slowdown, each stage call's overhead charged; and a line per
    calibrated type for the explanation."""
    if calibration is None:
        return catalog, []
    out, lines = [], {}
    for device in catalog:
        measured = calibration.get(device.target_type)
        if measured is None:
            out.append(device)
            continue
        out.append(dataclasses.replace(device, peak_tflops=device.peak_tflops / measured.slowdown,
                                       memory_bandwidth_gbps=device.memory_bandwidth_gbps / measured.slowdown,
                                       stage_overhead_s=measured.overhead_seconds))
        lines[device.target_type] = (
            f"calibrated: {device.target_type} from {measured.samples} stage call(s): compute {measured.slowdown:.3g}x "
            f"the catalog's prediction, {measured.overhead_seconds * 1e3:.3f} ms a stage call beyond it")
    return out, list(lines.values())


def _job_seconds(placement: m.PlacementPlan, step_micro_batches: int) -> float:
    """The job's predicted seconds: all its micro-batches (the pipeline filled once, then one step
    each); training, one optimizer step's (its micro-batches through and back, as the trainer
    runs a step), as a data-parallel training job's is."""
    if not step_micro_batches:
        return placement.predicted_seconds
    fill = placement.predicted_seconds - max(0, placement.micro_batches - 1) * placement.predicted_step_seconds
    return fill + max(0, step_micro_batches - 1) * placement.predicted_step_seconds


def _rules(compiler: Compiler, devices: list[JobDevice], precision: str) -> dict[str, RuleChoice]:
    """The compile rule of every device under the job's precision, asking once per kind of device."""
    by_kind: dict[tuple, RuleChoice] = {}
    out = {}
    for d in devices:
        key = (d.spec.type, d.spec.platform, d.spec.capabilities, d.spec.compute_capability, d.spec.execution_platform)
        if key not in by_kind:
            by_kind[key] = compiler.explain_rule(d, precision)
        out[d.id] = by_kind[key]
    return out


def _candidate(device: JobDevice, scoring: Scoring, rule: RuleChoice) -> pl.Device:
    scored = scoring.devices[device.id]
    perf = device.spec.performance
    # The inventory's status, with compute at the dtype this device's rule computes in.
    status = free_status(perf.rate_tflops(rule.compute_dtype), perf.memory_bandwidth_gbps, scored.memory_free_bytes,
                         scored.utilization, scored.reserved_compute_fraction)
    return pl.Device(id=device.id, target_type=device.target_type, peak_tflops=status.compute_tflops,
                     memory_free_bytes=status.memory_free_bytes, memory_bandwidth_gbps=status.bandwidth_gbps,
                     link_gbps=perf.interconnect_bandwidth_gbps)


def _placement_plan(model: pl.Model, chosen: pl.Placement, strategy: str, by_id: dict[str, JobDevice],
                    rules: dict[str, RuleChoice], candidates: list[pl.Device], summaries, explain: list[str],
                    micro_batches: int, scoring: Scoring) -> m.PlacementPlan:
    ev = chosen.evaluation
    stage_of = {}
    for stage in ev.stages:
        for i in range(stage.first_layer, stage.first_layer + stage.layer_count):
            stage_of[i] = stage.index
    used = chosen.devices
    return m.PlacementPlan(
        strategy=strategy,
        layers=tuple(m.LayerPlacement(layer.name, layer.order, chosen.assignment[i],
                                      by_id[chosen.assignment[i]].target_type, layer.parameter_count,
                                      ev.layer_memory[i], ev.layer_seconds[i], stage_of[i])
                     for i, layer in enumerate(model.layers)),
        stages=tuple(m.StagePlan(s.index, s.device_id, by_id[s.device_id].target_type, s.first_layer, s.layer_count,
                                 s.compute_seconds, s.transfer_seconds, "", rules[s.device_id].rule_name, s.replicas,
                                 s.shares)
                     for s in ev.stages),
        devices=_loads(model, chosen, by_id, scoring),
        predicted_step_seconds=ev.step_seconds,
        cross_device_transfers=ev.cross_transfers,
        device_count=len(used),
        micro_batch_rows=model.task.micro_batch_rows,
        micro_batches=micro_batches,
        predicted_seconds=ev.predicted_seconds(micro_batches),
        lower_bound_step_seconds=pl.lower_bound_seconds(model, [c for c in candidates if c.id in used]),
        weights=scoring.weights,
        weights_rule=scoring.rule,
        candidates=summaries,
        explain=tuple(explain),
        lower_bound_offered_step_seconds=pl.lower_bound_seconds(model, candidates),
    )


def _loads(model: pl.Model, placement: pl.Placement, by_id: dict[str, JobDevice], scoring: Scoring
           ) -> tuple[m.DeviceLoad, ...]:
    ev = placement.evaluation
    held: dict[str, list[str]] = {}
    for i, device in enumerate(placement.assignment):
        for d in (device, *placement.replicas.get(device, ())):  # a replica holds its original's layers
            held.setdefault(d, []).append(model.layers[i].name)
    return tuple(m.DeviceLoad(d, by_id[d].target_type, ev.memory_bytes[d], placement.capacity_bytes[d],
                              ev.compute_seconds[d], ev.transfer_seconds[d], tuple(held[d]),
                              placement.scores.get(d, scoring.devices[d].score))
                 for d in placement.devices)


def _first(used: dict[str, JobDevice], target_type: str) -> str:
    return next(d for d in used if used[d].target_type == target_type)
