"""Placing a model's layers on devices (MISSION B3-B6): one entry point for the strategies.

- ranked.py: the method of MISSION B4-B6 (largest layers first, best task-weighted status).
- balanced.py: contiguous stages chosen by dynamic programming for the shortest step time.
- baselines.py: sequential fill and a parameter-balanced split, for comparison.
- layer_model.py: the memory and cost model they share, so predictions compare like for like.
- placement_types.py: the layer table, device, task and placement types, and their checks.
"""

from dispatch_svc.planner.balanced import MAX_SEARCH_STATES, place_balanced
from dispatch_svc.planner.baselines import parameter_split, sequential_fill
from dispatch_svc.planner.layer_model import (
    ACTIVATION_COPIES, BANDWIDTH_EFFICIENCY, COMPUTE_FACTOR, DEFAULT_LINK_GBPS, FLOPS_PER_PARAMETER, PARAMETER_COPIES,
    Model, capacity, evaluate, initial_scores, link_gbps, lower_bound_seconds, required_devices,
)
from dispatch_svc.planner.placement_types import (
    AUTO, BALANCED, DEFAULT_HEADROOM, DEFAULT_MICRO_BATCH_ROWS, INFERENCE, RANKED, STRATEGIES, TRAINING, Device,
    Evaluation, LayerCost, NoRoom, Placement, Stage, Task, check_layers, check_task,
)
from dispatch_svc.planner.ranked import place_ranked

__all__ = [
    "ACTIVATION_COPIES", "AUTO", "BALANCED", "BANDWIDTH_EFFICIENCY", "COMPUTE_FACTOR", "DEFAULT_HEADROOM",
    "DEFAULT_LINK_GBPS", "DEFAULT_MICRO_BATCH_ROWS", "FLOPS_PER_PARAMETER", "INFERENCE", "MAX_SEARCH_STATES",
    "PARAMETER_COPIES", "RANKED", "STRATEGIES", "TRAINING", "Device", "Evaluation", "LayerCost", "Model", "NoRoom",
    "Placement", "Stage", "Task", "capacity", "check_layers", "check_task", "evaluate", "initial_scores",
    "link_gbps", "lower_bound_seconds", "parameter_split", "place_balanced", "place_ranked", "required_devices",
    "sequential_fill",
]
