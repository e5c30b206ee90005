"""Inventory probes against table-driven fakes, plus a few checks on this machine's real hardware."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import host
from fakes.nvml import FakeNvml, NVMLError_Unknown

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.hardware.catalog import load_catalog
from accelmesh.hardware.model import DeviceSample
from worker_svc.probes.cpu import CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE, probe_cpu
from worker_svc.probes.emulated import emulated_devices
from worker_svc.probes.jaxdev import probe_jax
from worker_svc.probes.node import describe_node
from worker_svc.probes import registry
from worker_svc.probes.nvml import nvml_device_spec, probe_nvml
from worker_svc.probes.registry import accelerator_probe, accelerator_probes

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


def proc_root(tmp_path: Path, machine: str) -> Path:
    """A copy of the machine's fixture /proc that a test may change."""
    root = tmp_path / "proc"
    shutil.copytree(host.proc_root(machine), root)
    return root


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


# ---------------------------------------------------------------- JAX devices


class FakeJaxDevice:
    def __init__(self, platform: str, id: int, device_kind: str = "cpu", stats=None):
        self.platform, self.id, self.device_kind, self._stats = platform, id, device_kind, stats

    def memory_stats(self):
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


def test_probe_jax_treats_missing_or_failing_stats_as_unknown():
    infos = probe_jax([
        FakeJaxDevice("cpu", 0),
        FakeJaxDevice("cpu", 1, stats=NotImplementedError("no allocator stats")),
        FakeJaxDevice("tpu", 0, "TPU v4", stats={"bytes_limit": 32 * GIB, "bytes_in_use": GIB}),
    ])
    assert [(i.name, i.memory_total_bytes, i.memory_used_bytes) for i in infos] == [
        ("cpu:0", None, None), ("cpu:1", None, None), ("tpu:0", 32 * GIB, GIB),
    ]


def test_probe_jax_with_real_cpu_devices():
    jax = pytest.importorskip("jax")
    infos = probe_jax(jax.devices("cpu"))
    assert infos and all(info.platform == "cpu" for info in infos)


# ---------------------------------------------------------------- emulation and whole node


