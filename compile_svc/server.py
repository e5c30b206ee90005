"""Build, serve and shut down the compile service."""

from __future__ import annotations

from pathlib import Path

from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.server import MeshServer, Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry
from accelmesh.security.access import PEOPLE, Access, roles
from accelmesh.security.identity import Role
from compile_svc.cache import ArtifactCache
from compile_svc.compiler import Compiler
from compile_svc.config import CompileConfig
from compile_svc.metrics import register as register_metrics
from compile_svc.programs import default_registry
from compile_svc.rules import load_rules
from compile_svc.servicer import CompileServicer
from compile_svc.uploads import UploadStore

SERVICE_NAME = "accelmesh.compile.v1.CompileService"
_READERS = PEOPLE | roles(Role.DISPATCH)
ACCESS: Access = {
    "ListPrograms": _READERS,
    "DescribeProgram": _READERS,
    "ListRules": _READERS,
    "ExplainRule": _READERS,
    "UploadProgram": roles(Role.OPERATOR),
    "DeleteProgram": roles(Role.OPERATOR),
    "Compile": roles(Role.DISPATCH, Role.OPERATOR),
    "FetchArtifact": roles(Role.WORKER, Role.DISPATCH, Role.OPERATOR),
    "FetchParameters": _READERS,
}


def build_compile_service(config: CompileConfig, *, tracer_provider=None) -> tuple[MeshServer, Compiler]:
    if tracer_provider is None:
        tracer_provider = configure_telemetry("accelmesh-compile")
    registry = default_registry()
    compiler = Compiler(
        registry,
        load_rules(config.rules or None),
        ArtifactCache(Path(config.cache_dir), config.cache_max_bytes),
        max_batch_sizes=config.max_batch_sizes,
    )
    uploads = UploadStore(Path(config.programs_dir), registry, config.max_upload_bytes,
                          max_uploads=config.max_uploads, max_total_bytes=config.max_uploaded_bytes)
    uploads.restore()
    servicer = CompileServicer(compiler, uploads, config.max_message_bytes, config.max_parameter_bytes)
    metrics = Metrics("compile", config.metrics_listen, config.security, config.http)
    register_metrics(metrics, compiler.cache)
    server = create_server(
        [Service(SERVICE_NAME, compile_service_pb2_grpc.add_CompileServiceServicer_to_server, servicer)],
        security=config.security,
        access=ACCESS,
        address=config.listen,
        health_listen=config.health_listen,
        max_message_bytes=config.max_message_bytes,
        tracer_provider=tracer_provider,
        metrics=metrics,
    )
    return server, compiler
