"""Shared by the probe tests: the hardware catalog, a table row for an NVML A100, and a copy of
a fixture machine's /proc. A module of its own, not a conftest.py: a second conftest.py would
shadow the top-level one that tests import as `conftest`."""

from __future__ import annotations

import shutil
from pathlib import Path

from accelmesh.hardware.catalog import load_catalog

from fakes import host

CATALOG = load_catalog()
GIB = 2**30


def a100(index: int, **overrides):
    gpu = {
        "name": "NVIDIA A100-SXM4-80GB",
        "uuid": f"GPU-a100-{index}",
        "memory_total": 80 * GIB,
        "memory_used": 10 * GIB,
        "utilization_gpu": 50,
        "cc": (8, 0),
        "sm_clock_max": 1410,
        "mem_clock_max": 1593,
        "pcie_gen_max": 4,
        "pcie_width_max": 16,
        "temperature": 40,
        "power_mw": 250_000,
        "nvlink": [True] * 12,
    }
    return {**gpu, **overrides}


def proc_root(tmp_path: Path, machine: str) -> Path:
    """A copy of the machine's fixture /proc that a test may change."""
    root = tmp_path / "proc"
    shutil.copytree(host.proc_root(machine), root)
    return root
