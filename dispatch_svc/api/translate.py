"""Proto <-> domain translations of the dispatch service (the request stream is read in stream_feed.py)."""

from __future__ import annotations

import dataclasses
import re

from google.protobuf import duration_pb2

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.errors import quoted
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.layer_table import layer_cost_from_proto, layer_cost_to_proto
from accelmesh.runtime.devices import PLATFORM_FROM_PROTO, PLATFORM_TO_PROTO, timestamp
from accelmesh.runtime.tensors import dtype_code_for_name, dtype_name
from dispatch_svc.admission.quotas import LIMITS, Quota, Use, check_quota
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.training_options import TrainingOptions
from dispatch_svc.planner import placement as pl

KIND_FROM_PROTO = {job_pb.JOB_KIND_UNSPECIFIED: m.INFERENCE, job_pb.JOB_KIND_INFERENCE: m.INFERENCE,
                   job_pb.JOB_KIND_TRAINING: m.TRAINING}
STATE_TO_PROTO = {
    m.PLANNING: job_pb.JOB_STATE_PLANNING, m.COMPILING: job_pb.JOB_STATE_COMPILING, m.RUNNING: job_pb.JOB_STATE_RUNNING,
    m.SUCCEEDED: job_pb.JOB_STATE_SUCCEEDED, m.FAILED: job_pb.JOB_STATE_FAILED, m.CANCELLED: job_pb.JOB_STATE_CANCELLED,
    m.QUEUED: job_pb.JOB_STATE_QUEUED,
}
STATE_FROM_PROTO = {value: state for state, value in STATE_TO_PROTO.items()}
EVENT_TO_PROTO = {
    m.PLANNED: job_pb.JOB_EVENT_TYPE_PLANNED, m.COMPILED: job_pb.JOB_EVENT_TYPE_COMPILED,
    m.SHARD_STARTED: job_pb.JOB_EVENT_TYPE_SHARD_STARTED, m.SHARD_FINISHED: job_pb.JOB_EVENT_TYPE_SHARD_FINISHED,
    m.SHARD_RETRIED: job_pb.JOB_EVENT_TYPE_SHARD_RETRIED, m.TRAINING_STEP: job_pb.JOB_EVENT_TYPE_TRAINING_STEP,
    "succeeded": job_pb.JOB_EVENT_TYPE_SUCCEEDED, "failed": job_pb.JOB_EVENT_TYPE_FAILED,
    "cancelled": job_pb.JOB_EVENT_TYPE_CANCELLED, m.TAKEN_OVER: job_pb.JOB_EVENT_TYPE_TAKEN_OVER,
    m.QUEUED_EVENT: job_pb.JOB_EVENT_TYPE_QUEUED, m.SHARD_VERIFIED: job_pb.JOB_EVENT_TYPE_SHARD_VERIFIED,
    m.INPUTS_WANTED: job_pb.JOB_EVENT_TYPE_INPUTS_WANTED,
}
KIND_TO_PROTO = {m.INFERENCE: job_pb.JOB_KIND_INFERENCE, m.TRAINING: job_pb.JOB_KIND_TRAINING}
STRATEGY_FROM_PROTO = {plan_pb.PLACEMENT_STRATEGY_RANKED: pl.RANKED, plan_pb.PLACEMENT_STRATEGY_BALANCED: pl.BALANCED,
                       plan_pb.PLACEMENT_STRATEGY_AUTO: pl.AUTO}
STRATEGY_TO_PROTO = {v: k for k, v in STRATEGY_FROM_PROTO.items()}
PRECISION_FROM_PROTO = {common_pb2.PRECISION_UNSPECIFIED: "", common_pb2.PRECISION_FP32: "fp32",
                        common_pb2.PRECISION_BF16_ALLOWED: "bf16", common_pb2.PRECISION_FP16_ALLOWED: "fp16"}
PRECISION_TO_PROTO = {v: k for k, v in PRECISION_FROM_PROTO.items()}


