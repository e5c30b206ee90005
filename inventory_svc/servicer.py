"""InventoryService adapter: protos in, `Inventory` calls, protos out. No behaviour lives here."""

from __future__ import annotations

import threading

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.devices import device_to_proto, status_to_proto, timestamp
from accelmesh.security.access import Authenticator
from accelmesh.security.identity import Role
from inventory_svc import events as ev
from inventory_svc.filtering import DeviceFilter, parse_filter
from inventory_svc.inventory import Claim, Inventory, check_node_address
from inventory_svc.records import DeviceRecord, NodeRecord, Reservation
from inventory_svc.scoring import TaskProfile, Weights

TASK_KINDS = {pb.TASK_KIND_UNSPECIFIED: "inference", pb.TASK_KIND_TRAINING: "training", pb.TASK_KIND_INFERENCE: "inference"}
NODE_STATES = {"active": pb.NODE_STATE_ACTIVE, "lost": pb.NODE_STATE_LOST}
EVENT_TYPES = {
    ev.EXISTING: pb.DEVICE_EVENT_TYPE_EXISTING,
    ev.ADDED: pb.DEVICE_EVENT_TYPE_ADDED,
    ev.UPDATED: pb.DEVICE_EVENT_TYPE_UPDATED,
    ev.LOST: pb.DEVICE_EVENT_TYPE_LOST,
    ev.RECOVERED: pb.DEVICE_EVENT_TYPE_RECOVERED,
    ev.REMOVED: pb.DEVICE_EVENT_TYPE_REMOVED,
}


def device_proto(record: DeviceRecord) -> common_pb2.Device:
    return device_to_proto(
        record.spec,
        record.latest,
        health=record.health,
        node_address=record.node_address,
        reserved_memory_bytes=record.reserved_memory_bytes,
        reserved_compute_fraction=record.reserved_compute_fraction,
    )


def node_proto(node: NodeRecord, device_count: int) -> pb.Node:
    msg = pb.Node(
        address=node.address,
        ip=node.ip,
        hostname=node.hostname,
        state=NODE_STATES.get(node.state, pb.NODE_STATE_UNSPECIFIED),
        register_time=timestamp(node.registered_at),
        missed_polls=node.missed_polls,
        last_error=node.last_error,
        device_count=device_count,
    )
    if node.last_seen_at is not None:
        msg.last_seen_time.CopyFrom(timestamp(node.last_seen_at))
    return msg


def reservation_proto(r: Reservation) -> pb.Reservation:
    return pb.Reservation(
        job_id=r.job_id,
        device_id=r.device_id,
        memory_bytes=r.memory_bytes,
        compute_fraction=r.compute_fraction,
        expire_time=timestamp(r.expires_at),
    )


def task_profile(msg: pb.TaskProfile) -> TaskProfile:
    if msg.kind not in TASK_KINDS:
        raise errors.InvalidArgument(f"task.kind {msg.kind} is not a TaskKind; use TASK_KIND_TRAINING or TASK_KIND_INFERENCE")
    weights = None
    if msg.HasField("weights"):
        weights = Weights(msg.weights.compute, msg.weights.memory, msg.weights.bandwidth)
    return TaskProfile(
        kind=TASK_KINDS[msg.kind],
        precision=msg.precision or "fp32",
        arithmetic_intensity=msg.arithmetic_intensity or None,
        weights=weights,
    )


