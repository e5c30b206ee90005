"""Accelerator probes behind one small interface, found by name.

Each vendor module (``nvml.py``, ``tpu.py``, ...) registers a function that lists the real
accelerators it sees on this node, with one status sample each, using ``@accelerator_probe``;
``describe_node`` asks every registered probe, then adds the emulated profiles and the CPU. The
modules of this package are imported on first use, so a new vendor (a ROCm probe, say) is one
new file here. A probe imports its vendor SDK inside the function and answers an empty list when
the hardware or its driver is missing: an absent GPU is not an error.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelmesh.hardware.catalog import CatalogEntry
from accelmesh.hardware.model import DeviceSample, DeviceSpec
from worker_svc.probes.jaxdev import JaxDeviceInfo

Found = tuple[DeviceSpec, DeviceSample]


@dataclass(frozen=True)
class NodeContext:
    """What every probe may read about the node it describes."""

    node_ip: str
    jax_devices: Sequence[JaxDeviceInfo]  # this process's XLA devices, CPUs included
    catalog: Mapping[str, CatalogEntry]
    now: float  # the time every sample of this description carries
    drivers: Mapping[str, Any] = field(default_factory=dict)  # vendor SDK module by probe name (tests: fakes)


@dataclass(frozen=True)
class AcceleratorProbe:
    name: str
    order: int  # devices are listed in this order across probes
    find: Callable[[NodeContext], list[Found]]


_PROBES: dict[str, AcceleratorProbe] = {}
_loaded = False


def accelerator_probe(name: str, *, order: int):
    """Register the decorated ``find(context) -> [(spec, sample), ...]`` as probe `name`."""

    def register(find: Callable[[NodeContext], list[Found]]):
        _PROBES[name] = AcceleratorProbe(name, order, find)
        return find

    return register


def accelerator_probes() -> list[AcceleratorProbe]:
    """Every registered probe, in listing order (the package's modules are imported once)."""
    global _loaded
    if not _loaded:
        package = importlib.import_module(__package__)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{module.name}")
        _loaded = True
    return sorted(_PROBES.values(), key=lambda probe: (probe.order, probe.name))
