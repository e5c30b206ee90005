"""Tracing, configured once from the standard OTEL_* variables.

- OTEL_SDK_DISABLED=true: off.
- OTEL_TRACES_EXPORTER: comma list of `otlp`, `console`, `none`. When unset, `otlp` if
  OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, otherwise off.
- OTEL_SERVICE_NAME overrides the service name. The endpoint comes from `env`; the OTLP exporter
  reads its other variables (headers, insecure, timeout) from the process environment.

Off means no interceptors at all, so an untraced mesh pays nothing. Tests pass their own
provider (with an in-memory exporter) instead of touching global state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor, filters, intercept_channel, server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from accelmesh import errors

EXPORTERS = ("otlp", "console", "none")

# Health checks run every few seconds from every prober; tracing them buries real work.
UNTRACED = filters.negate(filters.service_name("grpc.health.v1.Health"))


def configure_telemetry(service_name: str, env: Mapping[str, str] = os.environ) -> TracerProvider | None:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not names and endpoint:
        names = ["otlp"]
    unknown = sorted(set(names) - set(EXPORTERS))
    if unknown:
        raise errors.InvalidArgument(
            f"OTEL_TRACES_EXPORTER names unknown exporter(s) {unknown}; use a comma list of {', '.join(EXPORTERS)}"
        )
    names = [n for n in names if n != "none"]
    if not names:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)}))
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # The exporter would read os.environ for the endpoint; `env` must decide where spans go.
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def server_interceptors(provider: TracerProvider | None) -> list[grpc.ServerInterceptor]:
    return [] if provider is None else [server_interceptor(tracer_provider=provider, filter_=UNTRACED)]


def instrument_channel(channel: grpc.Channel, provider: TracerProvider | None) -> grpc.Channel:
    if provider is None:
        return channel
    # OpenTelemetry's own intercept_channel: grpc.intercept_channel rejects its interceptor.
    return intercept_channel(channel, client_interceptor(tracer_provider=provider, filter_=UNTRACED))


def tracer(provider: TracerProvider | None, name: str):
    from opentelemetry import trace

    return (provider or trace.NoOpTracerProvider()).get_tracer(name)