class InventoryServicer(inventory_service_pb2_grpc.InventoryServiceServicer):
    def __init__(self, inventory: Inventory, auth: Authenticator):
        self.inventory = inventory
        self._auth = auth
        self._watches: set = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        """End open WatchDevices streams so shutdown is not held up by idle watchers."""
        with self._lock:
            watches = list(self._watches)
        for sub in watches:
            sub.close()

    def RegisterNode(self, request, context):
        check_node_address(request.address)  # a malformed address is the caller's mistake, whoever they are
        self._check_names_node(context, request.address)
        node, devices = self.inventory.register_node(request.address)
        return pb.RegisterNodeResponse(node=node_proto(node, len(devices)), devices=[device_proto(d) for d in devices])

    def _check_names_node(self, context, address: str) -> None:
        """A worker registers only the node its certificate names: nobody can make the inventory
        dial, and send other clients' work to, an address of their choosing."""
        if self._auth.insecure:
            return
        identity = self._auth.certificate(context)
        host = address.rsplit(":", 1)[0]
        if identity is None or identity.role is not Role.WORKER or not identity.names_host(host):
            name = f"{identity.role.value}/{identity.name}" if identity else "a caller without a certificate"
            raise errors.PermissionDenied(
                f"address: {name} may not register {address!r}: a node is registered by its worker, whose "
                f"certificate names the node's host ({host}) as a DNS or IP subject alternative name",
                field="address",
            )

    def ListNodes(self, request, context):
        counts = self.inventory.device_counts()
        nodes = self.inventory.store.list_nodes()
        return pb.ListNodesResponse(nodes=[node_proto(n, counts.get(n.address, 0)) for n in nodes])

    def RemoveNode(self, request, context):
        removed = self.inventory.remove_node(request.address, request.force)
        return pb.RemoveNodeResponse(
            node=node_proto(removed.node, len(removed.devices)),
            device_ids=[d.id for d in removed.devices],
            released_reservations=[reservation_proto(r) for r in removed.released],
        )

    def ListDevices(self, request, context):
        records, token = self.inventory.list_devices(request.filter, request.page_size, request.page_token)
        return pb.ListDevicesResponse(devices=[device_proto(r) for r in records], next_page_token=token)

    def GetDevice(self, request, context):
        if request.history_limit < 0:
            raise errors.InvalidArgument(f"history_limit is {request.history_limit}; use 0 or a positive number")
        record = self.inventory.get_device(request.device_id)
        history = []
        if request.history_limit:
            samples = self.inventory.store.samples(record.id)[-request.history_limit :]
            history = [status_to_proto(s) for s in reversed(samples)]
        return pb.GetDeviceResponse(device=device_proto(record), history=history)

    def RefreshDevices(self, request, context):
        records = self.inventory.refresh_devices(list(request.device_ids))
        return pb.RefreshDevicesResponse(devices=[device_proto(r) for r in records])

    def WatchDevices(self, request, context):
        flt = parse_filter(request.filter)
        sub = self.inventory.hub.subscribe()
        with self._lock:
            self._watches.add(sub)
        context.add_callback(sub.close)
        try:
            if request.include_existing:
                for record in self.inventory.all_devices(flt):
                    yield pb.WatchDevicesResponse(
                        type=pb.DEVICE_EVENT_TYPE_EXISTING, device=device_proto(record), event_time=timestamp(record.updated_at)
                    )
            for event in sub:
                if event.kind == ev.REMOVED:
                    record = event.record  # its rows are gone; None: a device this replica never knew
                else:
                    try:
                        record = self.inventory.store.get_device(event.device_id)
                    except errors.NotFound:
                        continue
                if record is None:
                    continue
                # Lost and removed devices are news to a watcher even when its filter would hide
                # them from a listing (a node is forgotten after it was lost).
                if not (flt.matches(record) or (event.kind in (ev.LOST, ev.REMOVED)
                                                and _matches_ignoring_health(flt, record))):
                    continue
                yield pb.WatchDevicesResponse(
                    type=EVENT_TYPES[event.kind], device=device_proto(record), event_time=timestamp(event.timestamp)
                )
        except ev.Overflowed as exc:
            raise errors.ResourceExhausted(str(exc)) from None
        finally:
            sub.close()
            with self._lock:
                self._watches.discard(sub)

    def ScoreDevices(self, request, context):
        if not request.HasField("task"):
            raise errors.InvalidArgument("task is required; set task.kind (and optionally precision, weights)")
        ranking = self.inventory.score(task_profile(request.task), request.filter, request.limit,
                                       list(request.device_ids))
        return pb.ScoreDevicesResponse(
            devices=[
                pb.ScoredDevice(
                    device=device_proto(s.record),
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

    def ReserveDevices(self, request, context):
        claims = [Claim(c.device_id, c.memory_bytes, c.compute_fraction) for c in request.claims]
        reservations = self.inventory.reserve(request.job_id, claims, float(request.ttl_seconds))
        return pb.ReserveDevicesResponse(reservations=[reservation_proto(r) for r in reservations])

    def RenewReservations(self, request, context):
        renewed = self.inventory.renew(request.job_id, list(request.device_ids), float(request.ttl_seconds))
        return pb.RenewReservationsResponse(renewed_count=len(renewed), expire_time=timestamp(renewed[0].expires_at))

    def ReleaseDevices(self, request, context):
        count = self.inventory.release(request.job_id, list(request.device_ids))
        return pb.ReleaseDevicesResponse(released_count=count)

    def ListReservations(self, request, context):
        found = self.inventory.reservations(request.job_id, request.device_id)
        return pb.ListReservationsResponse(reservations=[reservation_proto(r) for r in found])


def _matches_ignoring_health(flt, record: DeviceRecord) -> bool:
    return DeviceFilter(terms=flt.terms, include_lost=True).matches(record)
