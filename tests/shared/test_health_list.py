"""grpc.health.v1.Health/List, which reflection advertises with the rest of Health, through a real
in-process server on port 0 (the scripted worker of _server_helpers.py): every service name and
its status, as the status changes, on the mesh port and the plaintext probe port, refused past
MAX_LISTED_SERVICES; Check's answer for a name nobody could have registered, and what a watch
of such a name leaves behind."""

from __future__ import annotations

import threading

import grpc
import pytest
from _server_helpers import (  # noqa: F401  (fixtures)
    CALL_TIMEOUT_S,
    WORKER_SERVICE,
    build_server,
    channel_fixture,
    server_fixture,
    servicer_fixture,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh.runtime.health import MAX_LISTED_SERVICES, HealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def listed(channel: grpc.Channel) -> dict[str, int]:
    response = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=CALL_TIMEOUT_S)
    return {service: health.status for service, health in response.statuses.items()}


def test_list_names_the_server_and_each_service_it_hosts_with_its_status(channel):
    assert listed(channel) == {"": SERVING, WORKER_SERVICE: SERVING}


def test_list_follows_status_changes(server, channel):
    server.set_serving(False)
    assert listed(channel) == {"": NOT_SERVING, WORKER_SERVICE: NOT_SERVING}
    server.health.set(WORKER_SERVICE, SERVING)
    assert listed(channel) == {"": NOT_SERVING, WORKER_SERVICE: SERVING}


def test_the_plaintext_probe_port_lists_too(servicer):
    server = build_server(servicer, health_listen="127.0.0.1:0").start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as probe:
            assert listed(probe) == {"": SERVING, WORKER_SERVICE: SERVING}
    finally:
        server.stop(0)


def test_list_past_its_limit_is_resource_exhausted_and_check_still_answers(server, channel):
    for i in range(MAX_LISTED_SERVICES):
        server.health.set(f"accelmesh.test.v1.Service{i}", SERVING)
    with pytest.raises(grpc.RpcError) as info:
        listed(channel)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Check them by name" in info.value.details()
    check = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="accelmesh.test.v1.Service7"), timeout=CALL_TIMEOUT_S)
    assert check.status == SERVING


def test_checking_a_hundred_kilobyte_name_is_not_found_with_a_short_message(channel):
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="s" * 100_000),
                                                  timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # not RESOURCE_EXHAUSTED "metadata size exceeds"
    assert "(100000 chars)" in info.value.details() and len(info.value.details()) < 300


class CallContext:
    """What Watch uses of grpc's servicer context: the callback run when the call ends."""

    def __init__(self):
        self.on_end = []

    def add_callback(self, callback):
        self.on_end.append(callback)


def test_a_watch_of_a_made_up_name_leaves_no_entry_once_it_ends():
    # Anyone may call Watch: an entry left per name watched would grow without bound.
    health, context, sent = HealthServicer(), CallContext(), []
    health.Watch(health_pb2.HealthCheckRequest(service="made-up"), context, sent.append)
    assert [r.status for r in sent] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
    for callback in context.on_end:
        callback()
    assert sent[-1] is None and health._watchers == {}


def test_a_server_going_not_serving_waits_for_its_watchers_once_not_once_per_name(server, monkeypatch):
    """A stop() under load once took over 5 s: each of a server's names ('' and every service) was
    set apart, and each waited up to DELIVERY_WAIT_S for a send that grpcio can leave hanging. Every
    name's watchers are now sent their status on one delivery, waited for once."""
    import accelmesh.runtime.health as health

    joins: list[float | None] = []

    class Delivery(threading.Thread):
        def join(self, timeout=None):
            joins.append(timeout)
            super().join(timeout)

    monkeypatch.setattr(health.threading, "Thread", Delivery)
    sent: list[tuple[str, int]] = []
    for name in ("", WORKER_SERVICE):
        server.health._watchers[name] = {lambda response, name=name: sent.append((name, response.status))}
    server.set_serving(False)
    assert joins == [health.DELIVERY_WAIT_S]
    assert sent == [("", NOT_SERVING), (WORKER_SERVICE, NOT_SERVING)]
    for name in ("", WORKER_SERVICE):
        server.health._watchers.pop(name)
