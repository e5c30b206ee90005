"""Per-node worker certificates: each worker's own, issued for its host, and the host checked
wherever a worker is dialled (the inventory's poll, the dispatcher's worker channel). The "other
host" is another loopback address (Linux routes all of 127/8 to lo): a worker whose certificate
was issued for 127.0.0.2 serves on 127.0.0.3. In-process servers on port 0, no mesh."""

from __future__ import annotations

import stat

import grpc
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import split
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role, certificate_identity, node_host
from accelmesh.security.tls import peer_certificate_names
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.workers import GrpcWorkers
from dispatch_svc.ports import ArtifactRef, Build, JobDevice
from inventory_svc.node_client import NodeClient
from worker_svc.server import ACCESS as WORKER_ACCESS

from conftest import CREDENTIALS
from fakes.worker_streams import shards

HOST_A, HOST_B = "127.0.0.2", "127.0.0.3"


class NodeWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Describes itself as HOST_B and answers every shard with one small output."""

    def DescribeNode(self, request, context):
        return worker_pb.DescribeNodeResponse(node_ip=HOST_B, hostname="b")

    def ExecuteMany(self, request_iterator, context):
        for _header, _inputs in shards(request_iterator):
            tensor, chunks = split("output_0", np.arange(4, dtype=np.float32), 4096)
            yield worker_pb.ExecuteManyResponse(tensor=tensor)
            for chunk in chunks:
                yield worker_pb.ExecuteManyResponse(chunk=chunk)
            yield worker_pb.ExecuteManyResponse(timings=worker_pb.ShardTimings(execute_seconds=0.001))


@pytest.fixture(params=["issued for host A", "its own, for host B"])
def worker_on_b(request):
    """A worker serving on HOST_B, with a certificate issued for HOST_A or for HOST_B."""
    security = (CREDENTIALS.issue(Role.WORKER, f"node-{HOST_A}", [HOST_A]) if request.param == "issued for host A"
                else CREDENTIALS.worker(HOST_B))
    server = create_server([Service("accelmesh.worker.v1.WorkerService",
                                    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, NodeWorker())],
                           security=security, access=WORKER_ACCESS, address=f"{HOST_B}:0").start()
    yield request.param == "issued for host A", f"{HOST_B}:{server.port}"
    server.stop(0)


def _send_shard(workers: GrpcWorkers, address: str):
    device = JobDevice(type("Spec", (), {"id": f"{HOST_B}/cpu:0"})(), address, "t")
    artifact = ArtifactRef("k", "d", "stablehlo", 16)
    build = Build("t", "rule", "float32", build_pb.Rule(), (device.id,), artifact, {})
    return workers.execute("job", 0, 1, device, build, artifact, [("x", np.zeros(4, np.float32))], 4, CancelScope())


def _assert_names_the_mismatch(message: str, address: str) -> None:
    assert address in message and node_host(Role.WORKER, HOST_B) in message, message
    assert f"spiffe://accelmesh/worker/node-{HOST_A}" in message and HOST_A in message, message
    assert "a certificate of its own" in message, message


def test_the_inventory_polls_only_a_worker_whose_certificate_names_the_host_it_dials(worker_on_b):
    """One node's worker certificate does not let it answer the inventory's poll as another node."""
    foreign, address = worker_on_b
    client = NodeClient(CREDENTIALS.service(Role.INVENTORY))
    try:
        if foreign:
            with pytest.raises(errors.Unavailable) as info:
                client.describe(address)
            assert "UNAVAILABLE" in str(info.value)
            _assert_names_the_mismatch(str(info.value), address)
        else:
            assert client.describe(address).ip == HOST_B
    finally:
        client.close()


def test_the_dispatcher_sends_shards_only_to_a_worker_whose_certificate_names_the_host_it_dials(worker_on_b):
    """One node's worker certificate does not let it take, and answer, another node's shards."""
    foreign, address = worker_on_b
    workers = GrpcWorkers(CREDENTIALS.service(Role.DISPATCH), max_message_bytes=1 << 22, chunk_bytes=4096)
    try:
        if foreign:
            with pytest.raises(ShardFailed) as info:
                _send_shard(workers, address)
            assert info.value.cause.startswith("UNAVAILABLE: "), info.value.cause
            _assert_names_the_mismatch(info.value.cause, address)
            stub = worker_service_pb2_grpc.WorkerServiceStub(workers._channels.get(address))
            with pytest.raises(grpc.RpcError) as refused:
                stub.DescribeNode(worker_pb.DescribeNodeRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        else:
            np.testing.assert_array_equal(_send_shard(workers, address).outputs[0], np.arange(4, dtype=np.float32))
    finally:
        workers.close()


def test_a_worker_certificate_is_issued_per_node_naming_its_host_role_and_node_only(tmp_path):
    credentials = MeshCredentials(tmp_path / "credentials")
    tls = credentials.worker(HOST_B).tls
    identity = certificate_identity(tls.cert_file.read_bytes())
    assert (identity.role, identity.name) == (Role.WORKER, f"node-{HOST_B}")
    assert identity.names_host(HOST_B) and identity.names_host(node_host(Role.WORKER, HOST_B))
    assert not identity.names_host("127.0.0.1") and not identity.names_host(HOST_A)
    assert stat.S_IMODE(tls.key_file.stat().st_mode) == 0o600
    assert credentials.worker(HOST_B).tls.cert_file.read_bytes() == tls.cert_file.read_bytes()  # kept
    assert credentials.worker(HOST_A).tls.cert_file != tls.cert_file


def test_a_kept_service_certificate_missing_a_host_it_must_now_name_is_issued_again_with_both(tmp_path):
    MeshCredentials(tmp_path, hosts=["10.0.0.5"])
    credentials = MeshCredentials(tmp_path, hosts=["10.0.0.6"])
    identity = certificate_identity(credentials.files("inventory").cert_file.read_bytes())
    assert {"10.0.0.5", "10.0.0.6", "127.0.0.1", "inventory.accelmesh.internal"} <= identity.hosts


def test_the_ca_derives_the_mesh_names_and_takes_none_from_a_caller(tmp_path):
    """No certificate of one role can carry a name another role's channels verify."""
    with pytest.raises(errors.InvalidArgument, match="accelmesh.internal"):
        MeshCredentials(tmp_path).issue(Role.COMPILE, "c", [node_host(Role.WORKER, HOST_B)])


def test_the_names_a_server_presents_are_read_for_messages(worker_on_b):
    foreign, address = worker_on_b
    names = peer_certificate_names(address, CREDENTIALS.service(Role.DISPATCH).tls)
    assert (HOST_A if foreign else HOST_B) in names
    assert peer_certificate_names(f"{HOST_B}:1", CREDENTIALS.service(Role.DISPATCH).tls) is None


def test_a_credentials_folder_names_an_ipv6_node_in_a_name_dns_can_hold(tmp_path):
    credentials = MeshCredentials(tmp_path)
    identity = certificate_identity(credentials.worker("fd00::7").tls.cert_file.read_bytes())
    assert "fd00:0000:0000:0000:0000:0000:0000:0007" not in identity.hosts
    assert "fd00-0000-0000-0000-0000-0000-0000-0007.worker.accelmesh.internal" in identity.hosts
    assert identity.names_host("fd00::7")
