"""Telemetry: configure_telemetry reads the OTEL_* variables from a passed mapping, and a traced
server and channel propagate one trace across a call while leaving health checks untraced."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from accelmesh import errors
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry
from accelmesh.security.access import ANYONE
from accelmesh.security.config import INSECURE
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc

from conftest import CREDENTIALS

SERVICE_NAME = "accelmesh-test"
WORKER_SERVICE = "accelmesh.worker.v1.WorkerService"
DESCRIBE_SPAN = f"/{WORKER_SERVICE}/DescribeNode"
CALL_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_MS = 5000


def exporters(provider: TracerProvider) -> list:
    # The SDK has no public list of a provider's processors; each BatchSpanProcessor exposes its exporter.
    return [processor.span_exporter for processor in provider._active_span_processor._span_processors]


@pytest.fixture
def configure():
    """configure_telemetry that shuts down whatever provider it made, so no exporter thread outlives the test."""
    made = []

    def configure_with(env):
        provider = configure_telemetry(SERVICE_NAME, env=env)
        if provider is not None:
            made.append(provider)
        return provider

    yield configure_with
    for provider in made:
        provider.shutdown()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": ""},
    ],
    ids=["unset", "disabled", "disabled-wins-over-console", "disabled-wins-over-endpoint", "none", "none-wins",
         "empty-endpoint"],
)
def test_tracing_off(configure, env):
    assert configure(env) is None


@pytest.mark.parametrize(
    ("env", "exporter_types"),
    [
        ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": " Console "}, [ConsoleSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, [OTLPSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, [OTLPSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, [OTLPSpanExporter, ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "console,none"}, [ConsoleSpanExporter]),
    ],
    ids=["console", "console-spaced", "endpoint", "traces-endpoint", "both", "none-dropped"],
)
def test_tracing_on_builds_the_named_exporters(configure, env, exporter_types):
    provider = configure(env)
    assert isinstance(provider, TracerProvider)
    assert [type(e) for e in exporters(provider)] == exporter_types
    assert provider.resource.attributes["service.name"] == SERVICE_NAME


@pytest.mark.parametrize("value", ["jaeger", "console,zipkin", "otlp-http"])
def test_unknown_exporter_is_invalid_argument_naming_the_variable(configure, value):
    with pytest.raises(errors.InvalidArgument, match="OTEL_TRACES_EXPORTER") as info:
        configure({"OTEL_TRACES_EXPORTER": value})
    unknown = sorted(set(value.split(",")) - {"console"})
    assert all(name in str(info.value) for name in unknown)


def test_service_name_variable_overrides_the_default(configure):
    provider = configure({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "inventory-eu-1"})
    assert provider.resource.attributes["service.name"] == "inventory-eu-1"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An in-process OTLP trace receiver: records span names and the service that sent them."""

    def __init__(self):
        self.spans: list[tuple[str, str]] = []
        self.received = threading.Event()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(attributes.get("service.name"), span.name) for span in scope_spans.spans]
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_exports_to_the_endpoint_in_the_passed_env(configure):
    collector = Collector()
    service = Service(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server,
        collector,
    )
    # A collector is no mesh service: the exporter speaks plaintext (http://) to it, on loopback.
    server = create_server([service], security=INSECURE, access={"Export": ANYONE}).start()
    try:
        provider = configure({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.port}"})
        provider.get_tracer(__name__).start_span("probe").end()
        assert provider.force_flush(FLUSH_TIMEOUT_MS)
        assert collector.received.wait(CALL_TIMEOUT_S), "no export reached the collector named in the env"
        assert collector.spans == [(SERVICE_NAME, "probe")]
    finally:
        server.stop(0)


class TracedWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    def DescribeNode(self, request, context):
        if request.device_ids == ["missing"]:
            raise errors.NotFound("device_ids[0]: no such device on this node")
        if request.device_ids == ["bug"]:
            raise RuntimeError("a bug")
        return worker_service_pb2.DescribeNodeResponse(node_ip="10.0.0.9")


@pytest.fixture
def traced():
    """A server and channel sharing one provider whose spans land in memory, synchronously."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    service = Service(WORKER_SERVICE, worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, TracedWorker())
    server = create_server([service], security=CREDENTIALS.service(Role.WORKER), access={"DescribeNode": ANYONE},
                           tracer_provider=provider).start()
    channel = open_channel(f"127.0.0.1:{server.port}", tracer_provider=provider)
    yield channel, spans
    channel.close()
    server.stop(0)


def describe(channel, *device_ids):
    stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
    return stub.DescribeNode(worker_service_pb2.DescribeNodeRequest(device_ids=device_ids), timeout=CALL_TIMEOUT_S)


def spans_by_kind(spans: InMemorySpanExporter) -> dict:
    finished = spans.get_finished_spans()
    by_kind = {span.kind: span for span in finished}
    assert len(by_kind) == len(finished), f"more than one span of a kind: {[s.name for s in finished]}"
    return by_kind


def test_one_call_is_one_trace_across_client_and_server(traced):
    channel, spans = traced
    assert describe(channel).node_ip == "10.0.0.9"
    # The server span ends inside the handler, before the response is sent, so both are finished.
    by_kind = spans_by_kind(spans)
    assert set(by_kind) == {SpanKind.CLIENT, SpanKind.SERVER}
    client, server = by_kind[SpanKind.CLIENT], by_kind[SpanKind.SERVER]
    assert client.name == server.name == DESCRIBE_SPAN
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote


@pytest.mark.parametrize(
    ("device_id", "code"),
    [("missing", grpc.StatusCode.NOT_FOUND), ("bug", grpc.StatusCode.INTERNAL)],
)
def test_server_span_records_the_mapped_status(traced, device_id, code):
    # Tracing wraps the error interceptor, so the span sees the mapped code, not UNKNOWN.
    channel, spans = traced
    with pytest.raises(grpc.RpcError) as info:
        describe(channel, device_id)
    assert info.value.code() == code
    by_kind = spans_by_kind(spans)
    assert by_kind[SpanKind.SERVER].attributes["rpc.grpc.status_code"] == code.value[0]
    assert by_kind[SpanKind.CLIENT].attributes["rpc.grpc.status_code"] == code.value[0]


def test_health_checks_are_not_traced(traced):
    channel, spans = traced
    response = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=CALL_TIMEOUT_S
    )
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    describe(channel)  # a traced call after it proves the exporter was live all along
    assert {span.name for span in spans.get_finished_spans()} == {DESCRIBE_SPAN}
