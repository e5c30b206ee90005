"""RemoveNode through a real in-process inventory on port 0, with the mesh's TLS and tokens: an
operator removes a node (its devices leave, a watcher sees them REMOVED, it is polled no more and
may register again); everyone else is PERMISSION_DENIED; an unknown address is NOT_FOUND; a node
whose devices a job holds is FAILED_PRECONDITION naming the job, until forced."""

from __future__ import annotations

import grpc
import pytest
from _inventory_helpers import claim, device_ids, register

from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role

from conftest import CREDENTIALS, rpc_error

pytestmark = pytest.mark.fixture_cpu

STREAM_DEADLINE_S = 30.0  # the stream's own deadline: an event that never comes fails the test
WORKER_IDS = ["127.0.0.1/cpu:2", "127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]


def _nodes(stub) -> list[str]:
    return [n.address for n in stub.ListNodes(pb.ListNodesRequest()).nodes]


def test_an_operator_removes_a_node_and_a_watcher_sees_its_devices_go(inventory, inventory_stub, worker):
    _, domain = inventory
    address = register(inventory_stub, worker).node.address
    stream = inventory_stub.WatchDevices(pb.WatchDevicesRequest(filter='platform = "cuda"', include_existing=True),
                                         timeout=STREAM_DEADLINE_S)
    try:
        # The existing devices prove the stream subscribed before the removal.
        assert sorted(next(stream).device.id for _ in range(2)) == ["127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]
        removed = inventory_stub.RemoveNode(pb.RemoveNodeRequest(address=address))
        assert removed.node.address == address and removed.node.device_count == 3
        assert list(removed.device_ids) == WORKER_IDS and not removed.released_reservations
        events = [next(stream) for _ in range(2)]  # the filter leaves the CPU device out
        assert [(e.type, e.device.id) for e in events] == [(pb.DEVICE_EVENT_TYPE_REMOVED, "127.0.0.1/cuda:0"),
                                                           (pb.DEVICE_EVENT_TYPE_REMOVED, "127.0.0.1/cuda:1")]
        assert [e.device.type for e in events] == ["a100-80gb", "v100-32gb"]  # as last stored
        assert events[0].device.node_address == address
    finally:
        stream.cancel()
    assert _nodes(inventory_stub) == [] and device_ids(inventory_stub) == []
    assert domain.poll_all() == {}  # no longer polled
    again = register(inventory_stub, worker)  # and free to register again, as a new node
    assert again.node.state == pb.NODE_STATE_ACTIVE and sorted(d.id for d in again.devices) == WORKER_IDS
    assert _nodes(inventory_stub) == [address]


def _credentials(who: str):
    """A person with the user role (a token), or a service of the mesh (its certificate)."""
    if who == "user":
        return CREDENTIALS.client(CREDENTIALS.add_user("removal-bob"))
    return CREDENTIALS.service(Role(who))


@pytest.mark.parametrize("who", ["user", "dispatch", "worker"])
def test_only_an_operator_may_remove_a_node(inventory, inventory_stub, worker, who):
    server, _ = inventory
    address = register(inventory_stub, worker).node.address
    with open_channel(f"127.0.0.1:{server.port}", security=_credentials(who)) as channel:
        error = rpc_error(inventory_service_pb2_grpc.InventoryServiceStub(channel).RemoveNode,
                          pb.RemoveNodeRequest(address=address, force=True))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "RemoveNode needs the role operator" in error.details() and who in error.details()
    assert _nodes(inventory_stub) == [address]


@pytest.mark.parametrize("address, code, words", [
    ("127.0.0.1:1", grpc.StatusCode.NOT_FOUND, "address: node '127.0.0.1:1' is not registered"),
    ("127.0.0.1:1", grpc.StatusCode.NOT_FOUND, "accelmesh nodes list"),
    ("", grpc.StatusCode.INVALID_ARGUMENT, "address must not be empty"),
])
def test_an_unknown_or_empty_address_is_refused_naming_the_field(inventory_stub, worker, address, code, words):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.RemoveNode, pb.RemoveNodeRequest(address=address))
    assert error.code() == code and words in error.details()
    assert len(_nodes(inventory_stub)) == 1


def test_a_node_whose_devices_a_job_holds_is_refused_naming_it_until_forced(inventory_stub, worker):
    address = register(inventory_stub, worker).node.address
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="job-7", claims=[claim()], ttl_seconds=600))
    error = rpc_error(inventory_stub.RemoveNode, pb.RemoveNodeRequest(address=address))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reserved by job(s) job-7" in error.details() and "--force" in error.details()
    assert _nodes(inventory_stub) == [address] and len(device_ids(inventory_stub)) == 3
    removed = inventory_stub.RemoveNode(pb.RemoveNodeRequest(address=address, force=True))
    assert [(r.job_id, r.device_id) for r in removed.released_reservations] == [("job-7", "127.0.0.1/cuda:0")]
    assert inventory_stub.ListReservations(pb.ListReservationsRequest()).reservations == []
    assert _nodes(inventory_stub) == []
