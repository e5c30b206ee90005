"""Shared by the server bootstrap tests (test_runtime_server*.py): a real in-process server on
port 0 hosting the real WorkerService contract through a scripted servicer, whose DescribeNode
takes the first device id of a request as what to do (raise an error, abort, or block on a gate).
A module of its own, not a conftest.py: a second conftest.py would shadow the top-level one that
tests import as `conftest`. Each fixture is defined as `<name>_fixture` with name="<name>", so a
test module that imports it can take `<name>` as a parameter without shadowing the import."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc
import pytest

from accelmesh import errors
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import ANYONE
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc

from conftest import CREDENTIALS

WORKER_SERVICE = "accelmesh.worker.v1.WorkerService"
CALL_TIMEOUT_S = 5.0
GATE_TIMEOUT_S = 5.0
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
            errors.Cancelled,
            errors.DeadlineExceeded,
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
                         **{"address": "127.0.0.1:0", **kwargs})


def start_server(servicer: ScriptedWorker, **kwargs):
    return build_server(servicer, **kwargs).start()


def describe(channel: grpc.Channel, *device_ids: str) -> worker_service_pb2.DescribeNodeResponse:
    stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
    return stub.DescribeNode(worker_service_pb2.DescribeNodeRequest(device_ids=device_ids), timeout=CALL_TIMEOUT_S)


def assert_serves(channel: grpc.Channel) -> None:
    assert describe(channel).node_ip == NODE_IP


@pytest.fixture(name="servicer")
def servicer_fixture() -> ScriptedWorker:
    return ScriptedWorker()


@pytest.fixture(name="server")
def server_fixture(servicer):
    server = start_server(servicer)
    yield server
    server.stop(0)


@pytest.fixture(name="channel")
def channel_fixture(server):
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield channel
    channel.close()
