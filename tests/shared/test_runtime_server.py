"""The server bootstrap through a real in-process server on port 0: error mapping, health,
graceful shutdown, reflection and message-size limits.

The test servicer hosts the real WorkerService contract; the first device id of a
DescribeNode request says what the handler does (raise an error, abort, or block on a gate).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh import errors
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import ANYONE
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from conftest import CREDENTIALS

WORKER_SERVICE = "accelmesh.worker.v1.WorkerService"
CALL_TIMEOUT_S = 5.0
GATE_TIMEOUT_S = 5.0
GRACE_S = 10.0  # generous: the shutdown test releases the call long before it runs out
MIB = 1024 * 1024
BUG_TEXT = "secret internal state 0xdeadbeef"
ABORT_TEXT = "caller lacks the worker.describe permission"
NODE_IP = "10.0.0.7"


@dataclass
class Gate:
    """Lets a test hold a handler mid-call: the handler sets `entered`, then waits for `release`."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class ScriptedWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    ERRORS = {
        cls.__name__: cls
        for cls in (
            errors.InvalidArgument,
            errors.NotFound,
            errors.FailedPrecondition,
            errors.ResourceExhausted,
            errors.Unavailable,
            errors.AlreadyExists,
            errors.Unauthenticated,
            errors.PermissionDenied,
        )
    }

    def __init__(self):
        self.gates: dict[str, Gate] = {}

    def DescribeNode(self, request, context):
        action = request.device_ids[0] if request.device_ids else "ok"
        if action in self.ERRORS:
            raise self.ERRORS[action](message_for(action))
        if action == "reasoned":
            raise errors.FailedPrecondition(message_for(action), reason=errors.TENSOR_NOT_HELD, field="held[x].key")
        if action == "bug":
            raise RuntimeError(BUG_TEXT)
        if action == "abort":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, ABORT_TEXT)
        if action.startswith("slow:"):
            gate = self.gates[action.removeprefix("slow:")]
            gate.entered.set()
            if not gate.release.wait(GATE_TIMEOUT_S):
                raise errors.Unavailable("test gate was never released")
        return worker_service_pb2.DescribeNodeResponse(node_ip=NODE_IP, hostname=action[:64])


def message_for(error_name: str) -> str:
    return f"device_ids[0]: {error_name} raised on purpose; send a real id"


def build_server(servicer: ScriptedWorker, **kwargs):
    """A worker's certificate; the scripted DescribeNode open to any caller the mesh CA vouches for
    (these tests are about the bootstrap, not who may call)."""
    service = Service(WORKER_SERVICE, worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)
    return create_server([service], security=CREDENTIALS.service(Role.WORKER), access={"DescribeNode": ANYONE},
                         address="127.0.0.1:0", **kwargs)


def start_server(servicer: ScriptedWorker, **kwargs):
    return build_server(servicer, **kwargs).start()


def describe(channel: grpc.Channel, *device_ids: str) -> worker_service_pb2.DescribeNodeResponse:
    stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
    return stub.DescribeNode(worker_service_pb2.DescribeNodeRequest(device_ids=device_ids), timeout=CALL_TIMEOUT_S)


def assert_serves(channel: grpc.Channel) -> None:
    assert describe(channel).node_ip == NODE_IP


def health_status(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S).status


@pytest.fixture
def servicer() -> ScriptedWorker:
    return ScriptedWorker()


@pytest.fixture
def server(servicer):
    server = start_server(servicer)
    yield server
    server.stop(0)


@pytest.fixture
def channel(server):
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield channel
    channel.close()


def test_binds_a_real_port(server):
    assert server.port > 0


def test_ok_call_returns_the_servicer_response(channel):
    response = describe(channel, "ok")
    assert (response.node_ip, response.hostname) == (NODE_IP, "ok")


