"""Placing a model's layers on devices (requirements B3-B6): one entry point for the strategies.

- ranked.py: the method of requirements B4-B6 (largest layers first, best task-weighted status).
- balanced.py: contiguous stages chosen by dynamic programming for the shortest step time.
- baselines.py: sequential fill and a parameter-balanced split, for comparison.
- layer_model.py: the memory and cost model they share, so predictions compare like for like.
- placement_types.py: the layer table, device, task and placement types, and their checks.
"""

from dispatch_svc.planner.balanced import MAX_SEARCH_STATES, place_balanced
from dispatch_svc.planner.baselines import parameter_split, sequential_fill
from dispatch_svc.planner.layer_model import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_FACTOR,
    DEFAULT_LINK_GBPS,
    FLOPS_PER_PARAMETER,
    PARAMETER_COPIES,
    TRAINING_IN_FLIGHT,
    WORKING_COPIES,
    WORKSPACE_COPIES,
    Model,
    capacity,
    evaluate,
    initial_scores,
    link_gbps,
    required_devices,
)
from dispatch_svc.planner.lower_bound import lower_bound_seconds
from dispatch_svc.planner.placement_types import (
    AUTO,
    BALANCED,
    DEFAULT_HEADROOM,
    DEFAULT_MICRO_BATCH_ROWS,
    INFERENCE,
    RANKED,
    STRATEGIES,
    TRAINING,
    Device,
    Evaluation,
    LayerCost,
    NoRoom,
    Placement,
    Stage,
    Task,
    check_layers,
    check_task,
)
from dispatch_svc.planner.ranked import place_ranked


def place(model: Model, devices: list[Device], asked: str = AUTO
          ) -> tuple[list[tuple[str, Placement | None, NoRoom | None]], str, Placement]:
    """The placement a job gets: `asked`'s, or for auto the faster feasible of ranked and balanced
    (balanced on a tie). Returns every strategy tried with its placement or refusal, the strategy
    taken and its placement; the smallest shortfall is raised when none fits.

    Devices with no free compute (every bit of it reserved or in use) are left out: a stage there
    would never finish (ranked would still give them layers by their memory, at an infinite step).
    Without enough of the others it is NoRoom, saying so, with no shortfall: what is missing is
    compute now, not memory, which the caller tells apart (pipeline_plan.py: the job waits)."""
    wanted = model.task.device_count
    if wanted:
        required_devices(model, devices, {})  # a count past the devices offered is the client's to change
    ready = [d for d in devices if d.peak_tflops > 0]
    if len(ready) < len(devices):
        if len(ready) < max(1, wanted):
            raise NoRoom(f"{len(devices) - len(ready)} of the {len(devices)} devices have no compute free now, "
                         f"leaving {len(ready)}" + (f" for spec.placement.device_count {wanted}" if wanted else ""),
                         shortfall_bytes=0)
    tried: list[tuple[str, Placement | None, NoRoom | None]] = []
    for strategy in ((RANKED, BALANCED) if asked == AUTO else (asked,)):
        try:
            tried.append((strategy, (place_ranked if strategy == RANKED else place_balanced)(model, ready), None))
        except NoRoom as exc:
            tried.append((strategy, None, exc))
    feasible = [(s, p) for s, p, _ in tried if p is not None and p.evaluation.feasible]
    if not feasible:
        raise min((e for _, _, e in tried if e is not None), key=lambda e: e.shortfall_bytes)
    strategy, chosen = min(feasible, key=lambda sp: (sp[1].evaluation.step_seconds, sp[0] != BALANCED))
    return tried, strategy, chosen


__all__ = [
    "AUTO", "BALANCED", "BANDWIDTH_EFFICIENCY", "COMPUTE_FACTOR", "DEFAULT_HEADROOM",
    "DEFAULT_LINK_GBPS", "DEFAULT_MICRO_BATCH_ROWS", "FLOPS_PER_PARAMETER", "INFERENCE", "MAX_SEARCH_STATES",
    "PARAMETER_COPIES", "RANKED", "STRATEGIES", "TRAINING", "Device", "Evaluation", "LayerCost", "Model", "NoRoom",
    "Placement", "Stage", "Task", "capacity", "check_layers", "check_task", "evaluate", "initial_scores",
    "link_gbps", "lower_bound_seconds", "parameter_split", "place", "place_balanced", "place_ranked",
    "required_devices", "sequential_fill", "TRAINING_IN_FLIGHT", "WORKING_COPIES", "WORKSPACE_COPIES",
]
