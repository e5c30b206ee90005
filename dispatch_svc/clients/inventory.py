"""The `Inventory` port over gRPC (ports.py): candidate devices, real-time refreshes, scores and
the job's reservations, protos <-> domain."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.beside import beside
from accelmesh.runtime.channels import ChannelPool
from accelmesh.runtime.devices import PLATFORM_TO_PROTO, device_from_proto
from accelmesh.runtime.errors import error_from_rpc
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from dispatch_svc.clients.calls import CALL_TIMEOUT_S, call
from dispatch_svc.dataplane.descriptors import JobDevice
from dispatch_svc.jobs import records as m
from dispatch_svc.ports import ScoredStatus, Scoring

RELEASE_TIMEOUT_S = 10.0
MAX_SUSPECT_REASON_BYTES = 1024  # what the inventory keeps of MarkNodeSuspect's reason


def _constraints_filter(c: m.Constraints) -> str:
    terms = [f"capabilities:{cap}" for cap in c.capabilities]
    if c.filter:
        terms.append(c.filter)
    return " AND ".join(terms)


class GrpcInventory:
    def __init__(self, address: str, security: Security, *, tracer_provider=None, max_message_bytes: int):
        self.address = address
        # A pool even for one address: a renewed certificate is picked up on the next call.
        self._channels = ChannelPool(security, Role.INVENTORY, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)

    @property
    def stub(self) -> inventory_service_pb2_grpc.InventoryServiceStub:
        return inventory_service_pb2_grpc.InventoryServiceStub(self._channels.get(self.address))

    def close(self) -> None:
        self._channels.close()

    def candidate_devices(self, constraints: m.Constraints) -> list[JobDevice]:
        # A node whose outputs a spot check found wrong gets no job until an operator trusts it again.
        suspected = beside(self.suspect_nodes)
        devices = self._list_devices(_constraints_filter(constraints))
        platforms = {PLATFORM_TO_PROTO[p] for p in constraints.platforms}
        suspect = suspected.result()
        chosen = [d for d in devices if (not platforms or d.platform in platforms) and d.node_address not in suspect]
        if constraints.max_devices:
            chosen = chosen[: constraints.max_devices]
        return [self._device(d) for d in chosen]

    def _list_devices(self, filter_text: str) -> list[common_pb2.Device]:
        """Every device the filter matches, page by page."""
        devices, token = [], ""
        while True:
            page = call("inventory", self.stub.ListDevices, inv_pb.ListDevicesRequest(
                filter=filter_text, page_size=1000, page_token=token))
            devices.extend(page.devices)
            token = page.next_page_token
            if not token:
                return devices

    def _device(self, msg: common_pb2.Device) -> JobDevice:
        spec, _ = device_from_proto(msg, f"device {msg.id}")
        return JobDevice(spec, msg.node_address)

    def refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]:
        try:
            return self._refresh(devices)
        except errors.Unavailable:
            # One silent node fails the whole refresh. Until the inventory calls it lost (a few
            # missed polls later) the job runs on the nodes that did answer: they were polled just
            # now, so their missed-poll count is back to zero. The silent one is not polled again.
            nodes = call("inventory", self.stub.ListNodes, inv_pb.ListNodesRequest()).nodes
            answered = {n.address for n in nodes if n.state == inv_pb.NODE_STATE_ACTIVE and n.missed_polls == 0}
            survivors = [d for d in devices if d.node_address in answered]
            if not survivors or len(survivors) == len(devices):
                raise
            return self._refresh(survivors)

    def _refresh(self, devices: Sequence[JobDevice]) -> list[JobDevice]:
        response = call("inventory refresh", self.stub.RefreshDevices,
                              inv_pb.RefreshDevicesRequest(device_ids=[d.id for d in devices]))
        return [self._device(d) for d in response.devices if d.health == common_pb2.DEVICE_HEALTH_HEALTHY]

    def score_devices(self, kind: str, precision: str, intensity: float,
                      weights: tuple[float, float, float] | None, constraints: m.Constraints,
                      device_ids: Sequence[str] = ()) -> Scoring:
        task = inv_pb.TaskProfile(
            kind=inv_pb.TASK_KIND_TRAINING if kind == m.TRAINING else inv_pb.TASK_KIND_INFERENCE,
            precision=precision, arithmetic_intensity=intensity)
        if weights is not None:
            task.weights.CopyFrom(inv_pb.TaskWeights(compute=weights[0], memory=weights[1], bandwidth=weights[2]))
        response = call("inventory score", self.stub.ScoreDevices, inv_pb.ScoreDevicesRequest(
            task=task, filter=_constraints_filter(constraints), device_ids=list(device_ids)))
        w = response.weights
        return Scoring(
            devices={s.device.id: ScoredStatus(s.score, s.free_compute_tflops, s.device.status.memory_free_bytes,
                                               s.device.status.utilization, s.device.status.reserved_compute_fraction)
                     for s in response.devices},
            weights=(w.compute, w.memory, w.bandwidth), rule=response.weights_rule)

    def reserve(self, job_id: str, claims: Sequence[tuple[str, int]], ttl_s: int) -> None:
        call("inventory reserve", self.stub.ReserveDevices, inv_pb.ReserveDevicesRequest(
            job_id=job_id, ttl_seconds=ttl_s,
            claims=[inv_pb.DeviceClaim(device_id=d, memory_bytes=b, compute_fraction=1.0) for d, b in claims]))

    def renew(self, job_id: str, device_ids: Sequence[str], ttl_s: int, timeout_s: float) -> None:
        try:
            self.stub.RenewReservations(inv_pb.RenewReservationsRequest(
                job_id=job_id, ttl_seconds=ttl_s, device_ids=list(device_ids)), timeout=min(timeout_s, CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # retrying cannot help: say what would
                raise errors.FailedPrecondition(
                    f"the inventory at {self.address} cannot renew reservations (no RenewReservations): "
                    "upgrade the inventory before the dispatcher") from None
            raise error_from_rpc(exc, "inventory renew") from None

    def all_devices(self) -> list:
        """Every device the inventory knows, lost ones too, as its Device messages (the status page)."""
        return self._list_devices("") + self._list_devices('health = "lost"')

    def lost_devices(self, device_ids: Sequence[str]) -> frozenset[str]:
        """Which of `device_ids` the inventory holds lost (its table: no node is polled)."""
        return frozenset({d.id for d in self._list_devices('health = "lost"')} & set(device_ids))

    def pool_state(self) -> tuple:
        reservations = call("inventory", self.stub.ListReservations, inv_pb.ListReservationsRequest())
        return (tuple((r.job_id, r.device_id, r.memory_bytes) for r in reservations.reservations),
                tuple(sorted((d.id, d.health) for d in self._list_devices(""))))

    def reserved_device_ids(self) -> frozenset[str]:
        """The devices any reservation holds now (the queue's scheduling rounds count the others free)."""
        reservations = call("inventory", self.stub.ListReservations, inv_pb.ListReservationsRequest())
        return frozenset(r.device_id for r in reservations.reservations)

    def release(self, job_id: str) -> None:
        """The job's reservations end (the workers' side of a job's end is Workers.release). A job's
        end waits at most RELEASE_TIMEOUT_S for it; unanswered, it is sent again in the background
        (admission/releases.py)."""
        call("inventory release", self.stub.ReleaseDevices, inv_pb.ReleaseDevicesRequest(job_id=job_id),
             timeout_s=RELEASE_TIMEOUT_S)

    def suspect_nodes(self) -> frozenset[str]:
        """The addresses of the nodes marked suspect (MarkNodeSuspect) and not trusted since."""
        nodes = call("inventory", self.stub.ListNodes, inv_pb.ListNodesRequest())
        return frozenset(n.address for n in nodes.nodes if n.suspect)

    def mark_suspect(self, address: str, reason: str) -> None:
        """The node's outputs disagreed with another node's: its devices stop being candidates."""
        call("inventory suspect", self.stub.MarkNodeSuspect,
             inv_pb.MarkNodeSuspectRequest(address=address, reason=reason[:MAX_SUSPECT_REASON_BYTES]))
