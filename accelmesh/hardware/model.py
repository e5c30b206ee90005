"""Plain-Python description of accelerators, shared by probes, inventory, compile and dispatch.

Nothing here imports grpc or protobuf: the servicers translate these to and from the
contracts in ``protos/accelmesh/common/v1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# Precisions a device may publish a peak rate for, fastest-to-slowest is device specific.
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")


def free_memory_bytes(total: int, used: int, reserved: int = 0) -> int:
    """A device's free memory (requirements B1): its total less what is in use and what jobs reserved;
    never negative (reservations may exceed what is measured free). The one definition: the
    inventory's records, its reservation check, the status it reports and its SQL filter
    (inventory_svc/store.py, which mirrors it) all mean this."""
    return max(0, total - used - reserved)


@dataclass(frozen=True)
class Performance:
    """Datasheet or measured figures. Peak rates are dense (no sparsity), in TFLOP/s (TOP/s for int8)."""

    peak_tflops: dict[str, float] = field(default_factory=dict)  # precision -> TFLOP/s
    memory_bytes: int = 0
    memory_bandwidth_gbps: float = 0.0  # GB/s, device memory
    interconnect: str = ""  # e.g. "nvlink3", "pcie4-x16"
    interconnect_bandwidth_gbps: float = 0.0  # GB/s per direction
    estimated: bool = False  # True when figures are derived (e.g. CPU peak from clock and ISA)

    def rate_tflops(self, precision: str) -> float:
        """Peak rate at ``precision``; a precision the device lacks runs at its fp32 rate."""
        rate = self.peak_tflops.get(precision)
        if rate is None:
            rate = self.peak_tflops.get("fp32")
        if rate is None:  # e.g. a TPU publishes no fp32 figure: its best rate is what fp32 work gets
            rate = max(self.peak_tflops.values(), default=0.0)
        return rate


@dataclass(frozen=True)
class DeviceSpec:
    """Static hardware information of one device (requirements A1, A3)."""

    id: str  # "<node ip>/<platform>:<local index>", e.g. "10.1.2.3/cuda:1"
    node_ip: str
    local_index: int
    platform: str  # one of PLATFORMS: what the device is (an emulated A100 says "cuda")
    kind: str  # vendor's name, e.g. "NVIDIA A100-SXM4-80GB"
    type: str  # canonical catalog type, e.g. "a100-80gb"; "cpu" for host CPUs
    capabilities: frozenset[str] = frozenset()
    compute_capability: str = ""  # CUDA "8.0", ROCm "gfx90a", TPU "v4", CPU ""
    performance: Performance = Performance()
    emulated: bool = False  # True: a catalog profile backed by a local CPU device
    execution_device: str = ""  # JAX device that really runs the work, e.g. "cpu:2"

    @property
    def execution_platform(self) -> str:
        return self.execution_device.split(":", 1)[0] if self.execution_device else self.platform

    def replace(self, **changes) -> DeviceSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DeviceSample:
    """One monitored status reading of a device (requirements B1)."""

    device_id: str
    timestamp: float  # unix seconds
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float = 0.0  # 0..1 of compute busy
    temperature_c: float | None = None
    power_w: float | None = None

    @property
    def memory_free_bytes(self) -> int:
        return free_memory_bytes(self.memory_total_bytes, self.memory_used_bytes)


@dataclass(frozen=True)
class NodeDescription:
    """What a worker reports about its node: who it is and what it holds."""

    ip: str
    hostname: str
    devices: tuple[DeviceSpec, ...] = ()
    samples: tuple[DeviceSample, ...] = ()


def device_id(node_ip: str, platform: str, local_index: int) -> str:
    return f"{node_ip}/{platform}:{local_index}"


def parse_device_id(value: str) -> tuple[str, str, int]:
    """Split "<ip>/<platform>:<index>"; raises ValueError with what is wrong."""
    ip, sep, local = value.rpartition("/")
    platform, sep2, index = local.partition(":")
    if not sep or not sep2 or not ip or platform not in PLATFORMS or not index.isdigit():
        raise ValueError(
            f"device id {value!r} is not of the form '<node ip>/<platform>:<index>' "
            f"with platform one of {', '.join(PLATFORMS)}"
        )
    return ip, platform, int(index)
