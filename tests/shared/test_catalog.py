"""The device catalog: packaged datasheet figures, validation and name resolution."""

from __future__ import annotations

from importlib import resources

import pytest

from accelmesh.errors import InvalidArgument, NotFound
from accelmesh.hardware.capabilities import CAPABILITIES
from accelmesh.hardware.catalog import find_by_kind, load_catalog, resolve_type

EXPECTED_TYPES = {
    "a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200-sxm-141gb", "v100-16gb", "v100-32gb", "t4", "l4",
    "mi250x", "tpu-v4", "p100-16gb", "k80",
}


def test_every_entry_loads_with_consistent_fields():
    catalog = load_catalog()
    assert set(catalog) == EXPECTED_TYPES
    for name, entry in catalog.items():
        assert entry.type == name
        assert entry.capabilities <= CAPABILITIES.keys()
        assert entry.source and entry.kind
        performance = entry.performance()
        assert performance.peak_tflops == dict(entry.peak_tflops)
        assert performance.memory_bytes == entry.memory_bytes > 0
        assert not performance.estimated


@pytest.mark.parametrize(
    ("type_", "precision", "tflops"),
    [
        ("a100-80gb", "bf16", 312.0),
        ("a100-80gb", "tf32", 156.0),
        ("a100-40gb", "int8", 624.0),
        ("h100-sxm-80gb", "fp8", 1978.9),
        ("h200-sxm-141gb", "bf16", 989.4),
        ("v100-16gb", "fp16", 125.0),
        ("t4", "int8", 130.0),
        ("l4", "fp8", 242.5),
        ("tpu-v4", "bf16", 275.0),
        ("tpu-v4", "int8", 275.0),
        ("mi250x", "bf16", 191.5),
        ("k80", "fp64", 1.455),
    ],
)
def test_datasheet_rates(type_, precision, tflops):
    assert load_catalog()[type_].peak_tflops[precision] == pytest.approx(tflops)


@pytest.mark.parametrize(
    ("type_", "memory_bytes", "bandwidth_gbps"),
    [
        ("a100-80gb", 80_000_000_000, 2039.0),
        ("a100-40gb", 40_000_000_000, 1555.0),
        ("h100-sxm-80gb", 80_000_000_000, 3350.0),
        ("v100-32gb", 32_000_000_000, 900.0),
        ("tpu-v4", 32 * 2**30, 1200.0),
    ],
)
def test_datasheet_memory(type_, memory_bytes, bandwidth_gbps):
    entry = load_catalog()[type_]
    assert (entry.memory_bytes, entry.memory_bandwidth_gbps) == (memory_bytes, bandwidth_gbps)


def test_missing_precisions_are_absent_not_zero():
    catalog = load_catalog()
    v100, tpu = catalog["v100-16gb"], catalog["tpu-v4"]
    assert "bf16" not in v100.peak_tflops and "bf16" not in v100.capabilities
    assert v100.performance().rate_tflops("bf16") == 15.7  # falls back to its fp32 rate
    assert "fp32" not in tpu.peak_tflops
    assert "fp8" not in catalog["a100-80gb"].capabilities
    assert {"fp8", "tensor_cores", "nvlink"} <= catalog["h100-sxm-80gb"].capabilities
    assert "matrix_cores" in catalog["mi250x"].capabilities


def test_explicit_path_reads_the_same_catalog(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_bytes((resources.files("accelmesh.hardware") / "catalog.toml").read_bytes())
    assert load_catalog(path) == load_catalog()


VALID_ENTRY = """
[{name}]
kind = "Test GPU"
platform = "cuda"
compute_capability = "8.0"
peak_tflops = {{ fp32 = 10.0, bf16 = 100.0 }}
memory_bytes = 16_000_000_000
memory_bandwidth_gbps = 900.0
interconnect = "pcie4-x16"
interconnect_bandwidth_gbps = 31.5
capabilities = ["bf16", "tensor_cores"]
aliases = ["TG"]
source = "test datasheet"
"""


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('platform = "cuda"', 'platform = "gpu"', "platform"),
        ('["bf16", "tensor_cores"]', '["bf16", "bf17"]', "capabilities"),
        ('["bf16", "tensor_cores"]', '["tensor_cores"]', "capabilities"),
        ("fp32 = 10.0", "fp32 = -1.0", "peak_tflops"),
        ("fp32 = 10.0", "fp33 = 10.0", "peak_tflops"),
        ("memory_bytes = 16_000_000_000", "memory_bytes = 16e9", "memory_bytes"),
        ("memory_bytes = 16_000_000_000", "memroy_bytes = 16_000_000_000", "memroy_bytes"),
        ('source = "test datasheet"', "", "source"),
        ('aliases = ["TG"]', 'aliases = "TG"', "aliases"),
    ],
)
def test_broken_entry_names_entry_and_field(tmp_path, old, new, field):
    text = VALID_ENTRY.format(name="test-gpu")
    assert old in text
    path = tmp_path / "catalog.toml"
    path.write_text(text.replace(old, new))
    with pytest.raises(InvalidArgument) as raised:
        load_catalog(path)
    assert "'test-gpu'" in str(raised.value)
    assert f"'{field}'" in str(raised.value)


def test_valid_entry_loads(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text(VALID_ENTRY.format(name="test-gpu"))
    assert load_catalog(path)["test-gpu"].peak_tflops["bf16"] == 100.0


def test_alias_naming_two_types_is_rejected(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text(VALID_ENTRY.format(name="gpu-a") + VALID_ENTRY.format(name="gpu-b"))
    with pytest.raises(InvalidArgument, match=r"'gpu-b' field 'aliases': 'TG' already names 'gpu-a'"):
        load_catalog(path)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text("[a100-80gb\nkind = ")
    with pytest.raises(InvalidArgument, match="catalog.toml: not valid TOML"):
        load_catalog(path)


@pytest.mark.parametrize(
    ("name", "type_"),
    [
        ("P100", "p100-16gb"),
        ("V100", "v100-16gb"),
        ("V100M32", "v100-32gb"),
        ("T4", "t4"),
        ("v100m32", "v100-32gb"),
        ("a100-80gb", "a100-80gb"),
        ("A100-80GB", "a100-80gb"),
        (" tpu-v4 ", "tpu-v4"),
    ],
)
def test_resolve_type_accepts_aliases_in_any_case(name, type_):
    assert resolve_type(name).type == type_


def test_unknown_type_lists_known_types():
    with pytest.raises(NotFound) as raised:
        resolve_type("rtx-9090")
    assert "'rtx-9090'" in str(raised.value)
    assert "a100-80gb" in str(raised.value) and "tpu-v4" in str(raised.value)


def test_find_by_kind_matches_vendor_names():
    catalog = load_catalog()
    assert find_by_kind("NVIDIA A100-SXM4-80GB", catalog).type == "a100-80gb"
    assert find_by_kind("tesla  v100-sxm2-32gb", catalog).type == "v100-32gb"
    assert find_by_kind("NVIDIA H200", catalog).type == "h200-sxm-141gb"  # what NVML names the lent GPU
    assert find_by_kind("NVIDIA GeForce RTX 3090", catalog) is None