def spec_from_proto(msg: job_pb.JobSpec) -> m.JobSpec:
    if msg.kind not in KIND_FROM_PROTO:
        raise errors.InvalidArgument(f"spec.kind {msg.kind} is not a JobKind")
    c = msg.constraints
    for i, platform in enumerate(c.platforms):
        if platform not in PLATFORM_FROM_PROTO:
            raise errors.InvalidArgument(f"spec.constraints.platforms[{i}] is not a platform")
    if c.max_devices < 0:
        raise errors.InvalidArgument(f"spec.constraints.max_devices is {c.max_devices}; use 0 for no limit")
    if c.precision not in PRECISION_FROM_PROTO:
        raise errors.InvalidArgument(f"spec.constraints.precision {c.precision} is not a Precision; use "
                                     "PRECISION_FP32, PRECISION_BF16_ALLOWED, PRECISION_FP16_ALLOWED or leave it unset",
                                     field="spec.constraints.precision")
    if c.precision == common_pb2.PRECISION_FP16_ALLOWED and msg.kind == job_pb.JOB_KIND_TRAINING:
        # Gradients underflow fp16's range without loss scaling, which no compile rule applies.
        raise errors.InvalidArgument("spec.constraints.precision PRECISION_FP16_ALLOWED is for inference only; train "
                                     "with PRECISION_BF16_ALLOWED or PRECISION_FP32",
                                     field="spec.constraints.precision")
    inputs = []
    for i, t in enumerate(msg.inputs):
        if not t.name or not t.shape or any(d < 0 for d in t.shape):
            raise errors.InvalidArgument(f"spec.inputs[{i}]: name and a full shape (rows first, no -1) are required")
        inputs.append(m.InputDecl(t.name, dtype_name(t.dtype, f"spec.inputs[{i}].dtype"), tuple(t.shape)))
    training = None
    if msg.kind == job_pb.JOB_KIND_TRAINING:
        t = msg.training
        defaults = TrainingOptions()
        training = TrainingOptions(
            epochs=t.epochs or defaults.epochs,
            batch_size=t.batch_size or defaults.batch_size,
            learning_rate=t.learning_rate or defaults.learning_rate,
            momentum=t.momentum if msg.training.ByteSize() else defaults.momentum,
            shuffle_seed=t.shuffle_seed,
        )
    return m.JobSpec(
        program=msg.program,
        version=msg.version,
        kind=KIND_FROM_PROTO[msg.kind],
        constraints=m.Constraints(tuple(PLATFORM_FROM_PROTO[p] for p in c.platforms), tuple(c.required_capabilities),
                                  c.max_devices, c.filter, PRECISION_FROM_PROTO[c.precision]),
        inputs=tuple(inputs),
        client_parameters=msg.client_parameters,
        parameter_seed=msg.parameter_seed,
        training=training,
        name=msg.name,
        placement=placement_from_proto(msg.placement) if msg.HasField("placement") else None,
        request_id=_request_id(msg.request_id),
        priority=_priority(msg.priority),
        queue_timeout_s=_queue_timeout(msg),
        verify_fraction=_verify_fraction(msg.verify_fraction),
        data_path=_data_path(msg),
    )


DATA_PATH_FROM_PROTO = {job_pb.DATA_PATH_UNSPECIFIED: m.RELAY, job_pb.DATA_PATH_RELAY: m.RELAY,
                        job_pb.DATA_PATH_DIRECT: m.DIRECT}
DATA_PATH_TO_PROTO = {m.RELAY: job_pb.DATA_PATH_RELAY, m.DIRECT: job_pb.DATA_PATH_DIRECT}


def _data_path(msg: job_pb.JobSpec) -> str:
    path = DATA_PATH_FROM_PROTO.get(msg.data_path)
    if path is None:
        raise errors.InvalidArgument(f"spec.data_path {msg.data_path} is not a DataPath; use DATA_PATH_RELAY, "
                                     "DATA_PATH_DIRECT or leave it unset", field="spec.data_path")
    if path == m.DIRECT and (msg.kind == job_pb.JOB_KIND_TRAINING or msg.HasField("placement")):
        raise errors.InvalidArgument("spec.data_path DATA_PATH_DIRECT is for data-parallel inference jobs for now; "
                                     "run training and pipeline jobs with DATA_PATH_RELAY (or leave it unset)",
                                     field="spec.data_path")
    return path


def _verify_fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:  # NaN fails both
        raise errors.InvalidArgument(f"spec.verify_fraction is {value:g}; use 0 (the dispatcher's own fraction) to 1 "
                                     "(every shard run again on another node)", field="spec.verify_fraction")
    return value


