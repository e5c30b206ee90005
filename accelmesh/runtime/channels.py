"""Client channels between mesh services: size limits and tracing applied in one place."""

from __future__ import annotations

import grpc
from opentelemetry.sdk.trace import TracerProvider

from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from accelmesh.runtime.telemetry import instrument_channel


def open_channel(
    address: str,
    *,
    tracer_provider: TracerProvider | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
    return instrument_channel(channel, tracer_provider)
