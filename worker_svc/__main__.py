"""`python -m worker_svc`: run a node agent."""

import os
import sys

from accelmesh.runtime.server import run_service
from worker_svc.config import parse_args, xla_flags_for

# Read by CUDA and JAX at their start; an operator's own values win.
GPU_ENVIRONMENT = {
    # CUDA's ordinals follow the PCI bus as NVML's indices do, so "cuda:<index>" names one GPU in both
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    # JAX otherwise takes 75% of every GPU's memory at start: the inventory would see the GPU full,
    # and the memory a job reserves would not be there for it
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}


def build(config):
    # XLA reads this once, at jax's first import, which the worker's modules trigger below.
    os.environ["XLA_FLAGS"] = xla_flags_for(config.cpu_devices, os.environ.get("XLA_FLAGS", ""))
    for name, value in GPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from worker_svc.server import build_worker

    return build_worker(config)


def register(config, server) -> None:
    if config.inventory:
        from worker_svc.server import register_with_inventory

        register_with_inventory(config, server.port, server.tracer_provider)


if __name__ == "__main__":
    sys.exit(run_service("worker", parse_args, build, after_start=register, host=lambda config: config.node_ip))