def _priority(value: int) -> int:
    if not 0 <= value <= m.MAX_PRIORITY:
        raise errors.InvalidArgument(f"spec.priority is {value}; use 0 (the default) to {m.MAX_PRIORITY}, higher "
                                     "first", field="spec.priority")
    return value


def _queue_timeout(msg: job_pb.JobSpec) -> float | None:
    if not msg.HasField("queue_timeout"):
        return None
    timeout = msg.queue_timeout  # not ToTimedelta: a huge duration would overflow it
    seconds = timeout.seconds + timeout.nanos / 1e9
    if seconds < 0 or not 0 <= timeout.nanos < 1_000_000_000:
        raise errors.InvalidArgument(
            f"spec.queue_timeout is {seconds:g} s; use 0 s to never queue, a positive duration to wait at most that "
            "long, or leave it unset for the dispatcher's limit", field="spec.queue_timeout")
    return seconds


MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]*")


def _request_id(value: str) -> str:
    if len(value) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(value):
        raise errors.InvalidArgument(
            f"spec.request_id {quoted(value, 80)} is not an id: use at most {MAX_REQUEST_ID_CHARS} of "
            "A-Z a-z 0-9 . _ - (a UUID, say), or leave it empty")
    return value


def placement_from_proto(msg: plan_pb.PlacementOptions) -> m.PlacementSpec:
    if msg.strategy not in STRATEGY_FROM_PROTO:
        raise errors.InvalidArgument(
            f"spec.placement.strategy must be PLACEMENT_STRATEGY_RANKED, _BALANCED or _AUTO, got {msg.strategy}; "
            "leave spec.placement unset for data-parallel shards")
    weights = None
    if msg.HasField("weights"):
        weights = (msg.weights.compute, msg.weights.memory, msg.weights.bandwidth)
    return m.PlacementSpec(
        strategy=STRATEGY_FROM_PROTO[msg.strategy],
        device_count=msg.device_count,
        headroom=msg.memory_headroom if msg.HasField("memory_headroom") else None,
        weights=weights,
        micro_batch_rows=msg.micro_batch_rows,
        layers=tuple(layer_cost_from_proto(x) for x in msg.layers),
    )



def placement_spec_to_proto(spec: m.PlacementSpec) -> plan_pb.PlacementOptions:
    msg = plan_pb.PlacementOptions(
        strategy=STRATEGY_TO_PROTO[spec.strategy], device_count=spec.device_count,
        micro_batch_rows=spec.micro_batch_rows,
        layers=[layer_cost_to_proto(x) for x in spec.layers])
    if spec.headroom is not None:
        msg.memory_headroom = spec.headroom
    if spec.weights is not None:
        msg.weights.CopyFrom(inv_pb.TaskWeights(compute=spec.weights[0], memory=spec.weights[1],
                                                bandwidth=spec.weights[2]))
    return msg


def _load_to_proto(x: m.DeviceLoad) -> plan_pb.DeviceLoad:
    return plan_pb.DeviceLoad(device_id=x.device_id, target_type=x.target_type, memory_bytes=x.memory_bytes,
                              memory_capacity_bytes=x.memory_capacity_bytes, compute_seconds=x.compute_seconds,
                              transfer_seconds=x.transfer_seconds, layers=list(x.layers), score=x.score)


