"""WatchDevices across inventory replicas: a stream on one replica reports the devices another
replica's polls add, update, lose and recover, through the change feed and the follower thread,
on both engines (two servers on one SQLite file, or on one PostgreSQL database). The streams are
read with a deadline; nothing waits by sleeping."""

from __future__ import annotations

import pytest
from _inventory_helpers import register

from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from inventory_svc.config import InventoryConfig
from inventory_svc.server import build_inventory

from conftest import make_worker, mesh_stub

pytestmark = pytest.mark.fixture_cpu

STREAM_DEADLINE_S = 30.0  # the stream's own deadline: an event that never comes fails the test
FOLLOW_INTERVAL_S = 0.05


@pytest.fixture
def replicas(database_url):
    """Two inventory servers on one database; neither polls on its own (the test drives polls)."""
    started = []
    for _ in ("a", "b"):
        config = InventoryConfig(listen="127.0.0.1:0", db=database_url, lost_after_polls=1,
                                 follow_interval_s=FOLLOW_INTERVAL_S)
        server, inventory = build_inventory(config, start_poller=False)
        started.append((server.start(), inventory))
    yield [(mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, f"127.0.0.1:{server.port}"), inventory)
           for server, inventory in started]
    for server, _ in started:
        server.stop(0)


def _events(stream, count: int) -> list[tuple[int, str]]:
    return sorted((e.type, e.device.id) for e in (next(stream) for _ in range(count)))


def test_a_watch_on_one_replica_sees_what_the_other_replicas_polls_change(replicas):
    (stub_a, _), (_, inventory_b) = replicas
    worker = make_worker()  # emulated a100-80gb and v100-32gb: 127.0.0.1/cuda:0 and :1
    port = worker.port
    revived = None
    register(stub_a, worker)
    stream = stub_a.WatchDevices(pb.WatchDevicesRequest(filter='platform = "cuda"', include_existing=True),
                                 timeout=STREAM_DEADLINE_S)
    try:
        # The existing devices prove the stream subscribed before anything below happens.
        assert _events(stream, 2) == [(pb.DEVICE_EVENT_TYPE_EXISTING, "127.0.0.1/cuda:0"),
                                      (pb.DEVICE_EVENT_TYPE_EXISTING, "127.0.0.1/cuda:1")]
        assert inventory_b.poll_all() == {f"127.0.0.1:{port}": True}  # b claims the node first: a never polls it
        worker.stop(0)
        assert inventory_b.poll_all() == {f"127.0.0.1:{port}": False}
        assert _events(stream, 2) == [(pb.DEVICE_EVENT_TYPE_LOST, "127.0.0.1/cuda:0"),
                                      (pb.DEVICE_EVENT_TYPE_LOST, "127.0.0.1/cuda:1")]
        # The node comes back with other cards in its first two slots and a third one.
        revived = make_worker(emulate=("v100-32gb", "a100-80gb", "h100-sxm-80gb"), listen=f"127.0.0.1:{port}")
        assert inventory_b.poll_all() == {f"127.0.0.1:{port}": True}
        assert _events(stream, 5) == sorted([
            (pb.DEVICE_EVENT_TYPE_UPDATED, "127.0.0.1/cuda:0"), (pb.DEVICE_EVENT_TYPE_RECOVERED, "127.0.0.1/cuda:0"),
            (pb.DEVICE_EVENT_TYPE_UPDATED, "127.0.0.1/cuda:1"), (pb.DEVICE_EVENT_TYPE_RECOVERED, "127.0.0.1/cuda:1"),
            (pb.DEVICE_EVENT_TYPE_ADDED, "127.0.0.1/cuda:2")])
        # What a reports now is what b wrote, and a's own ranking knows the new card.
        scored = stub_a.ScoreDevices(pb.ScoreDevicesRequest(task=pb.TaskProfile(kind=pb.TASK_KIND_TRAINING),
                                                            filter='type = "h100-sxm-80gb"'))
        assert [s.device.id for s in scored.devices] == ["127.0.0.1/cuda:2"]
    finally:
        stream.cancel()
        if revived is not None:
            revived.stop(0)


def test_a_watch_on_a_replica_that_fell_behind_ends_asking_to_watch_again(replicas):
    (stub_a, inventory_a), _ = replicas
    worker = make_worker()
    register(stub_a, worker)
    stream = stub_a.WatchDevices(pb.WatchDevicesRequest(filter='platform = "cuda"', include_existing=True),
                                 timeout=STREAM_DEADLINE_S)
    try:
        assert len(_events(stream, 2)) == 2
        inventory_a.hub.drop_all("the inventory replica fell behind the others' changes")  # as follow() does then
        with pytest.raises(Exception) as info:
            next(stream)
        assert "watch again" in info.value.details() and info.value.code().name == "RESOURCE_EXHAUSTED"
    finally:
        stream.cancel()
        worker.stop(0)


def test_a_watch_on_one_replica_sees_the_devices_of_a_node_another_replica_removed(replicas):
    (stub_a, inventory_a), (stub_b, _) = replicas
    worker = make_worker()
    try:
        address = register(stub_a, worker).node.address
        inventory_a.follow()  # a's index holds the devices now: what a REMOVED event reports of them
        stream = stub_a.WatchDevices(pb.WatchDevicesRequest(filter='platform = "cuda"', include_existing=True),
                                     timeout=STREAM_DEADLINE_S)
        try:
            assert len(_events(stream, 2)) == 2
            stub_b.RemoveNode(pb.RemoveNodeRequest(address=address))
            events = [next(stream) for _ in range(2)]
            assert sorted((e.type, e.device.id, e.device.type) for e in events) == [
                (pb.DEVICE_EVENT_TYPE_REMOVED, "127.0.0.1/cuda:0", "a100-80gb"),
                (pb.DEVICE_EVENT_TYPE_REMOVED, "127.0.0.1/cuda:1", "v100-32gb")]
            scored = stub_a.ScoreDevices(pb.ScoreDevicesRequest(task=pb.TaskProfile(kind=pb.TASK_KIND_TRAINING)))
            assert list(scored.devices) == []  # a's index let them go too
        finally:
            stream.cancel()
    finally:
        worker.stop(0)
