"""The node agent's domain side: what this node holds, described by the inventory probes."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence

from accelmesh import errors
from accelmesh.hardware.model import NodeDescription
from worker_svc.probes.node import describe_node


def cuda_devices(jax) -> list:
    """JAX's CUDA devices, none where its CUDA plugin or a driver is missing. Their ids are CUDA's
    ordinals, which are NVML's indices (the NVML probe's "cuda:<index>") when CUDA orders devices
    by PCI bus as NVML does: the worker sets CUDA_DEVICE_ORDER=PCI_BUS_ID before JAX starts."""
    try:
        return list(jax.devices("cuda"))
    except RuntimeError:  # "Unknown backend" / "Backend 'cuda' failed to initialize"
        return []


class NodeAgent:
    def __init__(
        self,
        node_ip: str,
        *,
        emulate: Sequence[str] = (),
        jax_devices: Sequence | None = None,
        nvml=None,
        use_nvml: bool = True,
        proc_root: str = "/proc",
        env: Mapping[str, str] = os.environ,
        hostname: str | None = None,
        clock: Callable[[], float] = time.time,
    ):
        """``nvml`` is the NVML module (None imports pynvml) and ``use_nvml=False`` skips it;
        ``proc_root`` and ``env`` are where the CPU probe reads the host's facts and overrides."""
        if jax_devices is None:
            import jax  # imported here: XLA_FLAGS must be final before the first import

            jax_devices = jax.devices("cpu") + (cuda_devices(jax) if use_nvml else [])
        self.node_ip = node_ip
        self.hostname = hostname or socket.gethostname()
        self._jax_devices = list(jax_devices)
        self._emulate = tuple(emulate)
        self._nvml = nvml
        self._use_nvml = use_nvml
        self._proc_root = proc_root
        self._env = env
        self._clock = clock
        self.describe()  # fail at start, not at the first poll, if a profile is unknown

    @property
    def jax_devices(self) -> dict[str, object]:
        """This process's XLA devices by the name DeviceSpec.execution_device uses ("cpu:2",
        "cuda:0": JAX calls its CUDA devices' platform "gpu", the NVML probe names them "cuda")."""
        return {f"{'cuda' if d.platform == 'gpu' else d.platform}:{d.id}": d for d in self._jax_devices}

    def describe(self, device_ids: Sequence[str] = ()) -> NodeDescription:
        node = describe_node(
            self.node_ip,
            self.hostname,
            jax_devices=self._jax_devices,
            emulate=self._emulate,
            nvml=self._nvml,
            skip=() if self._use_nvml else ("nvml",),
            proc_root=self._proc_root,
            env=self._env,
            clock=self._clock,
        )
        if not device_ids:
            return node
        owned = {d.id for d in node.devices}
        missing = [d for d in device_ids if d not in owned]
        if missing:
            raise errors.NotFound(
                f"device_ids: {', '.join(missing)} not on node {self.node_ip}; it holds {', '.join(sorted(owned))}"
            )
        wanted = set(device_ids)
        return NodeDescription(
            ip=node.ip,
            hostname=node.hostname,
            devices=tuple(d for d in node.devices if d.id in wanted),
            samples=tuple(s for s in node.samples if s.device_id in wanted),
        )
