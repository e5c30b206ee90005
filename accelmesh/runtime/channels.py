"""Client channels between mesh services: size limits and tracing applied in one place."""

from __future__ import annotations

import threading

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


class ChannelPool:
    """One channel per address, opened on first use and shared by every caller.

    A channel whose peer went away sits in gRPC's reconnect backoff (seconds, growing to
    minutes) and fails every call at once, even after the peer is back: `forget` drops it so the
    next call dials afresh. It is not closed there, since another thread's call may still be on
    it; gRPC closes it when the last user lets go. `close` closes every channel still held.
    """

    def __init__(self, *, tracer_provider: TracerProvider | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self._tracer_provider = tracer_provider
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(
                    address, tracer_provider=self._tracer_provider, max_message_bytes=self._max_message_bytes)
            return channel

    def forget(self, address: str) -> None:
        with self._lock:
            self._channels.pop(address, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