@pytest.mark.parametrize(
    ("error_name", "code"),
    [
        ("InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT),
        ("NotFound", grpc.StatusCode.NOT_FOUND),
        ("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION),
        ("ResourceExhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Unavailable", grpc.StatusCode.UNAVAILABLE),
        ("AlreadyExists", grpc.StatusCode.ALREADY_EXISTS),
        ("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED),
        ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_typed_error_maps_to_status_with_its_message(channel, error_name, code):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, error_name)
    assert info.value.code() == code
    assert info.value.details() == message_for(error_name)
    assert_serves(channel)


def details_of(error: grpc.RpcError) -> tuple[list, list]:
    """The ErrorInfo and BadRequest details a failed call carries."""
    status = rpc_status.from_call(error)
    infos, requests = [], []
    for detail in status.details:
        for message, found in ((error_details_pb2.ErrorInfo(), infos), (error_details_pb2.BadRequest(), requests)):
            if detail.Unpack(message):
                found.append(message)
    return infos, requests


def test_an_error_with_a_reason_and_a_field_carries_them_as_google_rpc_details(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "reasoned")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    (reason,), (bad_request,) = details_of(info.value)
    assert (reason.reason, reason.domain) == (errors.TENSOR_NOT_HELD, "accelmesh")
    assert [(v.field, v.description) for v in bad_request.field_violations] == [("held[x].key", message_for("reasoned"))]
    assert error_reason(info.value) == errors.TENSOR_NOT_HELD


def test_an_error_without_a_reason_carries_no_error_info(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "NotFound")
    assert details_of(info.value) == ([], []) and error_reason(info.value) == ""


def test_every_error_type_has_a_row_above():
    # A new accelmesh.errors type must get a status mapping and a row in the table above.
    declared = {cls.__name__ for cls in errors.AccelmeshError.__subclasses__()}
    assert declared == set(ScriptedWorker.ERRORS)


def test_bug_becomes_internal_with_incident_id_and_no_leak(channel, caplog):
    with caplog.at_level(logging.ERROR, logger="accelmesh.runtime.errors"):
        with pytest.raises(grpc.RpcError) as info:
            describe(channel, "bug")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = info.value.details()
    assert "incident" in details
    assert BUG_TEXT not in details
    incident = re.search(r"incident ([0-9a-f]+)", details).group(1)
    # The same id leads an operator from the caller's error to the traceback in the log.
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].exc_info and BUG_TEXT in str(logged[0].exc_info[1])
    assert_serves(channel)


def test_explicit_abort_keeps_its_status(channel):
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, "abort")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == ABORT_TEXT
    assert_serves(channel)


def test_health_watchers_hold_no_server_thread(servicer):
    server = start_server(servicer, max_workers=2)
    channel = open_channel(f"127.0.0.1:{server.port}")
    watches = []
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        # Twice as many watchers as the server has threads; each call starts when it is made.
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=60) for _ in range(4)]
        assert_serves(channel)  # a thread is still free for ordinary calls (DEADLINE_EXCEEDED otherwise)
        assert [next(watch).status for watch in watches] == [health_pb2.HealthCheckResponse.SERVING] * 4
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()
        server.stop(0)


STOP_ROUNDS = 25


def test_a_server_stops_while_its_health_watchers_go_away(servicer):
    """grpcio-health-checking's servicer deadlocked here: stop() sent NOT_SERVING to the watchers
    while holding its lock, and the server's event thread, which that send waits for, waited for
    the same lock to close a cancelled watcher (accelmesh/runtime/health.py)."""
    for _ in range(STOP_ROUNDS):
        server = start_server(servicer)
        channel = open_channel(f"127.0.0.1:{server.port}")
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=60) for _ in range(4)]
        assert [next(watch).status for watch in watches] == [health_pb2.HealthCheckResponse.SERVING] * 4
        stopping = threading.Thread(target=server.stop, args=(0,))
        cancelling = threading.Thread(target=lambda: [watch.cancel() for watch in watches])
        cancelling.start()
        stopping.start()
        for thread in (cancelling, stopping):
            thread.join(GATE_TIMEOUT_S)
            assert not thread.is_alive(), "stop() hung while health watchers went away"
        channel.close()


