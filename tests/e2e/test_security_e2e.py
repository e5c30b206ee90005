"""A mesh that lets no one in, through real processes: plaintext and foreign certificates are
refused by every process, people need a token, each role calls only what it may, one user's jobs
are invisible to another, nodes register only as themselves, and a worker takes artifacts only
from its own compile service."""

from __future__ import annotations

import pickle

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh import artifacts
from accelmesh import errors as mesh_errors
from accelmesh.client import MeshClient
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.embedded import start_embedded_mesh, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import TensorCollector, split
from accelmesh.security.config import Security
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role
from accelmesh.security.tls import TlsFiles
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.server import ACCESS as COMPILE_ACCESS

from conftest import CREDENTIALS, rpc_error
from fakes.worker_streams import shards

pytestmark = pytest.mark.slow

TIMEOUT_S = 20
ROWS = 16


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb",)) as running:
        yield running


@pytest.fixture(scope="module")
def people():
    """Two users with tokens of their own, and what each connects with."""
    return {name: CREDENTIALS.client(CREDENTIALS.add_user(name)) for name in ("alice", "bob")}


def addresses(mesh) -> dict[str, str]:
    return {"inventory": mesh.inventory.address, "compile": mesh.compile.address,
            "dispatch": mesh.dispatch.address, "worker": mesh.workers[0].address}


def health(address: str, channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("process", ["inventory", "compile", "dispatch", "worker"])
def test_plaintext_and_a_foreign_ca_are_refused_by_every_process(mesh, tmp_path, process):
    address = addresses(mesh)[process]
    with grpc.insecure_channel(address) as plaintext:
        assert health(address, plaintext) == grpc.StatusCode.UNAVAILABLE
    stranger = MeshCredentials(tmp_path / "elsewhere").files("client")  # a CA of its own, trusting the real one
    foreign = Security(TlsFiles(CREDENTIALS.ca.cert_file, stranger.cert_file, stranger.key_file))
    with open_channel(address, security=foreign) as channel:
        assert health(address, channel) == grpc.StatusCode.UNAVAILABLE
    with open_channel(address, security=CREDENTIALS.client()) as channel:
        assert health(address, channel) == grpc.StatusCode.OK  # the door itself works


def test_a_tls_client_without_a_token_is_unauthenticated(mesh):
    anonymous = CREDENTIALS.client().without_token()
    calls = [
        (dispatch_service_pb2_grpc.DispatchServiceStub, mesh.dispatch.address, "ListJobs", pb.ListJobsRequest()),
        (inventory_service_pb2_grpc.InventoryServiceStub, mesh.inventory.address, "ListDevices",
         inv_pb.ListDevicesRequest()),
        (compile_service_pb2_grpc.CompileServiceStub, mesh.compile.address, "ListPrograms",
         compile_pb.ListProgramsRequest()),
    ]
    for stub_class, address, method, request in calls:
        with open_channel(address, security=anonymous) as channel:
            error = rpc_error(getattr(stub_class(channel), method), request, timeout=TIMEOUT_S)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert "Bearer" in error.details()


def test_a_user_may_not_act_as_a_service_or_an_operator(mesh, people):
    alice = people["alice"]
    with open_channel(mesh.inventory.address, security=alice) as channel:
        inventory = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        denied = [rpc_error(inventory.RegisterNode, inv_pb.RegisterNodeRequest(address=mesh.workers[0].address)),
                  rpc_error(inventory.ReserveDevices, inv_pb.ReserveDevicesRequest(job_id="mine"))]
    with open_channel(mesh.compile.address, security=alice) as channel:
        upload = compile_service_pb2_grpc.CompileServiceStub(channel).UploadProgram
        denied.append(rpc_error(upload, iter([compile_pb.UploadProgramRequest()]), timeout=TIMEOUT_S))
    with open_channel(mesh.workers[0].address, security=alice) as channel:
        execute = worker_service_pb2_grpc.WorkerServiceStub(channel).Execute
        denied.append(rpc_error(lambda: list(execute(iter([worker_pb.ExecuteRequest()]), timeout=TIMEOUT_S))))
    assert [e.code() for e in denied] == [grpc.StatusCode.PERMISSION_DENIED] * 4
    assert "needs the role worker" in denied[0].details() and "'alice' (token) has user" in denied[0].details()


def test_one_users_jobs_are_not_found_by_another(mesh, people):
    inputs = {"x": np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)}
    with MeshClient(mesh.dispatch.address, security=people["alice"]) as alice:
        job_id = alice.run("mlp_classifier", inputs).job.job_id
        assert job_id in [j.job_id for j in alice.stub.ListJobs(pb.ListJobsRequest()).jobs]
    with open_channel(mesh.dispatch.address, security=people["bob"]) as channel:
        bob = dispatch_service_pb2_grpc.DispatchServiceStub(channel)
        errors = [
            rpc_error(bob.GetJob, pb.GetJobRequest(job_id=job_id)),
            rpc_error(lambda: list(bob.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=TIMEOUT_S))),
            rpc_error(lambda: list(bob.FetchResult(pb.FetchResultRequest(job_id=job_id), timeout=TIMEOUT_S))),
            rpc_error(bob.CancelJob, pb.CancelJobRequest(job_id=job_id)),
        ]
        unknown = rpc_error(bob.GetJob, pb.GetJobRequest(job_id="0" * 16))
        listed = bob.ListJobs(pb.ListJobsRequest()).jobs
    assert [e.code() for e in errors] == [grpc.StatusCode.NOT_FOUND] * 4
    assert {e.details().replace(job_id, "<id>") for e in errors} == {unknown.details().replace("0" * 16, "<id>")}
    assert job_id not in [j.job_id for j in listed]
    with MeshClient(mesh.dispatch.address, security=CREDENTIALS.client()) as operator:  # operators see all
        job = operator.stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
    assert job.owner == "user:alice"


