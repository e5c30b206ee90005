"""Filter strings: what each accepted one selects (in Python and via the store), and how bad ones fail."""

from __future__ import annotations

import pytest
from store_records import module_database_url_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance
from inventory_svc.filtering import DeviceFilter, parse_filter
from inventory_svc.store import SqlStore

GIB = 2**30
NOW = 10.0


def _spec(device_id: str, platform: str, type_: str, kind: str, caps: set[str], memory: int, **extra) -> DeviceSpec:
    ip, _, local = device_id.partition("/")
    return DeviceSpec(
        id=device_id, node_ip=ip, local_index=int(local.split(":")[1]), platform=platform, kind=kind, type=type_,
        capabilities=frozenset(caps), performance=Performance({"fp32": 10.0}, memory, 900.0), **extra,
    )


A100 = _spec("10.0.0.1/cuda:0", "cuda", "a100-80gb", "NVIDIA A100-SXM4-80GB", {"bf16", "tf32", "tensor_cores"},
             80 * GIB)
V100 = _spec("10.0.0.1/cuda:1", "cuda", "v100-16gb", "Tesla V100-SXM2-16GB", {"fp16", "tensor_cores"}, 16 * GIB)
MI250 = _spec("10.0.0.2/rocm:0", "rocm", "mi250x", "AMD Instinct MI250X", {"bf16", "matrix_cores"}, 64 * GIB)
CPU = _spec("10.0.0.2/cpu:0", "cpu", "cpu", "Intel Xeon", {"avx2", "avx512f"}, 32 * GIB)
EMULATED = _spec(
    "10.0.0.3/cuda:0", "cuda", "a100-80gb", "NVIDIA A100-SXM4-80GB", {"bf16"}, 80 * GIB,
    emulated=True, execution_device="cpu:1",
)
USED = {A100.id: 10 * GIB, V100.id: 8 * GIB}  # the others have no sample: free = datasheet memory
A, B, C, D, E = (s.id for s in (A100, V100, MI250, CPU, EMULATED))  # E's node is lost


@pytest.fixture(scope="module")
def store(module_database_url):
    store = SqlStore(module_database_url)
    for ip, specs in (("10.0.0.1", [A100, V100]), ("10.0.0.2", [MI250, CPU]), ("10.0.0.3", [EMULATED])):
        store.upsert_node(f"{ip}:50051", ip, ip, now=0.0)
        samples = [DeviceSample(s.id, 1.0, s.performance.memory_bytes, USED[s.id]) for s in specs if s.id in USED]
        store.record_poll_success(f"{ip}:50051", NodeDescription(ip, ip, tuple(specs), tuple(samples)), now=1.0)
    store.record_poll_failure("10.0.0.3:50051", "unreachable", now=2.0, lost_after=1)
    yield store
    store.close()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", [A, B, D, C]),
        ("   ", [A, B, D, C]),
        ('platform = "cuda"', [A, B]),
        ("platform = cuda", [A, B]),
        ('platform != "cuda"', [D, C]),
        ('type = "a100-80gb"', [A]),
        ('type = "a100-80gb" AND health = "lost"', [E]),
        ('health = "lost"', [E]),
        ('health != "lost"', [A, B, D, C]),
        ("health = healthy", [A, B, D, C]),
        ('kind = "NVIDIA A100-SXM4-80GB"', [A]),
        ('kind = "say \\"hi\\""', []),
        ('node = "10.0.0.2:50051"', [D, C]),
        ("node = 10.0.0.2:50051", [D, C]),
        ('emulated = true AND health = "lost"', [E]),
        ("emulated = false", [A, B, D, C]),
        ("capabilities:bf16", [A, C]),
        ("capabilities : bf16", [A, C]),
        ("capabilities:tensor_cores AND capabilities:bf16", [A]),
        ("free_memory_bytes >= 60000000000", [A, C]),
        ("free_memory_bytes < 1e10", [B]),
        (f"free_memory_bytes = {8 * GIB}", [B]),
        (f"free_memory_bytes != {8 * GIB}", [A, D, C]),
        (f"free_memory_bytes <= {32 * GIB} AND free_memory_bytes > {8 * GIB}", [D]),
        ('free_memory_bytes > 0 AND platform = "rocm"', [C]),
        ('  platform  =  "cuda"   AND   capabilities:fp16  ', [B]),
    ],
)
def test_filter_selects(store, text, expected):
    flt = parse_filter(text)
    everything = store.list_devices(DeviceFilter(include_lost=True), now=NOW)[0]
    assert [r.id for r in everything if flt.matches(r)] == expected
    # The store pushes terms down to SQL; it must agree with matches().
    assert [r.id for r in store.list_devices(flt, now=NOW)[0]] == expected


@pytest.mark.parametrize(
    "text, fragments",
    [
        ('platform == "cuda"', ['platform == "cuda"', "field op value", 'e.g. platform = "cuda"']),
        ("platform", ["'platform' is not of the form field op value"]),
        ('= "cuda"', ["is not of the form"]),
        ('type = "a100', ['type = "a100', "is not of the form"]),
        ('platform = "cuda" and type = "x"', ["and type", "without 'AND' (upper case)"]),
        ('platform = "cuda" AND', ["ends with 'AND'", "e.g."]),
        ('colour = "red"', ["unknown field 'colour'", "known fields: capabilities, emulated, free_memory_bytes"]),
        ("capabilities:bf17", ["unknown capability 'bf17'", "bf16", "avx512f"]),
        ('platform = "gpu"', ["platform must be one of cpu, cuda, rocm, tpu", "'gpu'"]),
        ('health = "dead"', ["health must be one of healthy, lost", "'dead'"]),
        ("emulated = yes", ["emulated is true or false", "'yes'"]),
        ("free_memory_bytes >= lots", ["finite number", "free_memory_bytes >= 1000000000"]),
        ("free_memory_bytes >= inf", ["finite number"]),
        ('type > "a100"', ["type compares only with = or !=", "'>'"]),
        ("capabilities = bf16", ["capabilities:bf16"]),
        ("platform:cuda", ["':' (has) applies only to capabilities"]),
        pytest.param("capabilities:bf16 AND " * 300 + "capabilities:bf16", ["keep it under 4096"], id="too-long"),
    ],
)
def test_bad_filters_name_the_field_and_the_term(text, fragments):
    with pytest.raises(InvalidArgument) as caught:
        parse_filter(text)
    message = str(caught.value)
    assert message.startswith("filter")
    for fragment in fragments:
        assert fragment in message


def test_health_in_any_term_lifts_the_lost_default():
    assert not parse_filter('platform = "cuda"').include_lost
    assert parse_filter('platform = "cuda" AND health = "healthy"').include_lost
