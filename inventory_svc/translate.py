"""Proto <-> domain translations of the inventory's types (device and node records, reservations,
task profiles, rankings, watch events); a device's spec and status are shared ones
(accelmesh.runtime.devices)."""

from __future__ import annotations

from collections.abc import Iterable

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.runtime.devices import device_to_proto, timestamp
from inventory_svc import events as ev
from inventory_svc.inventory import Claim, Ranking
from inventory_svc.records import DeviceRecord, NodeRecord, RemovedNode, Reservation
from inventory_svc.scoring import TaskProfile, Weights

TASK_KINDS = {pb.TASK_KIND_UNSPECIFIED: "inference", pb.TASK_KIND_TRAINING: "training",
              pb.TASK_KIND_INFERENCE: "inference"}
NODE_STATES = {"active": pb.NODE_STATE_ACTIVE, "lost": pb.NODE_STATE_LOST}
EVENT_TYPES = {
    ev.EXISTING: pb.DEVICE_EVENT_TYPE_EXISTING,
    ev.ADDED: pb.DEVICE_EVENT_TYPE_ADDED,
    ev.UPDATED: pb.DEVICE_EVENT_TYPE_UPDATED,
    ev.LOST: pb.DEVICE_EVENT_TYPE_LOST,
    ev.RECOVERED: pb.DEVICE_EVENT_TYPE_RECOVERED,
    ev.REMOVED: pb.DEVICE_EVENT_TYPE_REMOVED,
}


def device_record_to_proto(record: DeviceRecord) -> common_pb2.Device:
    return device_to_proto(
        record.spec,
        record.latest,
        health=record.health,
        node_address=record.node_address,
        reserved_memory_bytes=record.reserved_memory_bytes,
        reserved_compute_fraction=record.reserved_compute_fraction,
    )


def devices_to_proto(records: Iterable[DeviceRecord]) -> list[common_pb2.Device]:
    return [device_record_to_proto(r) for r in records]


def node_to_proto(node: NodeRecord, device_count: int) -> pb.Node:
    msg = pb.Node(
        address=node.address,
        ip=node.ip,
        hostname=node.hostname,
        state=NODE_STATES.get(node.state, pb.NODE_STATE_UNSPECIFIED),
        register_time=timestamp(node.registered_at),
        missed_polls=node.missed_polls,
        last_error=node.last_error,
        device_count=device_count,
        suspect=node.suspect,
        suspect_reason=node.suspect_reason,
    )
    if node.last_seen_at is not None:
        msg.last_seen_time.CopyFrom(timestamp(node.last_seen_at))
    if node.suspect_at is not None:
        msg.suspect_time.CopyFrom(timestamp(node.suspect_at))
    return msg


def removed_node_to_proto(removed: RemovedNode) -> pb.RemoveNodeResponse:
    return pb.RemoveNodeResponse(
        node=node_to_proto(removed.node, len(removed.devices)),
        device_ids=[d.id for d in removed.devices],
        released_reservations=reservations_to_proto(removed.released),
    )


def reservation_to_proto(r: Reservation) -> pb.Reservation:
    return pb.Reservation(
        job_id=r.job_id,
        device_id=r.device_id,
        memory_bytes=r.memory_bytes,
        compute_fraction=r.compute_fraction,
        expire_time=timestamp(r.expires_at),
    )


def reservations_to_proto(found: Iterable[Reservation]) -> list[pb.Reservation]:
    return [reservation_to_proto(r) for r in found]


def claims_from_proto(claims: Iterable[pb.DeviceClaim]) -> list[Claim]:
    return [Claim(c.device_id, c.memory_bytes, c.compute_fraction) for c in claims]


def task_profile_from_proto(msg: pb.TaskProfile) -> TaskProfile:
    """The task a ScoreDevices ranks for; proto3 passes unknown kinds through, so they are refused here."""
    if msg.kind not in TASK_KINDS:
        raise errors.InvalidArgument(
            f"task.kind {msg.kind} is not a TaskKind; use TASK_KIND_TRAINING or TASK_KIND_INFERENCE")
    weights = None
    if msg.HasField("weights"):
        weights = Weights(msg.weights.compute, msg.weights.memory, msg.weights.bandwidth)
    return TaskProfile(
        kind=TASK_KINDS[msg.kind],
        precision=msg.precision or "fp32",
        arithmetic_intensity=msg.arithmetic_intensity or None,
        weights=weights,
    )


def ranking_to_proto(ranking: Ranking) -> pb.ScoreDevicesResponse:
    return pb.ScoreDevicesResponse(
        devices=[
            pb.ScoredDevice(
                device=device_record_to_proto(s.record),
                score=s.score,
                components=pb.StatusComponents(**s.components),
                free_compute_tflops=s.status.compute_tflops,
            )
            for s in ranking.devices
        ],
        weights=pb.TaskWeights(
            compute=ranking.weights.compute, memory=ranking.weights.memory, bandwidth=ranking.weights.bandwidth
        ),
        weights_rule=ranking.rule,
    )


def watch_event_to_proto(kind: str, record: DeviceRecord, at: float) -> pb.WatchDevicesResponse:
    return pb.WatchDevicesResponse(type=EVENT_TYPES[kind], device=device_record_to_proto(record),
                                   event_time=timestamp(at))