def test_only_a_worker_certificate_naming_the_node_registers_it(mesh):
    address = mesh.workers[0].address
    attempts = {
        "the dispatcher": CREDENTIALS.service(Role.DISPATCH),
        "the operator": CREDENTIALS.client(),
        "a worker of another host": CREDENTIALS.issue(Role.WORKER, "node-9", ["10.9.9.9"]),
    }
    for who, security in attempts.items():
        with open_channel(mesh.inventory.address, security=security) as channel:
            stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
            error = rpc_error(stub.RegisterNode, inv_pb.RegisterNodeRequest(address=address))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, who
    with open_channel(mesh.inventory.address, security=CREDENTIALS.service(Role.WORKER)) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        assert stub.RegisterNode(inv_pb.RegisterNodeRequest(address=address)).node.address == address


def test_the_worker_contract_names_no_artifact_source():
    """Nothing a caller sends can choose where a worker fetches code from: the field that did is gone."""
    fields = worker_pb.ShardHeader.DESCRIPTOR.fields_by_name
    assert "compile_address" not in fields
    assert not [f for f in fields if "address" in f]


def _build(mesh, device) -> compile_pb.CompileResponse:
    """mlp_classifier built for `device`, as the operator may."""
    with open_channel(mesh.compile.address, security=CREDENTIALS.client()) as channel:
        request = compile_pb.CompileRequest(program="mlp_classifier", targets=[device], batch_sizes=[ROWS])
        return compile_service_pb2_grpc.CompileServiceStub(channel).Compile(request, timeout=120)


def _device(mesh):
    with open_channel(mesh.inventory.address, security=CREDENTIALS.client()) as channel:
        devices = inventory_service_pb2_grpc.InventoryServiceStub(channel).ListDevices(inv_pb.ListDevicesRequest())
    return next(d for d in devices.devices if d.node_address == mesh.workers[0].address)


def _execute(address: str, security: Security, header: worker_pb.ShardHeader, parts):
    """(the call's error or None, its outputs)."""
    with open_channel(address, security=security, role=Role.WORKER) as channel:
        call = worker_service_pb2_grpc.WorkerServiceStub(channel).Execute
        try:
            responses = list(call(iter([worker_pb.ExecuteRequest(header=header), *parts]), timeout=120))
        except grpc.RpcError as exc:
            return exc, {}
    return None, TensorCollector().collect(r for r in responses if r.WhichOneof("part") in ("tensor", "chunk"))