@pytest.mark.parametrize("service", ["", WORKER_SERVICE])
def test_health_is_serving_after_start(channel, service):
    assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING


def test_health_of_unknown_service_is_not_found(channel):
    with pytest.raises(grpc.RpcError) as info:
        health_status(channel, "accelmesh.nosuch.v1.NoSuchService")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_service_health_is_not_serving_until_start(servicer):
    # Listening is not ready: only MeshServer.start() may tell probers to send traffic.
    server = build_server(servicer)
    server.server.start()  # the bare gRPC server, without MeshServer.start()
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        assert health_status(channel, WORKER_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.set_serving(True)
        assert health_status(channel, WORKER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
        server.stop(0)


def test_stop_lets_in_flight_call_finish_while_health_says_not_serving(servicer):
    server = start_server(servicer)
    channel = open_channel(f"127.0.0.1:{server.port}")
    gate = servicer.gates.setdefault("shutdown", Gate())
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=GRACE_S
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        in_flight = stub.DescribeNode.future(
            worker_service_pb2.DescribeNodeRequest(device_ids=["slow:shutdown"]), timeout=GRACE_S
        )
        assert gate.entered.wait(GATE_TIMEOUT_S), "the slow handler never started"

        # Spy on the gRPC server's stop: a signal that shutdown has begun, and the grace it got.
        grpc_stop, grpc_stop_graces, grpc_stop_called = server.server.stop, [], threading.Event()

        def spy_stop(grace):
            grpc_stop_graces.append(grace)
            shutdown = grpc_stop(grace)
            grpc_stop_called.set()
            return shutdown

        server.server.stop = spy_stop
        stopper = threading.Thread(target=server.stop, args=(GRACE_S,), daemon=True)
        stopper.start()
        # The watch stream was open before stop(), so it still delivers during the grace.
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # otherwise the open watch itself would hold the grace to its end
        assert grpc_stop_called.wait(GATE_TIMEOUT_S), "MeshServer.stop never stopped the gRPC server"
        assert grpc_stop_graces == [GRACE_S]
        assert not in_flight.done(), "the in-flight call ended before it was released"

        gate.release.set()
        response = in_flight.result(timeout=CALL_TIMEOUT_S)
        assert (response.node_ip, response.hostname) == (NODE_IP, "slow:shutdown")
        stopper.join(GRACE_S)
        assert not stopper.is_alive(), "stop() did not return once the in-flight call finished"
    finally:
        gate.release.set()
        channel.close()
        server.stop(0)


def test_stop_twice_is_harmless(servicer):
    server = start_server(servicer)
    server.stop(0)
    server.stop(0)


def test_server_refuses_calls_after_stop(servicer):
    server = start_server(servicer)
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        assert_serves(channel)
        server.stop(0)
        with pytest.raises(grpc.RpcError) as info:
            describe(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()


def reflect(channel: grpc.Channel, request: reflection_pb2.ServerReflectionRequest):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=CALL_TIMEOUT_S))
    return response


def test_reflection_lists_hosted_services(channel):
    response = reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in response.list_services_response.service}
    assert {WORKER_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_reflection_describes_the_worker_service(channel):
    response = reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=WORKER_SERVICE))
    assert not response.HasField("error_response"), response.error_response.error_message
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    worker_file = next(f for f in files if f.name == "accelmesh/worker/v1/worker_service.proto")
    assert worker_file.package == "accelmesh.worker.v1"
    assert [m.name for s in worker_file.service for m in s.method] == ["DescribeNode", "Execute"]


def test_oversized_request_is_resource_exhausted_and_server_keeps_serving(servicer):
    server = start_server(servicer, max_message_bytes=1 * MIB)
    channel = open_channel(f"127.0.0.1:{server.port}")  # the client's own limit is larger
    try:
        with pytest.raises(grpc.RpcError) as info:
            describe(channel, "x" * (2 * MIB))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert describe(channel, "y" * (MIB // 2)).node_ip == NODE_IP  # under the limit still works
    finally:
        channel.close()
        server.stop(0)
