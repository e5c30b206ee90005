"""Admission (accelmesh/runtime/admission.py) through a real server: idle streams take no work
thread and no health thread, the stream limits refuse with a message naming the variable and
details a program reads, and no principal's streams leave none for the others."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import grpc
import pytest
from _server_helpers import NODE_IP, WORKER_SERVICE, ScriptedWorker, describe
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from accelmesh import errors
from accelmesh.runtime.admission import (
    MAX_STREAMS_ENV,
    MAX_STREAMS_PER_CLIENT_ENV,
    Admission,
)
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import ANYONE
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc

from conftest import CREDENTIALS, as_role

WAIT_S = 30.0


class StreamingWorker(ScriptedWorker):
    """DescribeNode as the scripted worker's; Execute holds its stream open until the client ends it."""

    def __init__(self):
        super().__init__()
        self.received = 0

    def Execute(self, request_iterator, context):
        for _ in request_iterator:
            self.received += 1
        return iter(())


class IdleStream:
    """An Execute call whose client sends nothing until closed."""

    def __init__(self, channel: grpc.Channel):
        self._requests: queue.Queue = queue.Queue()
        self.call = worker_service_pb2_grpc.WorkerServiceStub(channel).Execute(iter(self._requests.get, None),
                                                                              timeout=120)

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def serve(admission: Admission, max_workers: int = 2):
    service = Service(WORKER_SERVICE, worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, StreamingWorker())
    return create_server([service], security=CREDENTIALS.service(Role.WORKER),
                         access={"DescribeNode": ANYONE, "Execute": ANYONE}, address="127.0.0.1:0",
                         max_workers=max_workers, admission=admission).start()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def refusal(channel: grpc.Channel) -> grpc.RpcError:
    stream = IdleStream(channel)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            next(stream.call)
        return caught.value
    finally:
        stream.close()


@pytest.fixture(name="streams")
def streams_fixture():
    opened: list[IdleStream] = []
    yield opened
    for stream in opened:
        stream.close()


