"""Server reflection under both names generic clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only v1alpha. The v1 service (grpc/reflection/v1/reflection.proto) is the
same messages and fields under a new package, so the two are one wire format: the v1 method is
the library's servicer behind v1alpha's (de)serialisers, and v1's own file descriptor is v1alpha's
renamed, so that a client can also ask the reflection service to describe itself. Newer grpcurl
and grpcui ask v1 first; older clients ask v1alpha.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, built from v1alpha's descriptor with the package renamed."""
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = proto.package, V1_SERVICE_NAME.rsplit(".", 1)[0]
    proto.name, proto.package = _V1_FILE, new
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old}."):
                field.type_name = f".{new}." + field.type_name[len(old) + 2 :]
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    return proto


def _register_v1(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.Add(v1_file_descriptor())


def enable_server_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Serve reflection (both versions) for ``service_names`` plus the reflection services themselves."""
    _register_v1(descriptor_pool.Default())
    servicer = reflection.ReflectionServicer([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handler = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1})
    server.add_generic_rpc_handlers((handler,))
