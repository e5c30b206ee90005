"""Emulated accelerators: catalog profiles carried by local JAX CPU devices.

On a machine without accelerators this gives the mesh real heterogeneity (an A100 profile with
bf16, a V100 profile without) while the work still runs, for real, on the CPU. Every such
device says so: ``emulated=True`` and a kind ending in "(emulated on cpu:N)".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.catalog import CatalogEntry, resolve_type
from accelmesh.hardware.model import DeviceSpec


def emulated_devices(
    profiles: Sequence[str],
    node_ip: str,
    cpu_devices: Sequence[str],
    catalog: Mapping[str, CatalogEntry],
    *,
    first_index: Mapping[str, int] | None = None,
) -> list[DeviceSpec]:
    """Map ``profiles[i]`` onto ``cpu_devices[i]`` ("cpu:N").

    Local indices count per platform from ``first_index[platform]`` (default 0), so emulated
    GPUs on a node that also has real ones do not reuse their ids.
    """
    if len(profiles) > len(cpu_devices):
        raise InvalidArgument(
            f"emulate: {len(profiles)} profiles ({', '.join(profiles)}) need as many CPU devices, "
            f"but JAX has {len(cpu_devices)}; split the CPU into more devices with "
            f"--devices {len(profiles)} (or more) or emulate fewer profiles"
        )
    next_index = dict(first_index or {})
    devices = []
    for profile, cpu_device in zip(profiles, cpu_devices):
        entry = resolve_type(profile, catalog)
        index = next_index.get(entry.platform, 0)
        next_index[entry.platform] = index + 1
        devices.append(entry.device_spec(node_ip, index, emulated_on=cpu_device))
    return devices
