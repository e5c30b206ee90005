"""The server bootstrap's lifecycle, through a real in-process server on port 0: binding a port,
health (checks, watchers, not serving until start), graceful shutdown, reflection and
message-size limits. The scripted servicer and fixtures are in _server_helpers.py; the error
mapping is tested in test_runtime_server_errors.py.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from _server_helpers import (  # noqa: F401  (fixtures)
    CALL_TIMEOUT_S,
    GATE_TIMEOUT_S,
    NODE_IP,
    WORKER_SERVICE,
    Gate,
    assert_serves,
    build_server,
    channel_fixture,
    describe,
    server_fixture,
    servicer_fixture,
    start_server,
)
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from accelmesh.runtime.channels import open_channel
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc

GRACE_S = 10.0  # generous: the shutdown test releases the call long before it runs out
MIB = 1024 * 1024


def health_status(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S).status


def test_binds_a_real_port(server):
    assert server.port > 0


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
        # run and joined within this iteration; the default only makes the binding explicit
        cancelling = threading.Thread(target=lambda watches=watches: [watch.cancel() for watch in watches])
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
    assert [m.name for s in worker_file.service for m in s.method] == [
        "DescribeNode", "Execute", "ExecuteMany", "ReleaseJob", "PutObjects", "FetchObjects", "MapObjects",
        "SealObjects", "ReleaseObjects"]


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


@pytest.mark.parametrize("flag", ["address", "health_listen"])
def test_a_port_in_use_is_one_line_naming_the_flag_not_a_traceback(flag):
    """What `accelmesh up` shows when a port it wants is taken (grpcio itself raises a RuntimeError)."""
    from _server_helpers import ScriptedWorker, build_server

    from accelmesh import errors

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(errors.FailedPrecondition) as refused:
            build_server(ScriptedWorker(), **({"health_listen": address} if flag == "health_listen" else {}),
                         **({} if flag == "health_listen" else {"address": address}))
    named = "--health-listen" if flag == "health_listen" else "--listen"
    assert str(refused.value) == (f"could not listen on {address}: the port is in use (or the address is not one of "
                                  f"this machine's); stop what holds it, or give {named} another port")
