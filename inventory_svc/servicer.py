"""InventoryService adapter: it authorises, calls `Inventory` and maps errors; the protos are
translated by translate.py. No behaviour lives here."""

from __future__ import annotations

import threading

from accelmesh import errors
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.devices import status_to_proto, timestamp
from accelmesh.security.access import Authenticator
from accelmesh.security.identity import Role
from inventory_svc import events as ev
from inventory_svc import translate as tr
from inventory_svc.filtering import DeviceFilter, parse_filter
from inventory_svc.inventory import Inventory, check_node_address
from inventory_svc.records import DeviceRecord


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
        return pb.RegisterNodeResponse(node=tr.node_to_proto(node, len(devices)), devices=tr.devices_to_proto(devices))

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
        return pb.ListNodesResponse(nodes=[tr.node_to_proto(n, counts.get(n.address, 0)) for n in nodes])

    def RemoveNode(self, request, context):
        return tr.removed_node_to_proto(self.inventory.remove_node(request.address, request.force))

    def MarkNodeSuspect(self, request, context):
        node = self.inventory.mark_suspect(request.address, request.reason)
        return pb.MarkNodeSuspectResponse(node=self._node(node))

    def TrustNode(self, request, context):
        return pb.TrustNodeResponse(node=self._node(self.inventory.trust_node(request.address)))

    def _node(self, node):
        return tr.node_to_proto(node, self.inventory.device_counts().get(node.address, 0))

    def ListDevices(self, request, context):
        records, token = self.inventory.list_devices(request.filter, request.page_size, request.page_token)
        return pb.ListDevicesResponse(devices=tr.devices_to_proto(records), next_page_token=token)

    def GetDevice(self, request, context):
        if request.history_limit < 0:
            raise errors.InvalidArgument(f"history_limit is {request.history_limit}; use 0 or a positive number")
        record = self.inventory.get_device(request.device_id)
        history = []
        if request.history_limit:
            samples = self.inventory.store.samples(record.id)[-request.history_limit :]
            history = [status_to_proto(s) for s in reversed(samples)]
        return pb.GetDeviceResponse(device=tr.device_record_to_proto(record), history=history)

    def RefreshDevices(self, request, context):
        records = self.inventory.refresh_devices(list(request.device_ids))
        return pb.RefreshDevicesResponse(devices=tr.devices_to_proto(records))

    def WatchDevices(self, request, context):
        flt = parse_filter(request.filter)
        sub = self.inventory.hub.subscribe()
        with self._lock:
            self._watches.add(sub)
        context.add_callback(sub.close)
        try:
            if request.include_existing:
                for record in self.inventory.all_devices(flt):
                    yield tr.watch_event_to_proto(ev.EXISTING, record, record.updated_at)
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
                yield tr.watch_event_to_proto(event.kind, record, event.timestamp)
        except ev.Overflowed as exc:
            raise errors.ResourceExhausted(str(exc)) from None
        finally:
            sub.close()
            with self._lock:
                self._watches.discard(sub)

    def ScoreDevices(self, request, context):
        if not request.HasField("task"):
            raise errors.InvalidArgument("task is required; set task.kind (and optionally precision, weights)")
        ranking = self.inventory.score(tr.task_profile_from_proto(request.task), request.filter, request.limit,
                                       list(request.device_ids))
        return tr.ranking_to_proto(ranking)

    def ReserveDevices(self, request, context):
        claims = tr.claims_from_proto(request.claims)
        reservations = self.inventory.reserve(request.job_id, claims, float(request.ttl_seconds))
        return pb.ReserveDevicesResponse(reservations=tr.reservations_to_proto(reservations))

    def RenewReservations(self, request, context):
        renewed = self.inventory.renew(request.job_id, list(request.device_ids), float(request.ttl_seconds))
        return pb.RenewReservationsResponse(renewed_count=len(renewed),
                                            expire_time=timestamp(renewed[0].expires_at))

    def ReleaseDevices(self, request, context):
        count = self.inventory.release(request.job_id, list(request.device_ids))
        return pb.ReleaseDevicesResponse(released_count=count)

    def ListReservations(self, request, context):
        found = self.inventory.reservations(request.job_id, request.device_id)
        return pb.ListReservationsResponse(reservations=tr.reservations_to_proto(found))


def _matches_ignoring_health(flt, record: DeviceRecord) -> bool:
    return DeviceFilter(terms=flt.terms, include_lost=True).matches(record)
