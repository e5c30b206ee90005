"""TPUs as JAX sees them: JAX is the TPU driver's interface, so no vendor SDK is asked."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from accelmesh.hardware.catalog import CatalogEntry, find_by_kind
from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance, device_id
from worker_svc.probes.jaxdev import JaxDeviceInfo
from worker_svc.probes.registry import Found, NodeContext, accelerator_probe


@accelerator_probe("tpu", order=20)
def tpu_devices(context: NodeContext) -> list[Found]:
    found = []
    for info in (info for info in context.jax_devices if info.platform == "tpu"):
        spec = _tpu_spec(info, context.node_ip, context.catalog)
        found.append((spec, _jax_sample(spec, info, context.now)))
    return found


def _tpu_spec(info: JaxDeviceInfo, node_ip: str, catalog: Mapping[str, CatalogEntry]) -> DeviceSpec:
    entry = find_by_kind(info.kind, catalog)
    if entry is None:
        type_ = re.sub(r"[^a-z0-9]+", "-", info.kind.lower()).strip("-") or "tpu"
        spec_fields: dict[str, Any] = {
            "type": type_,
            "performance": Performance(memory_bytes=info.memory_total_bytes or 0),
        }
    else:
        spec_fields = {
            "type": entry.type,
            "capabilities": entry.capabilities,
            "compute_capability": entry.compute_capability,
            "performance": entry.performance(),
        }
    return DeviceSpec(
        id=device_id(node_ip, "tpu", info.id),
        node_ip=node_ip,
        local_index=info.id,
        platform="tpu",
        kind=info.kind,
        execution_device=info.name,
        **spec_fields,
    )


def _jax_sample(spec: DeviceSpec, info: JaxDeviceInfo, now: float) -> DeviceSample:
    return DeviceSample(
        device_id=spec.id,
        timestamp=now,
        memory_total_bytes=info.memory_total_bytes or spec.performance.memory_bytes,
        memory_used_bytes=info.memory_used_bytes or 0,
    )
