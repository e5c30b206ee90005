"""A job record and an event as the JSON text the job book stores (book.py), and back.

A plan's shards are stored as runs of equal, consecutive shards (a device's share is a few
sizes), so a record stays small whatever its job declared; a record written before runs, with
every shard spelled out, still reads.
"""

from __future__ import annotations

import dataclasses
import json

from dispatch_svc.jobs import records as m
from dispatch_svc.planner.placement import LayerCost


def _runs(shards: tuple[m.ShardPlan, ...]) -> list[list]:
    """Shard plans as runs [index, device_id, target_type, first_row, rows, predicted_seconds, count]
    of consecutive shards alike but for their rows' place."""
    runs: list[list] = []
    last = None
    for s in shards:
        if (last is not None and last[1] == s.device_id and last[2] == s.target_type and last[4] == s.rows
                and last[5] == s.predicted_seconds and last[0] + last[6] == s.index
                and last[3] + last[4] * last[6] == s.first_row):
            last[6] += 1
        else:
            last = [s.index, s.device_id, s.target_type, s.first_row, s.rows, s.predicted_seconds, 1]
            runs.append(last)
    return runs


def _shards_from(d: dict) -> tuple[m.ShardPlan, ...]:
    if "shards" in d:  # written before runs
        return tuple(m.ShardPlan(**s) for s in d["shards"])
    return tuple(m.ShardPlan(index + k, device, target, first + k * rows, rows, seconds)
                 for index, device, target, first, rows, seconds, count in d.get("shard_runs", ())
                 for k in range(count))


def _plan_dict(plan: m.Plan | None) -> dict | None:
    if plan is None:
        return None
    d = dataclasses.asdict(dataclasses.replace(plan, shards=()))
    del d["shards"]
    d["shard_runs"] = _runs(plan.shards)
    return d


_SHARD_FIELDS = tuple(f.name for f in dataclasses.fields(m.ShardRecord))


def _shard_dict(shard: m.ShardRecord) -> dict:
    """dataclasses.asdict of a shard record, written out: a job's record carries one per shard and
    is saved as the job changes, and asdict's generic deep copy was most of that cost."""
    d = {name: getattr(shard, name) for name in _SHARD_FIELDS}
    d["failures"] = list(shard.failures)
    if shard.verification is not None:
        d["verification"] = dataclasses.asdict(shard.verification)
    return d


def _shard_from(d: dict) -> m.ShardRecord:
    verification = d.get("verification")
    if verification is None:
        return m.ShardRecord(**d)
    return m.ShardRecord(**{**d, "verification": m.ShardVerification(**verification)})


def record_text(job: m.JobRecord) -> str:
    d = dataclasses.asdict(dataclasses.replace(job, plan=None, shards=[]))
    d["plan"] = _plan_dict(job.plan)
    d["shards"] = [_shard_dict(s) for s in job.shards]
    return json.dumps(d)


_EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(m.Event))


def event_text(event: m.Event) -> str:
    """An event as JSON: written out as `_shard_dict` is (two per shard: asdict was most of it)."""
    d = {name: getattr(event, name) for name in _EVENT_FIELDS}
    d["plan"] = _plan_dict(event.plan)
    d["shard"] = None if event.shard is None else _shard_dict(event.shard)
    d["queue"] = None if event.queue is None else dataclasses.asdict(event.queue)
    return json.dumps(d)


def _queue_from(d: dict | None) -> m.QueueStatus | None:
    return None if d is None else m.QueueStatus(**d)


def _plan_from(d: dict | None) -> m.Plan | None:
    if d is None:
        return None
    return m.Plan(
        targets=tuple(m.TargetPlan(**{**t, "device_ids": tuple(t["device_ids"])}) for t in d["targets"]),
        shards=_shards_from(d),
        predicted_seconds=d["predicted_seconds"],
        equal_split_predicted_seconds=d["equal_split_predicted_seconds"],
        placement=_placement_from(d.get("placement")),
    )


def _placement_from(d: dict | None) -> m.PlacementPlan | None:
    if d is None:
        return None
    return m.PlacementPlan(**{
        **d,
        "layers": tuple(m.LayerPlacement(**x) for x in d.get("layers", ())),
        "stages": tuple(m.StagePlan(**{**x, "replicas": tuple(x.get("replicas", ())),
                                       "shares": tuple(x.get("shares", ()))}) for x in d["stages"]),
        "devices": tuple(_load_from(x) for x in d["devices"]),
        "weights": tuple(d["weights"]),
        "candidates": tuple(m.PlacementSummary(**{**x, "devices": tuple(_load_from(y) for y in x.get("devices", ()))})
                            for x in d["candidates"]),
        "explain": tuple(d["explain"]),
    })


def _load_from(d: dict) -> m.DeviceLoad:
    return m.DeviceLoad(**{**d, "layers": tuple(d["layers"])})


def _placement_spec_from(d: dict | None) -> m.PlacementSpec | None:
    if d is None:
        return None
    return m.PlacementSpec(**{**d, "weights": tuple(d["weights"]) if d["weights"] else None,
                              "layers": tuple(LayerCost(**x) for x in d["layers"])})


def _spec_from(d: dict) -> m.JobSpec:
    return m.JobSpec(
        **{
            **d,
            "constraints": m.Constraints(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in d["constraints"].items()}),
            "inputs": tuple(m.InputDecl(i["name"], i["dtype"], tuple(i["shape"])) for i in d["inputs"]),
            "training": m.TrainingOptions(**d["training"]) if d["training"] else None,
            "placement": _placement_spec_from(d.get("placement")),
        }
    )


def record_from(d: dict) -> m.JobRecord:
    return m.JobRecord(
        **{
            **d,
            "spec": _spec_from(d["spec"]),
            "plan": _plan_from(d.get("plan")),
            "shards": [_shard_from(s) for s in d.get("shards", ())],
            "losses": list(d.get("losses", ())),
            "queue": _queue_from(d.get("queue")),
        }
    )


def event_from(d: dict) -> m.Event:
    return m.Event(**{**d, "plan": _plan_from(d["plan"]), "shard": _shard_from(d["shard"]) if d["shard"] else None,
                      "queue": _queue_from(d.get("queue"))})
