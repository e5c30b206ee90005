"""Planning a job: how fast each device runs it (throughput) and how its rows are split (sharding)."""

from dispatch_svc.planner.sharding import PlannedDevice, Shard, ShardingPlan, group_by_target_type, plan_shards
from dispatch_svc.planner.throughput import RateEstimate, Target, ThroughputModel, flops_per_row

__all__ = [
    "PlannedDevice",
    "RateEstimate",
    "Shard",
    "ShardingPlan",
    "Target",
    "ThroughputModel",
    "flops_per_row",
    "group_by_target_type",
    "plan_shards",
]