def _header(device, build, **fields) -> worker_pb.ShardHeader:
    artifact = build.executables[0] if build.executables else build.portable
    return worker_pb.ShardHeader(job_id="job-1", shard_index=0, attempt=1, device_id=device.id,
                                 target_type=build.target_type, artifact_key=artifact.key,
                                 artifact_digest=artifact.digest, artifact_format=artifact.format, rule=build.rule,
                                 batch_size=ROWS, **fields)


def _tensor_parts(name: str, value: np.ndarray) -> list[worker_pb.ExecuteRequest]:
    header, chunks = split(name, value, 1 << 20)
    return [worker_pb.ExecuteRequest(tensor=header), *(worker_pb.ExecuteRequest(chunk=c) for c in chunks)]


def test_a_held_tensor_serves_only_the_dispatcher_that_kept_it(mesh):
    device = _device(mesh)
    (build,) = _build(mesh, device).builds
    with open_channel(mesh.compile.address, security=CREDENTIALS.client()) as channel:
        fetched = compile_service_pb2_grpc.CompileServiceStub(channel).FetchParameters(
            compile_pb.FetchParametersRequest(program="mlp_classifier", seed=0), timeout=60)
        params = list(TensorCollector().collect(fetched).items())
    x = np.random.default_rng(3).standard_normal((ROWS, 64)).astype(np.float32)
    keep = [worker_pb.TensorRef(name=name, key=f"params:{name}") for name, _ in params]
    count = len(params) + 1

    def inputs(values):
        return [part for name, value in values for part in _tensor_parts(name, value)] + _tensor_parts("x", x)

    ours, address = CREDENTIALS.service(Role.DISPATCH), mesh.workers[0].address
    error, kept = _execute(address, ours, _header(device, build, input_count=count, keep_tensors=keep), inputs(params))
    assert error is None
    refs = [worker_pb.ExecuteRequest(held=ref) for ref in keep] + _tensor_parts("x", x)
    other = CREDENTIALS.issue(Role.DISPATCH, "dispatch-b")  # another dispatcher naming the same job and keys
    error, _ = _execute(address, other, _header(device, build, input_count=count), refs)
    assert error is not None and error.code() == grpc.StatusCode.FAILED_PRECONDITION  # cannot use ours
    assert "TENSOR_NOT_HELD" in str(error.trailing_metadata())
    zeros = [(name, np.zeros_like(value)) for name, value in params]  # and keeping its own replaces nothing of ours
    keeping = _header(device, build, input_count=count, keep_tensors=keep)
    assert _execute(address, other, keeping, inputs(zeros))[0] is None
    error, again = _execute(address, ours, _header(device, build, input_count=count), refs)
    assert error is None and kept and all(np.array_equal(again[name], value) for name, value in kept.items())


class RogueCompile(compile_service_pb2_grpc.CompileServiceServicer):
    """Would serve a pickle that runs code on load; counts the calls that reach it."""

    def __init__(self):
        self.calls = 0

    def FetchArtifact(self, request, context):
        self.calls += 1
        yield compile_pb.FetchArtifactResponse(chunk=pickle.dumps(_Marker()))


class _Marker:
    def __reduce__(self):
        return (open, ("/tmp/accelmesh-rogue-marker", "w"))


@pytest.mark.parametrize("who", ["another CA", "a mesh certificate of another role"])
def test_a_rogue_compile_service_is_never_a_workers_artifact_source(mesh, tmp_path, who):
    rogue = RogueCompile()
    identity = (MeshCredentials(tmp_path / "rogue-ca").service(Role.COMPILE) if who == "another CA"
                else CREDENTIALS.service(Role.WORKER))
    server = create_server([Service("accelmesh.compile.v1.CompileService",
                                    compile_service_pb2_grpc.add_CompileServiceServicer_to_server, rogue)],
                           security=identity, access=COMPILE_ACCESS).start()
    worker = start_worker(mesh.inventory.address, f"127.0.0.1:{server.port}", CREDENTIALS, devices=1,
                          artifact_dir=tmp_path / "artifacts", nvml=False, name="worker-with-rogue")
    try:
        with open_channel(worker.address, security=CREDENTIALS.service(Role.INVENTORY)) as channel:
            (device,) = worker_service_pb2_grpc.WorkerServiceStub(channel).DescribeNode(
                worker_pb.DescribeNodeRequest(), timeout=TIMEOUT_S).devices
        (build,) = _build(mesh, device).builds
        error, _ = _execute(worker.address, CREDENTIALS.service(Role.DISPATCH),
                            _header(device, build, input_count=0), [])
    finally:
        worker.terminate()
        server.stop(0)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert rogue.calls == 0


