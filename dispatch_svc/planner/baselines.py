"""Two placements the strategies are measured against (bench/placement.py): what big-model
loaders do (fill devices in order) and a contiguous split balanced by parameter count alone."""

from __future__ import annotations

from collections.abc import Sequence

from dispatch_svc.planner.layer_model import Model, capacity, evaluate, summary
from dispatch_svc.planner.placement_types import Device, Placement


def sequential_fill(model: Model, devices: Sequence[Device]) -> Placement:
    """Fill devices in the order given, layer after layer, as big-model loaders do: a device
    takes layers until the next one does not fit (its stage's memory, Model.stage_need).
    Infeasible if the devices run out."""
    caps = {d.id: capacity(d, model.task) for d in devices}
    assignment: list[str] = []
    k, first = 0, 0
    for i in range(len(model)):
        while k < len(devices) - 1 and model.stage_need(first, i + 1) > caps[devices[k].id]:
            k, first = k + 1, i
        assignment.append(devices[k].id)
    evaluation = evaluate(model, devices, assignment)
    return Placement("sequential_fill", tuple(assignment), evaluation, caps, {},
                     [summary("sequential_fill", evaluation)])


def parameter_split(model: Model, devices: Sequence[Device], count: int) -> Placement:
    """Contiguous stages with equal parameter counts on the first `count` devices given."""
    caps = {d.id: capacity(d, model.task) for d in devices}
    total = sum(layer.parameter_count for layer in model.layers) or 1
    assignment, seen = [], 0
    for layer in model.layers:
        stage = min(count - 1, int(count * (seen + layer.parameter_count / 2) / total))
        assignment.append(devices[stage].id)
        seen += layer.parameter_count
    evaluation = evaluate(model, devices, assignment)
    return Placement("parameter_split", tuple(assignment), evaluation, caps, {},
                     [summary("parameter_split", evaluation)])