def placement_to_proto(p: m.PlacementPlan) -> plan_pb.Placement:
    return plan_pb.Placement(
        strategy=STRATEGY_TO_PROTO[p.strategy],
        layers=[plan_pb.LayerPlacement(layer=x.layer, order=x.order, device_id=x.device_id, target_type=x.target_type,
                                       parameter_count=x.parameter_count, memory_bytes=x.memory_bytes,
                                       compute_seconds=x.compute_seconds, stage=x.stage) for x in p.layers],
        stages=[plan_pb.StagePlan(index=x.index, device_id=x.device_id, target_type=x.target_type,
                                  first_layer=x.first_layer, layer_count=x.layer_count,
                                  compute_seconds=x.compute_seconds, transfer_seconds=x.transfer_seconds,
                                  artifact_key=x.artifact_key, rule=x.rule, replica_device_ids=list(x.replicas),
                                  micro_batch_shares=list(x.shares))
                for x in p.stages],
        devices=[_load_to_proto(x) for x in p.devices],
        predicted_step_seconds=p.predicted_step_seconds, cross_device_transfers=p.cross_device_transfers,
        device_count=p.device_count, micro_batch_rows=p.micro_batch_rows, micro_batches=p.micro_batches,
        predicted_seconds=p.predicted_seconds, lower_bound_step_seconds=p.lower_bound_step_seconds,
        lower_bound_offered_step_seconds=p.lower_bound_offered_step_seconds,
        weights=inv_pb.TaskWeights(compute=p.weights[0], memory=p.weights[1], bandwidth=p.weights[2]),
        weights_rule=p.weights_rule,
        candidates=[plan_pb.PlacementSummary(strategy=STRATEGY_TO_PROTO[c.strategy], feasible=c.feasible,
                                             predicted_step_seconds=c.predicted_step_seconds,
                                             cross_device_transfers=c.cross_device_transfers,
                                             device_count=c.device_count, error=c.error,
                                             devices=[_load_to_proto(x) for x in c.devices]) for c in p.candidates],
        explain=list(p.explain),
    )


def plan_to_proto(plan: m.Plan | None) -> plan_pb.Plan | None:
    if plan is None:
        return None
    return plan_pb.Plan(
        targets=[plan_pb.TargetPlan(target_type=t.target_type, rule=t.rule, compute_dtype=t.compute_dtype,
                                    artifact_key=t.artifact_key, device_ids=list(t.device_ids),
                                    rows_per_second=t.rows_per_second, rate_source=t.rate_source,
                                    fixed_seconds=t.fixed_seconds, rate_samples=t.rate_samples,
                                    residual_seconds=t.residual_seconds)
                 for t in plan.targets],
        shards=[plan_pb.ShardPlan(index=s.index, device_id=s.device_id, target_type=s.target_type,
                                  first_row=s.first_row, rows=s.rows, predicted_seconds=s.predicted_seconds)
                for s in plan.shards],
        predicted_seconds=plan.predicted_seconds,
        equal_split_predicted_seconds=plan.equal_split_predicted_seconds,
        placement=placement_to_proto(plan.placement) if plan.placement is not None else None,
    )


def shard_to_proto(s: m.ShardRecord) -> job_pb.ShardRecord:
    return job_pb.ShardRecord(
        index=s.index, device_id=s.device_id, target_type=s.target_type, rule=s.rule, first_row=s.first_row,
        rows=s.rows, attempts=s.attempts, failures=list(s.failures), queue_seconds=s.queue_seconds,
        load_seconds=s.load_seconds, execute_seconds=s.execute_seconds, total_seconds=s.total_seconds, done=s.done,
        predicted_seconds=s.predicted_seconds,
        verification=None if s.verification is None else _verification_to_proto(s.verification),
    )


VERIFICATION_TO_PROTO = {m.MATCHED: job_pb.VERIFICATION_OUTCOME_MATCHED,
                         m.NOT_VERIFIABLE: job_pb.VERIFICATION_OUTCOME_NOT_VERIFIABLE}


def _verification_to_proto(v: m.ShardVerification) -> job_pb.ShardVerification:
    return job_pb.ShardVerification(
        outcome=VERIFICATION_TO_PROTO.get(v.outcome, job_pb.VERIFICATION_OUTCOME_UNSPECIFIED),
        node_address=v.node_address, verifier_device_id=v.verifier_device_id,
        verifier_node_address=v.verifier_node_address, error_ratio=v.error_ratio, tolerance=v.tolerance)


def event_to_proto(e: m.Event, job_id: str) -> job_pb.JobEvent:
    msg = job_pb.JobEvent(index=e.index, type=EVENT_TO_PROTO[e.type], time=timestamp(e.time), progress=e.progress,
                          message=e.message, step=e.step, loss=e.loss, job_id=job_id)
    if e.plan is not None:
        msg.plan.CopyFrom(plan_to_proto(e.plan))
    if e.shard is not None:
        msg.shard.CopyFrom(shard_to_proto(e.shard))
    if e.queue is not None:
        msg.queue.CopyFrom(queue_to_proto(e.queue))
    return msg


