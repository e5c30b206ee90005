"""`python -m worker_svc`: run a node agent."""

import os
import sys

from accelmesh.runtime.server import run_service
from worker_svc.config import GPU_ENVIRONMENT, parse_args, xla_flags_for


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
    # glibc's own mmap threshold: XLA's fresh output buffers each call stay in the heap and are
    # reused, not mapped and faulted in anew (accelmesh/runtime/memory.py).
    sys.exit(run_service("worker", parse_args, build, after_start=register, host=lambda config: config.node_ip,
                         fixed_mmap_threshold=False))
