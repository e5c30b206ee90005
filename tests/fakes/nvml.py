"""A fake pynvml driven by a table: one dict per GPU.

Keys (all optional): name, uuid, memory_total, memory_used, utilization_gpu, cc (major, minor),
sm_clock_max, mem_clock_max, pcie_gen_max, pcie_width_max, temperature, power_mw, and nvlink:
a list of link states (True = active). As on real hardware, a missing key answers
NVMLError_NotSupported, asking for a link past the list answers NVMLError_InvalidArgument,
and a value that is an NVMLError subclass is raised instead of returned.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    """Base of the fake's errors; probes must catch it through ``module.NVMLError``."""


class NVMLError_Uninitialized(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_Unknown(NVMLError):
    pass


class FakeNvml:
    """Quacks like the pynvml module for the calls the probes make."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_Unknown = NVMLError_Unknown

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_FEATURE_DISABLED = 0

    def __init__(self, gpus: list[dict[str, Any]], *, library_missing: bool = False) -> None:
        self.gpus = gpus
        self.library_missing = library_missing
        self.initialised = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.library_missing:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._require_init()
        self.initialised = False
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        self._require_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument(f"no GPU {index}")
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str:
        return self._field(handle, "name")

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str:
        return self._field(handle, "uuid")

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        total, used = self._field(handle, "memory_total"), self._field(handle, "memory_used")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._field(handle, "utilization_gpu"), memory=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle: dict[str, Any]) -> tuple[int, int]:
        return self._field(handle, "cc")

    def nvmlDeviceGetMaxClockInfo(self, handle: dict[str, Any], clock: int) -> int:
        key = {self.NVML_CLOCK_SM: "sm_clock_max", self.NVML_CLOCK_MEM: "mem_clock_max"}.get(clock)
        if key is None:
            raise NVMLError_InvalidArgument(f"clock type {clock}")
        return self._field(handle, key)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: dict[str, Any]) -> int:
        return self._field(handle, "pcie_gen_max")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: dict[str, Any]) -> int:
        return self._field(handle, "pcie_width_max")

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument(f"sensor {sensor}")
        return self._field(handle, "temperature")

    def nvmlDeviceGetPowerUsage(self, handle: dict[str, Any]) -> int:
        return self._field(handle, "power_mw")

    def nvmlDeviceGetNvLinkState(self, handle: dict[str, Any], link: int) -> int:
        links = self._field(handle, "nvlink")
        if link >= len(links):
            raise NVMLError_InvalidArgument(f"link {link}")
        return self.NVML_FEATURE_ENABLED if links[link] else self.NVML_FEATURE_DISABLED

    def _field(self, handle: dict[str, Any], key: str) -> Any:
        self._require_init()
        value = handle.get(key, NVMLError_NotSupported)
        if isinstance(value, type) and issubclass(value, NVMLError):
            raise value(f"{key} of {handle.get('name', 'GPU')}")
        return value

    def _require_init(self) -> None:
        if not self.initialised:
            raise NVMLError_Uninitialized("call nvmlInit first")
