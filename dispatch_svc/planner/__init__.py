"""Planning a job: how fast each device runs it (throughput), how its rows are split (sharding),
and the few row counts a split may use (buckets)."""

from dispatch_svc.planner.buckets import BUCKET_RUNGS, BucketLadder, bucket_ladder
from dispatch_svc.planner.sharding import (
    DeviceColumns,
    PlannedDevice,
    Shard,
    ShardingPlan,
    group_by_target_type,
    plan_shards,
)
from dispatch_svc.planner.throughput import CostEstimate, Target, ThroughputModel, flops_per_row

__all__ = [
    "BUCKET_RUNGS",
    "BucketLadder",
    "CostEstimate",
    "DeviceColumns",
    "PlannedDevice",
    "Shard",
    "ShardingPlan",
    "Target",
    "ThroughputModel",
    "bucket_ladder",
    "flops_per_row",
    "group_by_target_type",
    "plan_shards",
]