def queue_to_proto(q: m.QueueStatus) -> job_pb.QueueStatus:
    return job_pb.QueueStatus(position=q.position, reason=q.reason, enqueue_time=timestamp(q.since),
                              deadline=timestamp(q.deadline))


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def spec_to_proto(spec: m.JobSpec) -> job_pb.JobSpec:
    t = spec.training
    return job_pb.JobSpec(
        program=spec.program, version=spec.version, kind=KIND_TO_PROTO[spec.kind],
        constraints=job_pb.JobConstraints(platforms=[PLATFORM_TO_PROTO[p] for p in spec.constraints.platforms],
                                          required_capabilities=list(spec.constraints.capabilities),
                                          max_devices=spec.constraints.max_devices, filter=spec.constraints.filter,
                                          precision=PRECISION_TO_PROTO[spec.constraints.precision]),
        inputs=[common_pb2.TensorHeader(name=i.name, dtype=dtype_code_for_name(i.dtype), shape=i.shape)
                for i in spec.inputs],
        client_parameters=spec.client_parameters, parameter_seed=spec.parameter_seed, name=spec.name,
        request_id=spec.request_id, priority=spec.priority, verify_fraction=spec.verify_fraction,
        data_path=DATA_PATH_TO_PROTO.get(spec.data_path, job_pb.DATA_PATH_RELAY),
        queue_timeout=None if spec.queue_timeout_s is None else _duration(spec.queue_timeout_s),
        training=job_pb.TrainingOptions(epochs=t.epochs, batch_size=t.batch_size, learning_rate=t.learning_rate,
                                        momentum=t.momentum, shuffle_seed=t.shuffle_seed) if t else None,
        placement=placement_spec_to_proto(spec.placement) if spec.placement is not None else None,
    )


def job_to_proto(job: m.JobRecord, with_shards: bool = True) -> job_pb.Job:
    """The job; `with_shards=False` (ListJobs) leaves out every list that grows with the job's
    size (shard records and plans, layer placements, losses), so a listed job is a few hundred
    bytes whatever it declared: GetJob has them."""
    msg = job_pb.Job(job_id=job.job_id, spec=spec_to_proto(job.spec), state=STATE_TO_PROTO[job.state], error=job.error,
                     progress=job.progress, create_time=timestamp(job.created), owner=job.owner,
                     measured_seconds=job.measured_seconds, verify_fraction=job.verify_fraction,
                     losses=job.losses if with_shards else [],
                     shards=[shard_to_proto(s) for s in job.shards] if with_shards else [])
    if job.plan is not None:
        plan = job.plan if with_shards else _summary(job.plan)
        msg.plan.CopyFrom(plan_to_proto(plan))
    if job.ended is not None:
        msg.end_time.CopyFrom(timestamp(job.ended))
    if job.expires is not None:
        msg.expire_time.CopyFrom(timestamp(job.expires))
    if job.queue is not None and job.state == m.QUEUED:
        msg.queue.CopyFrom(queue_to_proto(job.queue))
    return msg


def _summary(plan: m.Plan) -> m.Plan:
    placement = plan.placement
    if placement is not None:
        placement = dataclasses.replace(
            placement, layers=(), devices=tuple(dataclasses.replace(d, layers=()) for d in placement.devices),
            candidates=tuple(dataclasses.replace(c, devices=()) for c in placement.candidates))
    return dataclasses.replace(plan, shards=(), placement=placement)


def quota_from_proto(msg: pb.Quota) -> Quota:
    return check_quota(Quota(msg.tenant, *(getattr(msg, name) if msg.HasField(name) else None for name in LIMITS)))


def quota_to_proto(quota: Quota) -> pb.Quota:
    return pb.Quota(tenant=quota.tenant, **{name: getattr(quota, name) for name in LIMITS
                                            if getattr(quota, name) is not None})


def use_to_proto(use: Use) -> pb.QuotaUse:
    msg = pb.QuotaUse(tenant=use.tenant, jobs=use.jobs, devices=use.devices, memory_bytes=use.memory_bytes,
                      queued=use.queued)
    if use.quota is not None:
        msg.quota.CopyFrom(quota_to_proto(use.quota))
    return msg
