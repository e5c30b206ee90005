"""The inventory's records: what the store keeps and hands out, as plain frozen values.

Their own module, so that filtering (which reads a DeviceRecord) and the store (which applies a
filter) import these instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from accelmesh.hardware.model import DeviceSample, DeviceSpec, free_memory_bytes


@dataclass(frozen=True)
class NodeRecord:
    address: str  # the node's one name: the worker's "host:port", which the poller dials
    ip: str
    hostname: str
    state: str  # "active" | "lost"
    registered_at: float
    last_seen_at: float | None
    missed_polls: int
    last_error: str
    suspect_reason: str = ""  # why a spot check found its outputs wrong (suspects.py)
    suspect_at: float | None = None  # when; None while it is trusted

    @property
    def suspect(self) -> bool:
        return self.suspect_at is not None


@dataclass(frozen=True)
class DeviceRecord:
    """A device as the planner sees it: its spec, where it lives, how it is and what is promised away."""

    spec: DeviceSpec
    node_address: str  # the owning node's address (NodeRecord.address)
    health: str  # "healthy" | "lost"
    latest: DeviceSample | None
    reserved_memory_bytes: int  # sum over live reservations
    reserved_compute_fraction: float  # sum over live reservations; may exceed 1 (time slicing)
    first_seen_at: float
    updated_at: float  # last change of spec or health

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def memory_total_bytes(self) -> int:
        # Before the first sample the datasheet figure is the best guess.
        return self.latest.memory_total_bytes if self.latest else self.spec.performance.memory_bytes

    @property
    def memory_used_bytes(self) -> int:
        return self.latest.memory_used_bytes if self.latest else 0

    @property
    def utilization(self) -> float:
        return self.latest.utilization if self.latest else 0.0

    @property
    def free_memory_bytes(self) -> int:
        return free_memory_bytes(self.memory_total_bytes, self.memory_used_bytes, self.reserved_memory_bytes)


@dataclass(frozen=True)
class Reservation:
    job_id: str
    device_id: str
    memory_bytes: int
    compute_fraction: float
    created_at: float
    expires_at: float  # the lease: renewed (RenewReservations, or reserving again) or it lapses with its job


@dataclass(frozen=True)
class RemovedNode:
    """What left the inventory with a node (RemoveNode, or a node lost too long and forgotten)."""

    node: NodeRecord  # as stored just before
    devices: tuple[DeviceRecord, ...]  # its devices as last stored, in id order
    released: tuple[Reservation, ...]  # the live reservations that ended with it (a forced removal)


class DeviceChange(NamedTuple):
    kind: str  # "added" | "updated" | "recovered" | "lost" | "removed"
    device_id: str