def test_idle_streams_take_neither_work_nor_health_threads(streams):
    server = serve(Admission(), max_workers=2)
    channel = open_channel(f"127.0.0.1:{server.port}", **as_role(Role.DISPATCH))
    try:
        streams.extend(IdleStream(channel) for _ in range(40))  # 20 times the work threads
        wait_until(lambda: server.streams.open == 40, "the server holds all 40 streams open")
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert describe(channel).node_ip == NODE_IP  # a work thread is free
        # Unary work on both threads at once, still beside the 40 streams.
        results = []
        threads = [threading.Thread(target=lambda: results.append(describe(channel).node_ip)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert results == [NODE_IP] * 4
    finally:
        for stream in streams:
            stream.close()
        wait_until(lambda: server.streams.open == 0, "every stream is released")
        channel.close()
        server.stop(0)


def person(name: str) -> dict:
    """Open-channel keywords for calling as a user of its own (a token naming `name`)."""
    return {"security": CREDENTIALS.client(CREDENTIALS.add_user(name))}


@contextlib.contextmanager
def clients(admission: Admission, *callers: dict):
    """A server with these limits, and a channel to it for each caller's credentials."""
    server = serve(admission)
    channels = [open_channel(f"127.0.0.1:{server.port}", **caller) for caller in callers]
    try:
        yield server, *channels
    finally:
        for channel in channels:
            channel.close()
        server.stop(0)


def details(refused: grpc.RpcError) -> tuple[dict, list[str]]:
    """The ErrorInfo metadata and the QuotaFailure subjects of a refusal."""
    status = rpc_status.from_call(refused)
    metadata, subjects = {}, []
    for detail in status.details:
        info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
        if detail.Unpack(info):
            metadata = dict(info.metadata)
        elif detail.Unpack(quota):
            subjects += [v.subject for v in quota.violations]
    return metadata, subjects


def test_a_client_over_its_stream_limit_is_refused_and_others_are_not(streams):
    with clients(Admission(max_streams_per_client=3), person("limit-ann"), person("limit-bob")) as (
            server, first, second):
        streams.extend(IdleStream(first) for _ in range(3))
        wait_until(lambda: server.streams.open == 3, "three streams are open")
        refused = refusal(first)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert MAX_STREAMS_PER_CLIENT_ENV in refused.details() and "3 open streams" in refused.details()
        assert error_reason(refused) == errors.STREAM_SHARE
        assert details(refused) == ({"limit": "3", "held": "3", "variable": MAX_STREAMS_PER_CLIENT_ENV},
                                    ["principal:user:limit-ann"])
        streams.append(IdleStream(second))  # another principal has its own allowance
        wait_until(lambda: server.streams.open == 4, "the second client's stream is open")
        streams.pop(0).close()  # a closed stream gives its slot back
        wait_until(lambda: server.streams.open == 3, "the closed stream is released")
        streams.append(IdleStream(first))
        wait_until(lambda: server.streams.open == 4, "the first client may open one again")


def test_idle_streams_of_two_principals_leave_streams_for_a_third(streams):
    """Two principals opening idle streams past the service's limit hold half of it and half the
    rest (8 and 4 of 16): a third still gets its streams, and a principal past its share is
    refused saying how many are free, with the share and its variable as details."""
    with clients(Admission(max_streams=16, max_streams_per_client=16), person("share-ann"), person("share-bob"),
                 person("share-cy")) as (server, ann, bob, cy):
        for channel, name, share in ((ann, "share-ann", 8), (bob, "share-bob", 4)):
            streams.extend(IdleStream(channel) for _ in range(share))
            wait_until(lambda share=share, name=name: server.streams.held(f"user:{name}") == share,
                       f"{name} holds {share} streams")
            refused = refusal(channel)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(refused) == errors.STREAM_SHARE
            assert f"only {share} of its 16 ({MAX_STREAMS_ENV}) are free" in refused.details()
            assert details(refused) == ({"limit": str(share), "held": str(share), "variable": MAX_STREAMS_ENV},
                                        [f"principal:user:{name}"])
        streams.extend(IdleStream(cy) for _ in range(2))
        wait_until(lambda: server.streams.held("user:share-cy") == 2, "the third principal's streams are open")
        assert describe(cy).node_ip == NODE_IP


def test_the_mesh_services_take_no_share_of_the_streams_but_count_toward_the_limit(streams):
    with clients(Admission(max_streams=4, max_streams_per_client=1), as_role(Role.DISPATCH),
                 person("exempt-ann")) as (server, dispatch, ann):
        streams.extend(IdleStream(dispatch) for _ in range(4))
        wait_until(lambda: server.streams.open == 4, "the dispatcher holds every stream")
        refused = refusal(ann)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(refused) == errors.STREAM_LIMIT
        assert details(refused) == ({"limit": "4", "open": "4", "variable": MAX_STREAMS_ENV}, ["service"])


def test_a_service_over_its_stream_limit_refuses_everyone_but_still_answers_unary_calls(streams):
    with clients(Admission(max_streams=2), as_role(Role.DISPATCH), as_role(Role.INVENTORY)) as (
            server, first, second):
        streams.extend(IdleStream(first) for _ in range(2))
        wait_until(lambda: server.streams.open == 2, "two streams are open")
        refused = refusal(second)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert MAX_STREAMS_ENV + " " in refused.details() + " "
        assert describe(second).node_ip == NODE_IP


def test_limits_come_from_the_environment_and_bad_values_name_the_variable():
    admission = Admission.from_env({MAX_STREAMS_ENV: "7", MAX_STREAMS_PER_CLIENT_ENV: "3"})
    assert (admission.max_streams, admission.max_streams_per_client) == (7, 3)
    assert admission.maximum_concurrent_rpcs > admission.max_streams + admission.max_unary_in_flight
    with pytest.raises(errors.InvalidArgument, match=MAX_STREAMS_ENV):
        Admission.from_env({MAX_STREAMS_ENV: "many"})
    with pytest.raises(errors.InvalidArgument, match=MAX_STREAMS_PER_CLIENT_ENV):
        Admission.from_env({MAX_STREAMS_PER_CLIENT_ENV: "0"})


def test_a_request_message_reaches_a_counted_stream():
    """Admission changes where a stream runs, not what it carries: a request sent on a stream arrives."""
    server = serve(Admission())
    channel = open_channel(f"127.0.0.1:{server.port}", **as_role(Role.DISPATCH))
    try:
        responses = worker_service_pb2_grpc.WorkerServiceStub(channel).Execute(
            iter([worker_service_pb2.ExecuteRequest()]), timeout=10)
        assert list(responses) == []
        assert server.services[0].servicer.received == 1
        wait_until(lambda: server.streams.open == 0, "the finished stream is released")
    finally:
        channel.close()
        server.stop(0)
