"""Describe a whole node: every registered accelerator probe, emulated profiles and the host CPU's shares."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from accelmesh.hardware.catalog import CatalogEntry, load_catalog
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, device_id
from worker_svc.probes.cpu import CpuInfo, probe_cpu
from worker_svc.probes.emulated import emulated_devices
from worker_svc.probes.jaxdev import JaxDevice, JaxDeviceInfo, probe_jax
from worker_svc.probes.registry import NodeContext, accelerator_probes


def describe_node(
    node_ip: str,
    hostname: str,
    *,
    jax_devices: Iterable[JaxDevice],
    emulate: Sequence[str] = (),
    nvml: Any = None,
    skip: Collection[str] = (),
    proc_root: str | Path = "/proc",
    env: Mapping[str, str] = os.environ,
    catalog: Mapping[str, CatalogEntry] | None = None,
    clock: Callable[[], float] = time.time,
    memory_used: Mapping[str, int] | None = None,
) -> NodeDescription:
    """Every device of this node with one status sample each.

    Real accelerators come from every registered probe (``registry.py``) whose name is not in
    ``skip``: NVIDIA GPUs from NVML (``nvml=None`` imports pynvml), so JAX's own GPU devices are
    ignored rather than listed twice, and TPUs from JAX. ``jax_devices`` must include the CPU
    devices (``jax.devices("cpu")``, plus ``jax.devices("tpu")`` on a TPU host): the first
    ``len(emulate)`` CPU devices carry the emulated profiles, the rest are plain CPU shares.
    ``memory_used`` is the in-process accounting of bytes held on emulated devices, by device
    id, since no driver tracks them.
    """
    catalog = load_catalog() if catalog is None else catalog
    memory_used = memory_used or {}
    now = clock()
    infos = probe_jax(jax_devices)
    cpus = sorted((info for info in infos if info.platform == "cpu"), key=lambda info: info.id)
    cpu = probe_cpu(proc_root, env)

    specs: list[DeviceSpec] = []
    samples: list[DeviceSample] = []
    context = NodeContext(node_ip, tuple(infos), catalog, now, drivers={"nvml": nvml})
    for probe in accelerator_probes():
        if probe.name not in skip:
            for spec, sample in probe.find(context):
                specs.append(spec)
                samples.append(sample)

    real_counts: dict[str, int] = {}
    for spec in specs:
        real_counts[spec.platform] = real_counts.get(spec.platform, 0) + 1
    cpu_names = [info.name for info in cpus]
    for spec in emulated_devices(list(emulate), node_ip, cpu_names, catalog, first_index=real_counts):
        specs.append(spec)
        samples.append(
            DeviceSample(
                device_id=spec.id,
                timestamp=now,
                memory_total_bytes=spec.performance.memory_bytes,
                memory_used_bytes=memory_used.get(spec.id, 0),
            )
        )
    for info in cpus[len(emulate):]:
        spec = _cpu_spec(info, cpu, len(cpus), node_ip)
        specs.append(spec)
        samples.append(_cpu_sample(spec, cpu, len(cpus), now))
    return NodeDescription(ip=node_ip, hostname=hostname, devices=tuple(specs), samples=tuple(samples))


def _cpu_spec(info: JaxDeviceInfo, cpu: CpuInfo, shares: int, node_ip: str) -> DeviceSpec:
    host = cpu.performance
    # XLA CPU devices of one process share the cores and the memory, so each gets 1/shares.
    performance = dataclasses.replace(
        host,
        peak_tflops={p: rate / shares for p, rate in host.peak_tflops.items()},
        memory_bytes=host.memory_bytes // shares,
        memory_bandwidth_gbps=host.memory_bandwidth_gbps / shares,
    )
    return DeviceSpec(
        id=device_id(node_ip, "cpu", info.id),
        node_ip=node_ip,
        local_index=info.id,
        platform="cpu",
        kind=cpu.model + (f" (1/{shares} of host)" if shares > 1 else ""),
        type="cpu",
        capabilities=cpu.capabilities,
        performance=performance,
        execution_device=info.name,
    )


def _cpu_sample(spec: DeviceSpec, cpu: CpuInfo, shares: int, now: float) -> DeviceSample:
    used = max(0, cpu.memory_total_bytes - cpu.memory_available_bytes)
    return DeviceSample(
        device_id=spec.id,
        timestamp=now,
        memory_total_bytes=cpu.memory_total_bytes // shares,
        memory_used_bytes=used // shares,
        # Busy time needs two /proc/stat readings some interval apart; one describe call has a
        # single instant, so it reports 0 and leaves load to the in-process reservations.
        utilization=0.0,
    )
