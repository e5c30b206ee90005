"""The JAX device probe, emulated devices and the whole node's description against fakes, the
accelerator probe registry, and a check of JAX and the node on this machine. The NVML and CPU
probes are in test_probes.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _probe_helpers import CATALOG, GIB, a100, proc_root

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.hardware.model import DeviceSample
from worker_svc.probes import registry
from worker_svc.probes.emulated import emulated_devices
from worker_svc.probes.jaxdev import probe_jax
from worker_svc.probes.node import describe_node
from worker_svc.probes.registry import accelerator_probe, accelerator_probes

from fakes import host
from fakes.nvml import FakeNvml

pytestmark = pytest.mark.fixture_cpu

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


def test_the_agent_names_jax_cuda_devices_as_the_nvml_probe_names_the_gpus():
    # JAX calls a CUDA device's platform "gpu"; the NVML probe's DeviceSpec says "cuda:<index>":
    # every GPU the node registers must find its JAX device, or each of its shards fails.
    from worker_svc.agent import NodeAgent

    agent = NodeAgent("10.1.2.3", jax_devices=[FakeJaxDevice("cpu", 0), FakeJaxDevice("gpu", 0, "NVIDIA A100"),
                                               FakeJaxDevice("gpu", 1, "NVIDIA A100")],
                      nvml=FakeNvml([a100(0), a100(1)]), proc_root=host.proc_root(host.FP32_CPU), env={})
    gpus = [d for d in agent.describe().devices if d.platform == "cuda"]
    assert [d.execution_device for d in gpus] == ["cuda:0", "cuda:1"]
    assert all(agent.jax_devices[d.execution_device].platform == "gpu" for d in gpus)
    assert set(agent.jax_devices) == {"cpu:0", "cuda:0", "cuda:1"}


def test_a_host_without_cuda_gives_the_agent_no_cuda_devices():
    from worker_svc.agent import cuda_devices

    class NoCuda:  # jax without its CUDA plugin, or with no driver
        @staticmethod
        def devices(backend):
            raise RuntimeError(f"Unknown backend: '{backend}' requested")

    class OneGpu:
        @staticmethod
        def devices(backend):
            assert backend == "cuda"
            return [FakeJaxDevice("gpu", 0)]

    assert cuda_devices(NoCuda) == []
    assert [d.id for d in cuda_devices(OneGpu)] == [0]
