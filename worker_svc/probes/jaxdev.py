"""JAX device probe: what XLA exposes on this process, including split CPU devices.

The caller passes the device objects (e.g. ``jax.devices("cpu")``), so this module never
imports jax and tests hand it plain objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class JaxDevice(Protocol):
    platform: str
    id: int
    device_kind: str

    def memory_stats(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class JaxDeviceInfo:
    """One XLA device; memory figures are None when the backend keeps no statistics."""

    platform: str
    id: int
    kind: str
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None

    @property
    def name(self) -> str:
        """The name dispatch uses to pick the device, e.g. "cpu:3"."""
        return f"{self.platform}:{self.id}"


def probe_jax(devices: Iterable[JaxDevice]) -> list[JaxDeviceInfo]:
    """Describe ``devices`` in the order given."""
    return [_describe(device) for device in devices]


def _describe(device: JaxDevice) -> JaxDeviceInfo:
    try:
        stats = device.memory_stats() or {}
    # Backends without allocator statistics differ in how they say so (None, NotImplementedError,
    # XlaRuntimeError); all of them mean "unknown", which must not hide the device.
    except Exception:  # noqa: BLE001
        stats = {}
    return JaxDeviceInfo(
        platform=device.platform,
        id=device.id,
        kind=device.device_kind,
        memory_total_bytes=stats.get("bytes_limit"),
        memory_used_bytes=stats.get("bytes_in_use"),
    )
