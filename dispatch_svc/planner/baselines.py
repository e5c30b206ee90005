"""Two placements the strategies are measured against (bench/placement.py): what big-model
loaders do (fill devices in order) and a contiguous split balanced by parameter count alone."""

from __future__ import annotations

from collections.abc import Sequence

from dispatch_svc.planner.layer_model import Model, capacity, evaluate, summary
from dispatch_svc.planner.placement_types import Device, Placement


def sequential_fill(model: Model, devices: Sequence[Device]) -> Placement:
    """Fill devices in the order given, layer after layer, as big-model loaders do: a device
    takes layers until the next one does not fit. Infeasible if the devices run out."""
    caps = {d.id: capacity(d, model.task) for d in devices}
    assignment: list[str] = []
    k, used = 0, 0
    for i in range(len(model)):
        need = model.need[i]
        while k < len(devices) - 1 and used + need > caps[devices[k].id]:
            k, used = k + 1, 0
        assignment.append(devices[k].id)
        used += need
    evaluation = evaluate(model, devices, assignment)
    return Placement("sequential_fill", tuple(assignment), evaluation, caps, {}, [summary("sequential_fill", evaluation)])


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
    return Placement("parameter_split", tuple(assignment), evaluation, caps, {}, [summary("parameter_split", evaluation)])