def test_emulated_devices_map_profiles_onto_cpu_devices_in_order():
    specs = emulated_devices(["a100-80gb", "V100", "tpu-v4", "a100-40gb"], "10.1.2.3",
                             ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4"], CATALOG)
    assert [(s.id, s.type, s.execution_device) for s in specs] == [
        ("10.1.2.3/cuda:0", "a100-80gb", "cpu:0"),
        ("10.1.2.3/cuda:1", "v100-16gb", "cpu:1"),
        ("10.1.2.3/tpu:0", "tpu-v4", "cpu:2"),
        ("10.1.2.3/cuda:2", "a100-40gb", "cpu:3"),
    ]
    assert all(s.emulated and s.execution_platform == "cpu" for s in specs)
    assert specs[1].kind == "Tesla V100-SXM2-16GB (emulated on cpu:1)"
    assert "bf16" in specs[0].capabilities and "bf16" not in specs[1].capabilities
    assert specs[0].performance.peak_tflops["bf16"] == 312.0


def test_emulated_indices_continue_after_real_devices():
    (spec,) = emulated_devices(["t4"], "10.1.2.3", ["cpu:0"], CATALOG, first_index={"cuda": 2})
    assert spec.id == "10.1.2.3/cuda:2"


def test_more_profiles_than_cpu_devices_is_rejected():
    with pytest.raises(InvalidArgument, match=r"3 profiles .* JAX has 2.*--devices 3"):
        emulated_devices(["a100-80gb", "v100-16gb", "t4"], "10.1.2.3", ["cpu:0", "cpu:1"], CATALOG)


def test_unknown_profile_is_not_found():
    with pytest.raises(NotFound, match="'b200'"):
        emulated_devices(["b200"], "10.1.2.3", ["cpu:0"], CATALOG)


def test_describe_node_combines_real_emulated_and_cpu_devices(tmp_path):
    jax_devices = [FakeJaxDevice("cpu", i) for i in (3, 0, 2, 1)]  # order must not matter
    node = describe_node(
        "10.1.2.3", "worker-a",
        jax_devices=jax_devices,
        emulate=["a100-80gb", "V100"],
        nvml=FakeNvml([a100(0)]),
        proc_root=proc_root(tmp_path, "sapphire_rapids"),
        env={},
        catalog=CATALOG,
        clock=lambda: 1234.5,
        memory_used={"10.1.2.3/cuda:1": 5 * GIB},
    )
    assert (node.ip, node.hostname) == ("10.1.2.3", "worker-a")
    assert [(d.id, d.type, d.emulated, d.execution_device) for d in node.devices] == [
        ("10.1.2.3/cuda:0", "a100-80gb", False, "cuda:0"),
        ("10.1.2.3/cuda:1", "a100-80gb", True, "cpu:0"),
        ("10.1.2.3/cuda:2", "v100-16gb", True, "cpu:1"),
        ("10.1.2.3/cpu:2", "cpu", False, "cpu:2"),
        ("10.1.2.3/cpu:3", "cpu", False, "cpu:3"),
    ]
    real, emulated_a100, _, cpu2, _ = node.devices
    assert real.kind == "NVIDIA A100-SXM4-80GB"
    assert emulated_a100.kind == "NVIDIA A100-SXM4-80GB (emulated on cpu:0)"
    assert cpu2.kind == "Intel(R) Xeon(R) Platinum 8480+ (1/4 of host)"
    assert "amx_bf16" in cpu2.capabilities
    assert cpu2.performance.peak_tflops["fp32"] == pytest.approx(0.256 / 4)
    assert cpu2.performance.memory_bytes == 527939272 * 1024 // 4

    samples = {s.device_id: s for s in node.samples}
    assert list(samples) == [d.id for d in node.devices]
    assert all(s.timestamp == 1234.5 for s in node.samples)
    assert (samples["10.1.2.3/cuda:0"].utilization, samples["10.1.2.3/cuda:0"].power_w) == (0.5, 250.0)
    assert samples["10.1.2.3/cuda:1"].memory_total_bytes == 80_000_000_000
    assert samples["10.1.2.3/cuda:1"].memory_used_bytes == 5 * GIB
    assert samples["10.1.2.3/cuda:2"].memory_used_bytes == 0
    assert samples["10.1.2.3/cpu:2"].memory_used_bytes == (527939272 - 510000000) * 1024 // 4


def test_describe_node_single_cpu_device_and_tpu(tmp_path):
    node = describe_node(
        "10.9.9.9", "tpu-host",
        jax_devices=[FakeJaxDevice("cpu", 0),
                     FakeJaxDevice("tpu", 0, "TPU v4", stats={"bytes_limit": 30 * GIB, "bytes_in_use": GIB})],
        nvml=FakeNvml([], library_missing=True),
        proc_root=proc_root(tmp_path, "broadwell_avx2"),
        env={},
        catalog=CATALOG,
    )
    tpu, cpu = node.devices
    assert (tpu.id, tpu.type, tpu.performance.peak_tflops["bf16"]) == ("10.9.9.9/tpu:0", "tpu-v4", 275.0)
    assert cpu.kind == "Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz"  # whole host: no share suffix
    assert node.samples[0].memory_total_bytes == 30 * GIB


class Untouchable:
    """A driver module that fails loudly the moment a probe touches it."""

    def __getattr__(self, name):
        raise AssertionError(f"the driver was asked for {name}")


def test_describe_node_skips_the_probes_it_is_told_to():
    node = describe_node("10.1.2.3", "w", jax_devices=[FakeJaxDevice("cpu", 0)], nvml=Untouchable(), skip=("nvml",),
                         proc_root=host.proc_root(host.FP32_CPU), env={}, catalog=CATALOG)
    assert [d.platform for d in node.devices] == ["cpu"]


def test_accelerator_probes_are_registered_per_vendor_and_all_asked(monkeypatch):
    assert [p.name for p in accelerator_probes()] == ["nvml", "tpu"]
    monkeypatch.setattr(registry, "_PROBES", dict(registry._PROBES))  # the registration below ends with the test
    asked = []

    @accelerator_probe("rocm", order=15)  # what a new vendor module does, here without the file
    def rocm(context):
        asked.append(context.drivers)
        spec = CATALOG["mi250x"].device_spec(context.node_ip, 0)
        return [(spec, DeviceSample(device_id=spec.id, timestamp=context.now, memory_total_bytes=1,
                                     memory_used_bytes=0))]

    node = describe_node("10.1.2.3", "w", jax_devices=[FakeJaxDevice("cpu", 0)], nvml=FakeNvml([a100(0)]),
                         proc_root=host.proc_root(host.FP32_CPU), env={}, catalog=CATALOG, clock=lambda: 7.0)
    assert [(d.id, d.type) for d in node.devices] == [
        ("10.1.2.3/cuda:0", "a100-80gb"), ("10.1.2.3/rocm:0", "mi250x"), ("10.1.2.3/cpu:0", "cpu")]
    assert len(asked) == 1 and [s.timestamp for s in node.samples] == [7.0, 7.0, 7.0]


def test_describe_node_rejects_more_profiles_than_cpu_devices(tmp_path):
    with pytest.raises(InvalidArgument, match="--devices 2"):
        describe_node("10.1.2.3", "w", jax_devices=[FakeJaxDevice("cpu", 0)], emulate=["t4", "l4"],
                      nvml=FakeNvml([]), proc_root=proc_root(tmp_path, "graviton2_arm"), env={})


def test_describe_node_on_this_machine():
    """The real /proc and the real NVML (a GPU may or may not be there): only what holds on any host."""
    jax = pytest.importorskip("jax")
    cpus = jax.devices("cpu")
    node = describe_node("127.0.0.1", "localhost", jax_devices=cpus, env={})
    assert [d.execution_device for d in node.devices if d.platform == "cpu"] == [f"cpu:{d.id}" for d in cpus]
    assert all(d.platform in ("cpu", "cuda") and not d.emulated for d in node.devices)
    assert all(s.memory_total_bytes > 0 for s in node.samples)


def test_fake_objects_need_only_the_documented_attributes():
    # probe_jax accepts anything with platform, id, device_kind and memory_stats()
    device = SimpleNamespace(platform="cpu", id=7, device_kind="cpu", memory_stats=lambda: None)
    assert probe_jax([device])[0].name == "cpu:7"
