"""NVIDIA GPU probe through NVML, and the mapping of what it finds onto the catalog."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from accelmesh.hardware.catalog import CatalogEntry, find_by_kind
from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance, device_id
from worker_svc.probes.registry import Found, NodeContext, accelerator_probe

T = TypeVar("T")

# GB/s per lane in one direction after line coding (8b/10b to gen 2, 128b/130b from gen 3).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# For GPUs the catalog does not know: the compute capability that introduced each feature.
_FEATURES_SINCE_CC = (
    ((6, 0), "fp16"),
    ((6, 1), "int8"),  # dp4a integer dot products
    ((7, 0), "tensor_cores"),
    ((8, 0), "tf32"),
    ((8, 0), "bf16"),
    ((8, 9), "fp8"),
)
# Data-centre dies run fp64 at 1/2 or 1/3 of fp32; the others at 1/32 or less.
_FULL_FP64_CC = frozenset({(1, 3), (2, 0), (3, 5), (3, 7), (6, 0), (7, 0), (8, 0), (9, 0)})


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML reports it; a field NVML would not give is None."""

    index: int
    name: str | None = None
    uuid: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    compute_capability: str | None = None  # "8.0"
    sm_clock_mhz: int | None = None  # maximum clocks: the current ones drop when idle
    mem_clock_mhz: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    nvlink_active_links: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None

    @property
    def pcie_gbps(self) -> float | None:
        """PCIe bandwidth in one direction, from link generation and width."""
        if self.pcie_generation not in PCIE_LANE_GBPS or not self.pcie_width:
            return None
        return PCIE_LANE_GBPS[self.pcie_generation] * self.pcie_width


@accelerator_probe("nvml", order=10)
def nvml_devices(context: NodeContext) -> list[Found]:
    """NVIDIA GPUs through NVML (``context.drivers["nvml"]``: the module, None imports pynvml)."""
    found = []
    for gpu in probe_nvml(context.drivers.get("nvml")):
        spec = nvml_device_spec(gpu, context.node_ip, context.catalog)
        found.append((spec, _gpu_sample(spec, gpu, context.now)))
    return found


def _gpu_sample(spec: DeviceSpec, gpu: NvmlGpu, now: float) -> DeviceSample:
    return DeviceSample(
        device_id=spec.id,
        timestamp=now,
        memory_total_bytes=gpu.memory_total_bytes or spec.performance.memory_bytes,
        memory_used_bytes=gpu.memory_used_bytes or 0,
        utilization=(gpu.utilization_gpu_percent or 0.0) / 100,
        temperature_c=gpu.temperature_c,
        power_w=gpu.power_w,
    )


def probe_nvml(nvml: Any = None) -> list[NvmlGpu]:
    """Every GPU NVML sees; no driver or library means an empty list."""
    if nvml is None:
        import pynvml as nvml  # imported here so CPU-only nodes never need the driver
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return []
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError:
            return []
        gpus = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError:
                continue  # a lost or inaccessible GPU cannot be described, the others still can
            gpus.append(_describe(nvml, index, handle))
        return gpus
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # shutdown failing leaves nothing for us to undo


def _describe(nvml: Any, index: int, handle: Any) -> NvmlGpu:
    def get(call: Callable[[], T]) -> T | None:
        try:
            return call()
        except nvml.NVMLError:
            return None

    memory = get(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    utilization = get(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    cc = get(lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle))
    power_mw = get(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    temperature = get(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    return NvmlGpu(
        index=index,
        name=_text(get(lambda: nvml.nvmlDeviceGetName(handle))),
        uuid=_text(get(lambda: nvml.nvmlDeviceGetUUID(handle))),
        memory_total_bytes=memory.total if memory else None,
        memory_used_bytes=memory.used if memory else None,
        utilization_gpu_percent=float(utilization.gpu) if utilization else None,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        sm_clock_mhz=get(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
        mem_clock_mhz=get(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        # The current link generation drops at idle to save power; the maximum is what
        # the device and its slot can do.
        pcie_generation=get(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        pcie_width=get(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        nvlink_active_links=_nvlink_links(nvml, handle),
        temperature_c=float(temperature) if temperature is not None else None,
        power_w=power_mw / 1000 if power_mw is not None else None,
    )


def _nvlink_links(nvml: Any, handle: Any) -> int | None:
    """Active NVLink links; NVML answers an error past the last link the GPU has."""
    active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError_NotSupported:
            return active  # a PCIe-only GPU says NotSupported at link 0: zero links
        except nvml.NVMLError:
            return active if link else None
        active += state == nvml.NVML_FEATURE_ENABLED
    return active


def _text(value: str | bytes | None) -> str | None:
    # pynvml before 11.5 returned bytes
    return value.decode() if isinstance(value, bytes) else value


def nvml_device_spec(gpu: NvmlGpu, node_ip: str, catalog: Mapping[str, CatalogEntry]) -> DeviceSpec:
    """A DeviceSpec for ``gpu``: datasheet figures when its name is in the catalog."""
    name = gpu.name or "NVIDIA GPU"
    entry = find_by_kind(name, catalog)
    if entry is not None:
        performance = entry.performance()
        if gpu.memory_total_bytes:
            # NVML reports what the driver can really allocate, not the datasheet's rounded GB.
            performance = dataclasses.replace(performance, memory_bytes=gpu.memory_total_bytes)
        type_, capabilities = entry.type, entry.capabilities
        compute_capability = entry.compute_capability
    else:
        type_ = _type_from_name(name)
        capabilities = _capabilities_from_cc(gpu)
        compute_capability = gpu.compute_capability or ""
        performance = _performance_from_nvml(gpu)
    return DeviceSpec(
        id=device_id(node_ip, "cuda", gpu.index),
        node_ip=node_ip,
        local_index=gpu.index,
        platform="cuda",
        kind=name,
        type=type_,
        capabilities=capabilities,
        compute_capability=compute_capability,
        performance=performance,
        # CUDA (and so JAX) numbers GPUs in NVML's PCI bus order only under
        # CUDA_DEVICE_ORDER=PCI_BUS_ID; its default puts the fastest GPU first.
        execution_device=f"cuda:{gpu.index}",
    )


def _type_from_name(name: str) -> str:
    bare = re.sub(r"^(nvidia|tesla)\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", bare).strip("-") or "nvidia-gpu"


def _capabilities_from_cc(gpu: NvmlGpu) -> frozenset[str]:
    flags = set()
    if gpu.compute_capability:
        cc = tuple(int(part) for part in gpu.compute_capability.split("."))
        flags |= {flag for since, flag in _FEATURES_SINCE_CC if cc >= since}
        if cc in _FULL_FP64_CC:
            flags.add("fp64")
    if gpu.nvlink_active_links:
        flags.add("nvlink")
    return frozenset(flags)


def _performance_from_nvml(gpu: NvmlGpu) -> Performance:
    # NVML states no peak rates or memory bandwidth: unknown stays 0 rather than a guess.
    if gpu.nvlink_active_links:
        interconnect, gbps = f"nvlink-x{gpu.nvlink_active_links}", 0.0
    elif gpu.pcie_gbps:
        interconnect, gbps = f"pcie{gpu.pcie_generation}-x{gpu.pcie_width}", gpu.pcie_gbps
    else:
        interconnect, gbps = "", 0.0
    return Performance(
        memory_bytes=gpu.memory_total_bytes or 0,
        interconnect=interconnect,
        interconnect_bandwidth_gbps=gbps,
    )
