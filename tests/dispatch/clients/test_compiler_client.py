"""The dispatcher's compile client (dispatch_svc/clients/compiler.py) against a real gRPC server
over a socket, with the mesh's certificates: a scripted CompileService whose FetchParameters
stream a replica can cut off midway, as the chaos soak (bench/chaos.py) does by killing one."""

from __future__ import annotations

import numpy as np
import pytest

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import split
from accelmesh.security.access import ANYONE
from accelmesh.security.identity import Role
from dispatch_svc.clients import calls
from dispatch_svc.clients.compiler import GrpcCompiler

from conftest import CREDENTIALS
from fakes.ports import AFFINE

LEAVES = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1.0, -2.0, 0.5, 3.0], np.float32)}
CHUNK_BYTES = 16  # w takes three chunks: a stream cut after its first message holds a part of it


class CutOffCompiler(compile_service_pb2_grpc.CompileServiceServicer):
    """FetchParameters streams LEAVES; its first `cut` calls end UNAVAILABLE after the first
    message, as a stream whose replica was killed does (gRPC no longer retries it by then)."""

    def __init__(self, cut: int):
        self.cut = cut
        self.requests: list[compile_pb.FetchParametersRequest] = []

    def FetchParameters(self, request, context):
        self.requests.append(request)
        sent = 0
        for name, value in LEAVES.items():
            header, chunks = split(name, value, CHUNK_BYTES)
            for message in (compile_pb.FetchParametersResponse(tensor=header),
                            *(compile_pb.FetchParametersResponse(chunk=c) for c in chunks)):
                if sent == 1 and len(self.requests) <= self.cut:
                    raise errors.Unavailable("the compile replica went away")
                yield message
                sent += 1


@pytest.fixture
def serve(monkeypatch):
    """Start a CutOffCompiler on port 0; yields a function of `cut` that returns (servicer, client)."""
    monkeypatch.setattr(calls, "REPLICA_RETRY_S", 0.0)  # asked again at once: no test waits on a backoff
    opened = []

    def start(cut: int) -> tuple[CutOffCompiler, GrpcCompiler]:
        servicer = CutOffCompiler(cut)
        service = Service("accelmesh.compile.v1.CompileService",
                          compile_service_pb2_grpc.add_CompileServiceServicer_to_server, servicer)
        server = create_server([service], security=CREDENTIALS.service(Role.COMPILE),
                               access={"FetchParameters": ANYONE}).start()
        client = GrpcCompiler(f"127.0.0.1:{server.port}", CREDENTIALS.service(Role.DISPATCH),
                              max_message_bytes=1 << 20)
        opened.append((server, client))
        return servicer, client

    yield start
    for server, client in opened:
        client.close()
        server.stop(0)


def test_parameters_cut_off_midway_by_a_replica_going_away_are_fetched_whole_again(serve):
    servicer, client = serve(cut=1)
    leaves = client.fetch_parameters(AFFINE, seed=7)
    assert len(servicer.requests) == 2  # cut off once, then asked again whole
    assert all(r.program == "affine" and r.version == "1" and r.seed == 7 for r in servicer.requests)
    assert len(leaves) == len(LEAVES)
    for got, want in zip(leaves, LEAVES.values()):
        np.testing.assert_array_equal(got, want)


def test_a_fetch_cut_off_on_every_attempt_fails_unavailable_after_the_replica_attempts(serve):
    servicer, client = serve(cut=calls.REPLICA_ATTEMPTS)
    with pytest.raises(errors.Unavailable, match="compile service parameters"):
        client.fetch_parameters(AFFINE, seed=7)
    assert len(servicer.requests) == calls.REPLICA_ATTEMPTS
