"""Workers that answer with garbage, or stop answering, never crash the inventory."""

from __future__ import annotations

import grpc
import pytest

from accelmesh.common.v1 import common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from worker_svc.server import ACCESS as WORKER_ACCESS

from conftest import CREDENTIALS, rpc_error

A100 = dict(id="127.0.0.1/cuda:0", node_ip="127.0.0.1", local_index=0, platform=common_pb2.PLATFORM_CUDA,
            type="a100-80gb")


def answer(**overrides):
    device = common_pb2.Device(**{**A100, **overrides.pop("device", {})})
    return worker_service_pb2.DescribeNodeResponse(
        **{"node_ip": "127.0.0.1", "hostname": "odd", "devices": [device], **overrides})


def fake_worker(servicer, add_to_server):
    """A server that passes for a worker: the worker's certificate and access table."""
    return create_server([Service("accelmesh.worker.v1.WorkerService", add_to_server, servicer)],
                         security=CREDENTIALS.service(Role.WORKER), access=WORKER_ACCESS).start()


class ScriptedWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self, response):
        self.response = response

    def DescribeNode(self, request, context):
        return self.response


@pytest.fixture
def scripted():
    servicer = ScriptedWorker(answer())
    server = fake_worker(servicer, worker_service_pb2_grpc.add_WorkerServiceServicer_to_server)
    yield server, servicer
    server.stop(0)


GARBAGE = [
    pytest.param(answer(device={"id": "not an id"}), "devices[0].id", id="malformed-id"),
    pytest.param(answer(device={"platform": common_pb2.PLATFORM_TPU}), "devices[0].platform", id="platform-mismatch"),
    pytest.param(answer(node_ip="10.0.0.1"), "node's IP", id="foreign-ip"),
    pytest.param(answer(node_ip=""), "node_ip", id="no-ip"),
    pytest.param(answer(device={"status": common_pb2.DeviceStatus(utilization=7.0, sample_time={"seconds": 1})}),
                 "utilization", id="utilization-out-of-range"),
    pytest.param(answer(device={"performance": common_pb2.Performance(peak_tflops={"fp32": float("nan")})}),
                 "peak_tflops", id="nan-rate"),
    pytest.param(worker_service_pb2.DescribeNodeResponse(
        node_ip="127.0.0.1", devices=[common_pb2.Device(**A100), common_pb2.Device(**A100)]),
        "repeat", id="duplicate-ids"),
]


@pytest.mark.parametrize("garbage, words", GARBAGE)
def test_registering_a_node_that_answers_garbage_is_unavailable(inventory_stub, scripted, garbage, words):
    server, servicer = scripted
    servicer.response = garbage
    error = rpc_error(inventory_stub.RegisterNode, pb.RegisterNodeRequest(address=f"127.0.0.1:{server.port}"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "invalid description" in error.details() and words in error.details()
    assert inventory_stub.ListNodes(pb.ListNodesRequest()).nodes == []


@pytest.mark.parametrize("garbage, words", GARBAGE)
def test_a_registered_node_turning_to_garbage_counts_as_a_missed_poll(
    inventory, inventory_stub, scripted, garbage, words,
):
    server, servicer = scripted
    _, domain = inventory
    inventory_stub.RegisterNode(pb.RegisterNodeRequest(address=f"127.0.0.1:{server.port}"))
    servicer.response = garbage
    assert domain.poll_all() == {f"127.0.0.1:{server.port}": False}
    (node,) = inventory_stub.ListNodes(pb.ListNodesRequest()).nodes
    assert node.missed_polls == 1 and words in node.last_error
    # The stored description is untouched and still served.
    assert [d.id for d in inventory_stub.ListDevices(pb.ListDevicesRequest()).devices] == ["127.0.0.1/cuda:0"]


def test_bytes_that_are_no_message_at_all_do_not_crash_the_inventory(inventory, inventory_stub):
    _, domain = inventory
    raw = grpc.method_handlers_generic_handler(
        "accelmesh.worker.v1.WorkerService",
        {"DescribeNode": grpc.unary_unary_rpc_method_handler(
            lambda request, context: b"\xff\xfe not protobuf \x00",
            request_deserializer=lambda b: b, response_serializer=lambda b: b)},
    )
    server = fake_worker(raw, lambda s, srv: srv.add_generic_rpc_handlers((s,)))
    try:
        error = rpc_error(inventory_stub.RegisterNode, pb.RegisterNodeRequest(address=f"127.0.0.1:{server.port}"))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "did not answer" in error.details()
        assert inventory_stub.ListNodes(pb.ListNodesRequest()).nodes == []
    finally:
        server.stop(0)
