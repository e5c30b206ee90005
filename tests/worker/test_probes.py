"""The NVML and CPU probes against table-driven fakes and fixture /proc trees, plus a check of
each on this machine's real hardware. JAX devices, emulation and the whole node are in
test_probes_node.py."""

from __future__ import annotations

import pytest
from _probe_helpers import CATALOG, GIB, a100, proc_root

from accelmesh.errors import InvalidArgument
from worker_svc.probes.cpu import CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE, probe_cpu
from worker_svc.probes.nvml import nvml_device_spec, probe_nvml

from fakes.nvml import FakeNvml, NVMLError_Unknown

pytestmark = pytest.mark.fixture_cpu

V100_PCIE = {
    "name": "Tesla V100-PCIE-16GB",
    "uuid": "GPU-v100",
    "memory_total": 16 * GIB,
    "memory_used": 0,
    "utilization_gpu": 0,
    "cc": (7, 0),
    "pcie_gen_max": 3,
    "pcie_width_max": 16,
    "temperature": 35,
    "power_mw": 30_000,
    # no "nvlink", "sm_clock_max", "mem_clock_max": NVML answers NotSupported
}


# ---------------------------------------------------------------- NVML


@pytest.mark.parametrize(
    ("table", "library_missing", "expected"),
    [
        pytest.param(
            [a100(0), a100(1, nvlink=[True] * 8 + [False] * 4), V100_PCIE],
            False,
            [
                {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0",
                 "nvlink_active_links": 12, "pcie_gbps": pytest.approx(31.504), "power_w": 250.0,
                 "memory_used_bytes": 10 * GIB, "sm_clock_mhz": 1410},
                {"index": 1, "uuid": "GPU-a100-1", "nvlink_active_links": 8},
                {"index": 2, "name": "Tesla V100-PCIE-16GB", "compute_capability": "7.0",
                 "nvlink_active_links": 0, "sm_clock_mhz": None, "pcie_gbps": pytest.approx(15.76),
                 "utilization_gpu_percent": 0.0, "temperature_c": 35.0},
            ],
            id="2xA100+V100",
        ),
        pytest.param(
            [a100(0, nvlink=NVMLError_Unknown, power_mw=NVMLError_Unknown)],
            False,
            [{"index": 0, "nvlink_active_links": None, "power_w": None, "memory_total_bytes": 80 * GIB}],
            id="nvlink-query-raises",
        ),
        pytest.param([a100(0)], True, [], id="driver-missing"),
        pytest.param([], False, [], id="no-gpus"),
    ],
)
def test_probe_nvml_table(table, library_missing, expected):
    fake = FakeNvml(table, library_missing=library_missing)
    gpus = probe_nvml(fake)
    assert len(gpus) == len(expected)
    for gpu, fields in zip(gpus, expected):
        assert {key: getattr(gpu, key) for key in fields} == fields
    assert not fake.initialised  # shut down again whenever init succeeded


def test_probe_nvml_with_real_pynvml_and_no_driver():
    # This machine has no NVIDIA driver: the real library must answer "no GPUs", not raise.
    assert probe_nvml() == []


def test_catalog_gpu_gets_datasheet_figures_and_measured_memory():
    (gpu,) = probe_nvml(FakeNvml([a100(0)]))
    spec = nvml_device_spec(gpu, "10.0.0.5", CATALOG)
    assert (spec.id, spec.type, spec.platform, spec.emulated) == ("10.0.0.5/cuda:0", "a100-80gb", "cuda", False)
    assert spec.performance.peak_tflops["bf16"] == 312.0
    assert spec.performance.memory_bytes == 80 * GIB
    assert {"bf16", "tf32", "nvlink"} <= spec.capabilities


def test_unknown_gpu_is_typed_from_its_name_and_nvml_figures():
    rtx = {"name": "NVIDIA GeForce RTX 3090", "memory_total": 24 * GIB, "memory_used": 0,
           "cc": (8, 6), "pcie_gen_max": 4, "pcie_width_max": 16}
    (gpu,) = probe_nvml(FakeNvml([rtx]))
    spec = nvml_device_spec(gpu, "10.0.0.5", CATALOG)
    assert spec.type == "geforce-rtx-3090"
    assert spec.compute_capability == "8.6"
    assert spec.capabilities == {"fp16", "int8", "tensor_cores", "tf32", "bf16"}
    assert spec.performance.peak_tflops == {}
    assert spec.performance.memory_bytes == 24 * GIB
    assert spec.performance.interconnect == "pcie4-x16"


