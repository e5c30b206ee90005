"""Suspect nodes: a dispatcher marks a node whose outputs a spot check found wrong
(MarkNodeSuspect), an operator trusts it again (TrustNode). In the store on both engines (the
mark survives a re-registration and a poll, the first reason is kept, other replicas read it in
the change feed) and through a real in-process inventory with the mesh's TLS and tokens (who may
do which, ListNodes shows it, a watcher sees the node's devices UPDATED)."""

from __future__ import annotations

import grpc
import pytest
from _inventory_helpers import register
from store_records import NODE, one_device_fixture, report, sample, spec, store_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role
from inventory_svc.records import DeviceChange
from inventory_svc.store import SqlStore

from conftest import CREDENTIALS, rpc_error

pytestmark = pytest.mark.fixture_cpu

STREAM_DEADLINE_S = 30.0  # the stream's own deadline: an event that never comes fails the test


def test_a_node_marked_suspect_stays_so_through_polls_and_registration_until_trusted(store, one_device):
    marked, changes = store.mark_suspect(NODE, "job j1: shard 3 disagreed", now=5.0)
    assert marked.suspect and marked.suspect_reason == "job j1: shard 3 disagreed" and marked.suspect_at == 5.0
    assert changes == [DeviceChange("updated", one_device.id)]  # its devices are no longer candidates
    again, changes = store.mark_suspect(NODE, "job j2: shard 1 disagreed", now=9.0)
    assert (again.suspect_reason, again.suspect_at) == ("job j1: shard 3 disagreed", 5.0)  # the first kept
    assert changes == []
    store.upsert_node(NODE, "10.0.0.1", "host", now=10.0)
    store.record_poll_success(NODE, report([one_device], [sample(one_device, 10.0)]), now=10.0)
    assert store.get_node(NODE).suspect
    trusted, changes = store.trust_node(NODE, now=11.0)
    assert not trusted.suspect and trusted.suspect_reason == "" and trusted.suspect_at is None
    assert changes == [DeviceChange("updated", one_device.id)]
    assert [n.suspect for n in store.list_nodes()] == [False]
    assert store.trust_node(NODE, now=12.0)[1] == []  # trusted already: nothing changed


def test_another_replica_reads_a_suspect_mark_in_the_change_feed(database_url, one_device):
    reader = SqlStore(database_url)
    try:
        cursor = reader.change_cursor()
        writer = SqlStore(database_url)
        try:
            writer.mark_suspect(NODE, "job j1: shard 0 disagreed", now=5.0)
        finally:
            writer.close()
        changes, _ = reader.read_changes(cursor)
        assert [e for c in changes for e in c.events] == [DeviceChange("updated", one_device.id)]
        assert reader.get_node(NODE).suspect
    finally:
        reader.close()


def test_marking_an_unknown_node_or_without_a_reason_is_refused_naming_the_field(store, one_device):
    with pytest.raises(NotFound, match="accelmesh nodes list"):
        store.mark_suspect("10.9.9.9:1", "why", now=1.0)
    with pytest.raises(NotFound):
        store.trust_node("10.9.9.9:1", now=1.0)
    with pytest.raises(InvalidArgument, match="reason"):
        store.mark_suspect(NODE, "", now=1.0)
    assert not store.get_node(NODE).suspect


def _stub(server, who: str, channel_stack: list):
    security = CREDENTIALS.client(CREDENTIALS.add_user("suspect-bob")) if who == "user" else CREDENTIALS.service(
        Role(who))
    channel = open_channel(f"127.0.0.1:{server.port}", security=security)
    channel_stack.append(channel)
    return inventory_service_pb2_grpc.InventoryServiceStub(channel)


def test_a_dispatcher_marks_a_node_suspect_listnodes_shows_it_and_an_operator_trusts_it(inventory, inventory_stub,
                                                                                      worker):
    server, _ = inventory
    address = register(inventory_stub, worker).node.address
    stream = inventory_stub.WatchDevices(pb.WatchDevicesRequest(filter='platform = "cuda"', include_existing=True),
                                         timeout=STREAM_DEADLINE_S)
    channels: list = []
    try:
        assert len([next(stream) for _ in range(2)]) == 2  # the existing devices: the stream has subscribed
        dispatch = _stub(server, "dispatch", channels)
        node = dispatch.MarkNodeSuspect(pb.MarkNodeSuspectRequest(address=address, reason="job j: shard 0")).node
        assert node.suspect and node.suspect_reason == "job j: shard 0" and node.HasField("suspect_time")
        events = [next(stream) for _ in range(2)]
        assert [(e.type, e.device.id) for e in events] == [(pb.DEVICE_EVENT_TYPE_UPDATED, "127.0.0.1/cuda:0"),
                                                           (pb.DEVICE_EVENT_TYPE_UPDATED, "127.0.0.1/cuda:1")]
        listed = inventory_stub.ListNodes(pb.ListNodesRequest()).nodes
        assert [(n.address, n.suspect) for n in listed] == [(address, True)]
        error = rpc_error(dispatch.TrustNode, pb.TrustNodeRequest(address=address))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "TrustNode needs the role operator" in \
            error.details()
        user = _stub(server, "user", channels)
        error = rpc_error(user.MarkNodeSuspect, pb.MarkNodeSuspectRequest(address=address, reason="x"))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        stream.cancel()
        for channel in channels:
            channel.close()
    trusted = inventory_stub.TrustNode(pb.TrustNodeRequest(address=address)).node  # the operator's stub
    assert not trusted.suspect and not trusted.HasField("suspect_time")
    assert [n.suspect for n in inventory_stub.ListNodes(pb.ListNodesRequest()).nodes] == [False]
