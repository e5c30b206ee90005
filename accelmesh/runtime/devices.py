"""Translate device descriptions between the plain-Python model and accelmesh.common.v1 messages."""

from __future__ import annotations

import math

from google.protobuf.timestamp_pb2 import Timestamp

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance, free_memory_bytes, parse_device_id

PLATFORM_TO_PROTO = {
    "cpu": common_pb2.PLATFORM_CPU,
    "cuda": common_pb2.PLATFORM_CUDA,
    "rocm": common_pb2.PLATFORM_ROCM,
    "tpu": common_pb2.PLATFORM_TPU,
}
PLATFORM_FROM_PROTO = {v: k for k, v in PLATFORM_TO_PROTO.items()}
HEALTH_TO_PROTO = {
    "healthy": common_pb2.DEVICE_HEALTH_HEALTHY,
    "lost": common_pb2.DEVICE_HEALTH_LOST,
    "": common_pb2.DEVICE_HEALTH_UNSPECIFIED,
}


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def performance_to_proto(perf: Performance) -> common_pb2.Performance:
    return common_pb2.Performance(
        peak_tflops=perf.peak_tflops,
        memory_bytes=perf.memory_bytes,
        memory_bandwidth_gbps=perf.memory_bandwidth_gbps,
        interconnect=perf.interconnect,
        interconnect_bandwidth_gbps=perf.interconnect_bandwidth_gbps,
        estimated=perf.estimated,
    )


def status_to_proto(
    sample: DeviceSample | None, reserved_memory_bytes: int = 0, reserved_compute_fraction: float = 0.0
) -> common_pb2.DeviceStatus:
    if sample is None:
        return common_pb2.DeviceStatus(
            memory_reserved_bytes=reserved_memory_bytes, reserved_compute_fraction=reserved_compute_fraction
        )
    status = common_pb2.DeviceStatus(
        sample_time=timestamp(sample.timestamp),
        memory_total_bytes=sample.memory_total_bytes,
        memory_used_bytes=sample.memory_used_bytes,
        memory_reserved_bytes=reserved_memory_bytes,
        memory_free_bytes=free_memory_bytes(sample.memory_total_bytes, sample.memory_used_bytes, reserved_memory_bytes),
        utilization=sample.utilization,
        reserved_compute_fraction=reserved_compute_fraction,
    )
    if sample.temperature_c is not None:
        status.temperature_c = sample.temperature_c
    if sample.power_w is not None:
        status.power_w = sample.power_w
    return status


def device_to_proto(spec: DeviceSpec, sample: DeviceSample | None = None, **extra) -> common_pb2.Device:
    """`extra` carries inventory-side fields: health, node_address, reserved_* amounts."""
    return common_pb2.Device(
        id=spec.id,
        node_ip=spec.node_ip,
        local_index=spec.local_index,
        platform=PLATFORM_TO_PROTO[spec.platform],
        kind=spec.kind,
        type=spec.type,
        capabilities=sorted(spec.capabilities),
        compute_capability=spec.compute_capability,
        performance=performance_to_proto(spec.performance),
        emulated=spec.emulated,
        execution_device=spec.execution_device,
        health=HEALTH_TO_PROTO[extra.get("health", "")],
        node_address=extra.get("node_address", ""),
        status=status_to_proto(
            sample, extra.get("reserved_memory_bytes", 0), extra.get("reserved_compute_fraction", 0.0)
        ),
    )


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise errors.InvalidArgument(f"{field} is {value}; it must be a finite non-negative number")
    return value


def device_from_proto(msg: common_pb2.Device, field: str = "device") -> tuple[DeviceSpec, DeviceSample | None]:
    """Validate a device description from a worker; anything inconsistent is InvalidArgument."""
    try:
        ip, platform, index = parse_device_id(msg.id)
    except ValueError as exc:
        raise errors.InvalidArgument(f"{field}.id: {exc}") from None
    if msg.platform not in PLATFORM_FROM_PROTO or PLATFORM_FROM_PROTO[msg.platform] != platform:
        raise errors.InvalidArgument(f"{field}.platform does not match the platform in id {errors.quoted(msg.id)}")
    if msg.node_ip != ip or msg.local_index != index:
        raise errors.InvalidArgument(f"{field}: node_ip/local_index disagree with id {errors.quoted(msg.id)}")
    perf = msg.performance
    spec = DeviceSpec(
        id=msg.id,
        node_ip=ip,
        local_index=index,
        platform=platform,
        kind=msg.kind,
        type=msg.type or platform,
        capabilities=frozenset(msg.capabilities),
        compute_capability=msg.compute_capability,
        performance=Performance(
            peak_tflops={k: _finite(v, f"{field}.performance.peak_tflops[{k}]") for k, v in perf.peak_tflops.items()},
            memory_bytes=int(_finite(perf.memory_bytes, f"{field}.performance.memory_bytes")),
            memory_bandwidth_gbps=_finite(perf.memory_bandwidth_gbps, f"{field}.performance.memory_bandwidth_gbps"),
            interconnect=perf.interconnect,
            interconnect_bandwidth_gbps=_finite(
                perf.interconnect_bandwidth_gbps, f"{field}.performance.interconnect_bandwidth_gbps"
            ),
            estimated=perf.estimated,
        ),
        emulated=msg.emulated,
        execution_device=msg.execution_device,
    )
    if not msg.HasField("status") or not msg.status.HasField("sample_time"):
        return spec, None
    st = msg.status
    if not 0.0 <= st.utilization <= 1.0:
        raise errors.InvalidArgument(f"{field}.status.utilization is {st.utilization}; it must be within 0..1")
    try:
        sampled_at = seconds(st.sample_time)
    except ValueError as exc:  # nanos outside 0..999999999, or seconds outside years 1..9999
        raise errors.InvalidArgument(f"{field}.status.sample_time is not a valid timestamp: {exc}",
                                     field=f"{field}.status.sample_time") from None
    sample = DeviceSample(
        device_id=msg.id,
        timestamp=sampled_at,
        memory_total_bytes=int(_finite(st.memory_total_bytes, f"{field}.status.memory_total_bytes")),
        memory_used_bytes=int(_finite(st.memory_used_bytes, f"{field}.status.memory_used_bytes")),
        utilization=st.utilization,
        temperature_c=st.temperature_c if st.HasField("temperature_c") else None,
        power_w=st.power_w if st.HasField("power_w") else None,
    )
    return spec, sample