# ---------------------------------------------------------------- CPU


SPR_FLAGS = {"fma", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("machine", "expected", "flags", "extra_capabilities", "peak"),
    [
        pytest.param(
            "sapphire_rapids",
            {"model": "Intel(R) Xeon(R) Platinum 8480+", "logical_cores": 4, "physical_cores": 2,
             "mhz": 2000.0, "memory_total_bytes": 527939272 * 1024, "memory_available_bytes": 510000000 * 1024},
            SPR_FLAGS,
            {"fp64", "bf16", "fp16", "int8"},
            # 2 cores x 2.0 GHz x (2 FMA units x 16 lanes x 2); AMX: 1024 bf16 / 2048 int8 per cycle
            {"fp32": 0.256, "fp64": 0.128, "bf16": 4.096, "int8": 8.192},
            id="avx512-amx",
        ),
        pytest.param(
            "broadwell_avx2",
            # the named 2.30 GHz base clock wins over momentary "cpu MHz" readings
            {"logical_cores": 4, "physical_cores": 2, "mhz": 2300.0, "memory_total_bytes": 62914560 * 1024},
            {"fma", "avx", "avx2"},
            {"fp64"},
            {"fp32": 2 * 2.3 * 32 / 1000, "fp64": 2 * 2.3 * 16 / 1000},
            id="avx2-only",
        ),
        pytest.param(
            "graviton2_arm",
            {"model": "ARM CPU (implementer 0x41, part 0xd0c)", "logical_cores": 2, "physical_cores": 2,
             "mhz": None, "memory_available_bytes": 12582912 * 1024},
            {"neon"},
            {"fp64", "fp16", "int8"},
            # no clock in ARM cpuinfo: 2.0 GHz default x 2 FMA units x 4 lanes x 2
            {"fp32": 0.064, "fp64": 0.032},
            id="arm-neon",
        ),
    ],
)
def test_probe_cpu_fixtures(tmp_path, machine, expected, flags, extra_capabilities, peak):
    cpu = probe_cpu(proc_root(tmp_path, machine), env={})
    assert {key: getattr(cpu, key) for key in expected} == expected
    assert cpu.flags == flags
    assert cpu.capabilities == flags | extra_capabilities
    assert cpu.performance.peak_tflops == pytest.approx(peak)
    assert cpu.performance.estimated
    assert cpu.performance.memory_bandwidth_gbps == CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE
    assert cpu.performance.memory_bytes == cpu.memory_total_bytes


def test_probe_cpu_environment_overrides(tmp_path):
    root = proc_root(tmp_path, "graviton2_arm")
    cpu = probe_cpu(root, env={"ACCELMESH_CPU_GHZ": "3.0", "ACCELMESH_CPU_MEMORY_BANDWIDTH_GBPS": "150"})
    assert cpu.mhz == 3000.0
    assert cpu.performance.peak_tflops["fp32"] == pytest.approx(2 * 3.0 * 16 / 1000)
    assert cpu.performance.memory_bandwidth_gbps == 150.0
    with pytest.raises(InvalidArgument, match="ACCELMESH_CPU_GHZ='fast'"):
        probe_cpu(root, env={"ACCELMESH_CPU_GHZ": "fast"})


def test_probe_cpu_without_proc_files_is_empty_not_an_error(tmp_path):
    cpu = probe_cpu(tmp_path, env={})
    assert (cpu.logical_cores, cpu.memory_total_bytes, cpu.flags) == (0, 0, frozenset())


def test_probe_cpu_on_this_machine():
    cpu = probe_cpu("/proc", env={})
    assert cpu.logical_cores > 0 and cpu.physical_cores > 0
    assert cpu.memory_total_bytes > 0 and 0 < cpu.memory_available_bytes <= cpu.memory_total_bytes
    assert cpu.performance.peak_tflops["fp32"] > 0

