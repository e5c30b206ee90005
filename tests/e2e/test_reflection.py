"""What a generic gRPC client (grpcurl, Postman, grpcui, Evans) needs from every mesh process:
server reflection lists the services, serves their file descriptors with every dependency, and
those descriptors alone (no generated code) are enough to describe and call a method; the
standard health service answers SERVING per service name."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from accelmesh.compile.v1 import compile_service_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2
from accelmesh.embedded import start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2
from accelmesh.runtime.channels import open_channel
from accelmesh.worker.v1 import worker_service_pb2

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# process -> (the service it hosts, the generated module of its .proto)
PROCESSES = {
    "inventory": ("accelmesh.inventory.v1.InventoryService", inventory_service_pb2),
    "compile": ("accelmesh.compile.v1.CompileService", compile_service_pb2),
    "dispatch": ("accelmesh.dispatch.v1.DispatchService", dispatch_service_pb2),
    "worker": ("accelmesh.worker.v1.WorkerService", worker_service_pb2),
}
DISPATCH_METHODS = {  # name -> (client streams, server streams)
    "PlanJob": (False, False),
    "SubmitJob": (True, False),
    "RunJob": (True, True),
    "WatchJob": (False, True),
    "GetJob": (False, False),
    "ListJobs": (False, False),
    "CancelJob": (False, False),
    "FetchResult": (False, True),
    "SetQuota": (False, False),
    "ListQuotas": (False, False),
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb",)) as running:
        yield running


def address_of(mesh, process: str) -> str:
    return mesh.workers[0].address if process == "worker" else getattr(mesh, process).address


class Reflector:
    """The reflection half of a generic client, over one ServerReflectionInfo call per question."""

    def __init__(self, channel: grpc.Channel):
        self._stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    def _ask(self, **request) -> reflection_pb2.ServerReflectionResponse:
        (response,) = self._stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]),
                                                      timeout=TIMEOUT_S)
        assert not response.HasField("error_response"), response.error_response.error_message
        return response

    def services(self) -> list[str]:
        return [s.name for s in self._ask(list_services="").list_services_response.service]

    def _files(self, response) -> list[descriptor_pb2.FileDescriptorProto]:
        return [descriptor_pb2.FileDescriptorProto.FromString(raw)
                for raw in response.file_descriptor_response.file_descriptor_proto]

    def pool_for(self, symbol: str) -> descriptor_pool.DescriptorPool:
        """A fresh pool holding the file that defines `symbol` and all it imports, asking for any
        import the server did not send along (as grpcurl does)."""
        files = {f.name: f for f in self._files(self._ask(file_containing_symbol=symbol))}
        missing = {d for f in files.values() for d in f.dependency} - files.keys()
        while missing:
            name = missing.pop()
            for f in self._files(self._ask(file_by_filename=name)):
                files.setdefault(f.name, f)
            missing = {d for f in files.values() for d in f.dependency} - files.keys()
        pool, added = descriptor_pool.DescriptorPool(), set()

        def add(name: str) -> None:  # dependencies first
            if name not in added:
                for dependency in files[name].dependency:
                    add(dependency)
                pool.Add(files[name])
                added.add(name)

        for name in files:
            add(name)
        return pool


@pytest.mark.parametrize("process", PROCESSES)
def test_reflection_lists_the_services_of_each_process(mesh, process):
    service, _ = PROCESSES[process]
    with open_channel(address_of(mesh, process)) as channel:
        names = Reflector(channel).services()
    assert [n for n in names if n.startswith("accelmesh.")] == [service]  # each process hosts its one service
    assert {HEALTH, REFLECTION, REFLECTION_V1} <= set(names)


@pytest.mark.parametrize("process", PROCESSES)
def test_reflection_v1_answers_a_client_that_knows_only_v1(mesh, process):
    """grpcurl 1.9 and grpcui ask grpc.reflection.v1 first; its messages come from reflection itself."""
    with open_channel(address_of(mesh, process)) as channel:
        reflector = Reflector(channel)
        pool = reflector.pool_for(REFLECTION_V1)
        method = pool.FindServiceByName(REFLECTION_V1).methods_by_name["ServerReflectionInfo"]
        assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        call = channel.stream_stream(f"/{REFLECTION_V1}/ServerReflectionInfo",
                                     request_serializer=request_class.SerializeToString,
                                     response_deserializer=response_class.FromString)
        (listed,) = call(iter([request_class(list_services="")]), timeout=TIMEOUT_S)
        (described,) = call(iter([request_class(file_containing_symbol=PROCESSES[process][0])]), timeout=TIMEOUT_S)
        expected = reflector.services()
    assert [s.name for s in listed.list_services_response.service] == expected
    (raw, *_) = described.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(raw).package == PROCESSES[process][0].rsplit(".", 1)[0]


@pytest.mark.parametrize("process", PROCESSES)
def test_reflected_descriptors_match_the_repo_protos(mesh, process):
    """`grpcurl describe <service>`: every method with its request and response types and streaming."""
    service, module = PROCESSES[process]
    with open_channel(address_of(mesh, process)) as channel:
        reflected = Reflector(channel).pool_for(service).FindServiceByName(service)
    local = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]

    def shape(s):
        return [(m.name, m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
                for m in s.methods]

    assert shape(reflected) == shape(local)
    assert reflected.file.name == local.file.name


def test_dispatch_methods_resolve_from_reflection_alone(mesh):
    with open_channel(mesh.dispatch.address) as channel:
        pool = Reflector(channel).pool_for("accelmesh.dispatch.v1.DispatchService")
    service = pool.FindServiceByName("accelmesh.dispatch.v1.DispatchService")
    assert {m.name: (m.client_streaming, m.server_streaming) for m in service.methods} == DISPATCH_METHODS
    assert [m.name for m in service.methods] == list(DISPATCH_METHODS)  # declaration order, as `describe` shows

    # Enough to build requests a client never compiled: RunJob's stream parts and their nested types.
    run_request = pool.FindMessageTypeByName("accelmesh.dispatch.v1.RunJobRequest")
    assert [f.name for f in run_request.oneofs_by_name["part"].fields] == ["spec", "parameter", "parameter_chunk",
                                                                           "block", "stored"]
    block = run_request.fields_by_name["block"].message_type
    tensor = block.fields_by_name["tensors"].message_type
    assert tensor.full_name == "accelmesh.common.v1.Tensor"
    assert [f.name for f in tensor.fields] == ["dtype", "shape", "data"]
    assert tensor.fields_by_name["dtype"].enum_type.values_by_name["DATA_TYPE_FLOAT32"].number == 1
    job = pool.FindMessageTypeByName("accelmesh.dispatch.v1.Job")
    assert job.fields_by_name["create_time"].message_type.full_name == "google.protobuf.Timestamp"


def call_dynamically(channel: grpc.Channel, pool, service: str, method: str, request_json: str) -> dict:
    """`grpcurl -plaintext -d '<json>' <address> <service>/<method>`: JSON in, JSON out, types from reflection."""
    descriptor = pool.FindServiceByName(service).methods_by_name[method]
    request_class = message_factory.GetMessageClass(descriptor.input_type)
    response_class = message_factory.GetMessageClass(descriptor.output_type)
    call = channel.unary_unary(f"/{service}/{method}", request_serializer=request_class.SerializeToString,
                               response_deserializer=response_class.FromString)
    response = call(json_format.Parse(request_json, request_class()), timeout=TIMEOUT_S)
    return json_format.MessageToDict(response)


def test_a_generic_client_calls_the_inventory_and_dispatch_with_reflected_types_only(mesh):
    service = "accelmesh.inventory.v1.InventoryService"
    with open_channel(mesh.inventory.address) as channel:
        pool = Reflector(channel).pool_for(service)
        everything = call_dynamically(channel, pool, service, "ListDevices", "{}")
        v100s = call_dynamically(channel, pool, service, "ListDevices", '{"filter": "type = \\"v100-32gb\\""}')
    assert len(everything["devices"]) == 2
    (v100,) = v100s["devices"]
    assert v100["type"] == "v100-32gb" and v100["platform"] == "PLATFORM_CUDA" and v100["emulated"] is True

    service = "accelmesh.dispatch.v1.DispatchService"
    with open_channel(mesh.dispatch.address) as channel:
        pool = Reflector(channel).pool_for(service)
        assert call_dynamically(channel, pool, service, "ListJobs", '{"pageSize": 5}') == {}  # no jobs yet


@pytest.mark.parametrize("process", PROCESSES)
def test_health_answers_serving_per_service_on_each_process(mesh, process):
    service, _ = PROCESSES[process]
    with open_channel(address_of(mesh, process)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S).status
            assert status == health_pb2.HealthCheckResponse.SERVING, (process, name)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="accelmesh.nope.v1.Nope"), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
