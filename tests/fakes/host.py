"""The host every test sees: a fixture CPU, no GPU, and none of the real host's settings.

Machines of this project's kind differ (some CPUs have bf16 and AMX, some not; core counts,
clocks and memory differ; a GPU may be present), so no worker a test starts may describe the
real host. ``isolate`` runs once, before the tests import anything, and fixes the environment
every in-process server and every child process inherits:

- ``ACCELMESH_PROC_ROOT`` points every worker process at a fixture ``/proc`` (cpuinfo, meminfo),
  chosen by ``ACCELMESH_TEST_CPU`` (read here and nowhere else): ``broadwell_avx2`` (the
  default, AVX2, no bf16), ``sapphire_rapids`` (AVX-512, AVX-512 BF16, AMX) or ``graviton2_arm``.
  Running the suite under each proves that no test depends on the CPU's flags.
- ``ACCELMESH_WORKER_NVML=0``: a GPU on the host is never listed; tests that describe GPUs hand
  the probes the table-driven fake NVML.
- ``JAX_PLATFORMS=cpu``: references are computed on the CPU even where a GPU plugin is installed.
- The host's own ``ACCELMESH_*`` settings, ``XLA_FLAGS``, other ``JAX_*``, ``OTEL_*`` and proxy
  variables are removed (proxies are kept aside for ``npm ci``: ``registry_env()``); the time
  zone, the locale and glibc's heap count are pinned.

In-process workers get the same fixture through ``proc_root()`` (``conftest.make_worker``).
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEST_CPU_ENV = "ACCELMESH_TEST_CPU"
BF16_CPU = "sapphire_rapids"  # avx512_bf16, amx_bf16: the CPU rules that compute in bf16
FP32_CPU = "broadwell_avx2"  # no bf16: the fp32 CPU rule
ARM_CPU = "graviton2_arm"  # neither x86 vector flags nor bf16: the catch-all rule
FIXTURE_CPUS = (FP32_CPU, BF16_CPU, ARM_CPU)
DEFAULT_TEST_CPU = FP32_CPU

_REMOVED_PREFIXES = ("ACCELMESH_", "JAX_", "OTEL_")
# gRPC sends even loopback calls through a proxy these name; a package registry may need them.
_PROXIES = {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy", "no_grpc_proxy",
            "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"}
_REMOVED = {"XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
            "GRPC_DNS_RESOLVER", *_PROXIES}
_PINNED = {"TZ": "UTC", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "JAX_PLATFORMS": "cpu",
           "ACCELMESH_WORKER_NVML": "0",
           # glibc gives threads heaps of their own, up to 8 per core, so the memory a process keeps
           # after a burst grows with the host's core count; 16 is the default on the project's
           # 2-core machines, where the tests' memory bounds were measured.
           "MALLOC_ARENA_MAX": "16"}


def chosen_cpu(env: MutableMapping[str, str] = os.environ) -> str:
    """The fixture CPU named by ACCELMESH_TEST_CPU, or the default."""
    name = env.get(TEST_CPU_ENV) or DEFAULT_TEST_CPU
    if name not in FIXTURE_CPUS:
        raise SystemExit(f"{TEST_CPU_ENV}={name!r} is not a fixture CPU; use one of {', '.join(FIXTURE_CPUS)}")
    return name


def proc_root(cpu: str | None = None) -> Path:
    """The fixture /proc of `cpu` (default: the chosen one): its cpuinfo and meminfo."""
    return FIXTURES / f"proc_{cpu or chosen_cpu()}"


_host_proxies: dict[str, str] = {}


def registry_env() -> dict[str, str]:
    """The host's proxy settings, for the one step that reaches a package registry (npm ci)."""
    return dict(_host_proxies)


def isolate(env: MutableMapping[str, str] = os.environ) -> str:
    """Make `env` the tests' host; returns the chosen fixture CPU."""
    cpu = chosen_cpu(env)
    _host_proxies.update({name: env[name] for name in _PROXIES if name in env})
    for name in list(env):
        if name != TEST_CPU_ENV and (name in _REMOVED or name.startswith(_REMOVED_PREFIXES)):
            del env[name]
    env.update(_PINNED)
    env[TEST_CPU_ENV] = cpu
    env["ACCELMESH_PROC_ROOT"] = str(proc_root(cpu))
    if env is os.environ:
        time.tzset()
    return cpu