def test_an_artifact_that_would_run_code_on_load_is_refused(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(type("Payload", (), {"__reduce__": lambda self: (open, (str(marker), "w"))})())
    with pytest.raises(mesh_errors.InvalidArgument, match="not an accelmesh executable"):
        artifacts.load_executable(payload)
    assert not marker.exists()


class ForgingWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """A node with a legitimate worker certificate that answers every shard with half its rows."""

    def __init__(self, description: worker_pb.DescribeNodeResponse):
        self.description, self.shards = description, 0

    def DescribeNode(self, request, context):
        wanted = set(request.device_ids)
        devices = [d for d in self.description.devices if not wanted or d.id in wanted]
        return worker_pb.DescribeNodeResponse(node_ip=self.description.node_ip, hostname="forger", devices=devices)

    def ExecuteMany(self, request_iterator, context):
        for header, _ in shards(request_iterator):
            yield from self._forged(header)

    def _forged(self, header: worker_pb.ShardHeader):
        self.shards += 1
        forged = np.full((max(1, header.batch_size // 2), 10), 42.0, np.float32)
        tensor, chunks = split("logits", forged, 1 << 20)
        yield worker_pb.ExecuteManyResponse(tensor=tensor)
        yield from (worker_pb.ExecuteManyResponse(chunk=c) for c in chunks)
        yield worker_pb.ExecuteManyResponse(timings=worker_pb.ShardTimings(execute_seconds=0.001))


def _forged_node(mesh) -> worker_pb.DescribeNodeResponse:
    """The real worker's devices under another node IP, so the planner gives the forger shards."""
    with open_channel(mesh.workers[0].address, security=CREDENTIALS.service(Role.INVENTORY)) as channel:
        real = worker_service_pb2_grpc.WorkerServiceStub(channel).DescribeNode(worker_pb.DescribeNodeRequest(),
                                                                               timeout=TIMEOUT_S)
    forged = worker_pb.DescribeNodeResponse(node_ip="127.0.0.9")
    for device in real.devices:
        copy = forged.devices.add()
        copy.CopyFrom(device)
        copy.id, copy.node_ip = device.id.replace(real.node_ip, "127.0.0.9", 1), "127.0.0.9"
    return forged


def test_a_worker_returning_outputs_of_the_wrong_shape_fails_its_shard_never_the_result(mesh):
    x = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    # One rule for every shard (the emulated V100s: fp32), whichever fixture CPU the host's device is.
    same_rule = {"filter": 'type = "v100-32gb"'}
    with MeshClient(mesh.dispatch.address, security=CREDENTIALS.client()) as client:
        clean = client.run("mlp_classifier", {"x": x}, **same_rule).outputs["logits"]
        forger = ForgingWorker(_forged_node(mesh))
        server = create_server([Service("accelmesh.worker.v1.WorkerService",
                                        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, forger)],
                               security=CREDENTIALS.service(Role.WORKER),
                               access={"DescribeNode": frozenset({Role.INVENTORY}),
                                       "ExecuteMany": frozenset({Role.DISPATCH})}).start()
        try:
            with open_channel(mesh.inventory.address, security=CREDENTIALS.service(Role.WORKER)) as channel:
                inventory_service_pb2_grpc.InventoryServiceStub(channel).RegisterNode(
                    inv_pb.RegisterNodeRequest(address=f"127.0.0.1:{server.port}"), timeout=TIMEOUT_S)
            result = client.run("mlp_classifier", {"x": x}, **same_rule)
        finally:
            server.stop(0)
    assert forger.shards >= 1
    failures = [f for s in result.job.shards for f in s.failures]
    assert any("returned output" in f and "127.0.0.9/" in f for f in failures), failures
    assert all(not s.device_id.startswith("127.0.0.9/") for s in result.job.shards)
    assert result.outputs["logits"].shape == clean.shape and not np.any(result.outputs["logits"] == 42.0)
    np.testing.assert_allclose(result.outputs["logits"], clean, rtol=1e-5, atol=1e-5)  # other shard sizes
