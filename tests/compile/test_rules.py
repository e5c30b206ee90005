"""Compile rules: the shipped table against real devices, explanations, target types, bad files."""

from __future__ import annotations

import re

import pytest

from accelmesh.errors import FailedPrecondition, InvalidArgument
from accelmesh.hardware.catalog import load_catalog
from accelmesh.hardware.model import DeviceSpec, Performance
from compile_svc.rules import DEFAULT_RULES_PATH, RULES_ENV, load_rules, loads_rules

CATALOG = load_catalog()


def catalog_device(type_: str, index: int = 0, **changes) -> DeviceSpec:
    entry = CATALOG[type_]
    spec = DeviceSpec(
        id=f"10.0.0.1/{entry.platform}:{index}", node_ip="10.0.0.1", local_index=index,
        platform=entry.platform, kind=entry.kind, type=entry.type, capabilities=entry.capabilities,
        compute_capability=entry.compute_capability, performance=entry.performance(),
    )
    return spec.replace(**changes)


def cpu_device(*flags: str, kind: str = "Test CPU") -> DeviceSpec:
    return DeviceSpec(
        id="10.0.0.1/cpu:0", node_ip="10.0.0.1", local_index=0, platform="cpu", kind=kind, type="cpu",
        capabilities=frozenset(flags), performance=Performance(memory_bytes=64_000_000_000, estimated=True),
    )


# Not in the catalog: a real 16 GB Ampere card, the kind of device cuda-bf16-small exists for.
A2 = DeviceSpec(
    id="10.0.0.2/cuda:0", node_ip="10.0.0.2", local_index=0, platform="cuda", kind="NVIDIA A2", type="a2",
    capabilities=frozenset({"tf32", "bf16", "fp16", "int8", "tensor_cores"}), compute_capability="8.6",
    performance=Performance(memory_bytes=16_000_000_000),
)

DEVICES: dict[str, tuple[DeviceSpec, str, str]] = {  # label -> (device, rule, compute dtype)
    "a100-80gb": (catalog_device("a100-80gb"), "cuda-bf16", "bf16"),
    "h100-sxm-80gb": (catalog_device("h100-sxm-80gb"), "cuda-bf16", "bf16"),
    "l4": (catalog_device("l4"), "cuda-bf16", "bf16"),  # 24 GB: above the small-memory line
    "a2-16gb": (A2, "cuda-bf16-small", "bf16"),
    "t4": (catalog_device("t4"), "cuda-fp32-small", "fp32"),
    "v100-32gb": (catalog_device("v100-32gb"), "cuda-fp32", "fp32"),
    "p100-16gb": (catalog_device("p100-16gb"), "cuda-fp32-small", "fp32"),
    "k80": (catalog_device("k80"), "cuda-fp32-small", "fp32"),
    "mi250x": (catalog_device("mi250x"), "rocm-bf16", "bf16"),
    "tpu-v4": (catalog_device("tpu-v4"), "tpu-bf16", "bf16"),
    "cpu-avx2": (cpu_device("avx2", "fma"), "cpu-avx2", "fp32"),
    "cpu-avx512": (cpu_device("avx512f", "avx2"), "cpu-avx512", "fp32"),
    "cpu-avx512-bf16": (cpu_device("avx512f", "avx512_bf16"), "cpu-avx512-bf16", "bf16"),
    "cpu-amx": (cpu_device("amx_bf16", "amx_tile", "avx512f"), "cpu-amx-bf16", "bf16"),
    "cpu-neon": (cpu_device("neon"), "default-fp32", "fp32"),
    # What the device IS decides: an A100 profile run on a CPU device still gets the CUDA rule.
    "emulated-a100": (catalog_device("a100-80gb", emulated=True, execution_device="cpu:0"), "cuda-bf16", "bf16"),
}


@pytest.fixture(scope="module")
def shipped():
    return load_rules(DEFAULT_RULES_PATH)


@pytest.mark.parametrize(("device", "rule", "dtype"), DEVICES.values(), ids=DEVICES.keys())
def test_shipped_rules_pick_the_expected_build(shipped, device, rule, dtype):
    chosen = shipped.match(device)
    assert (chosen.name, chosen.build.compute_dtype) == (rule, dtype)
    # bf16 keeps 8 significant bits: its bound is loose; fp32 builds must stay near fp32 rounding.
    if dtype == "bf16":
        assert chosen.build.tolerance == 5e-2
    else:
        assert chosen.build.tolerance <= 1e-4


def test_small_memory_gets_remat_and_cpu_vector_width_follows_the_isa(shipped):
    assert shipped.match(DEVICES["t4"][0]).build.remat
    assert not shipped.match(DEVICES["v100-32gb"][0]).build.remat
    assert shipped.match(DEVICES["a2-16gb"][0]).build.remat
    assert dict(shipped.match(DEVICES["cpu-avx2"][0]).build.xla_options) == {"xla_cpu_prefer_vector_width": 256}
    assert dict(shipped.match(DEVICES["cpu-amx"][0]).build.xla_options) == {"xla_cpu_prefer_vector_width": 512}


def test_every_shipped_rule_is_reachable_by_some_device(shipped):
    # The fp16 rules only under a precision that allows fp16 (tests/compile/test_precision.py).
    reached = {shipped.match(device, precision).name for device, _, _ in DEVICES.values() for precision in ("", "fp16")}
    assert reached == {rule.name for rule in shipped.rules}
    assert shipped.rules[-1].is_catch_all


def test_shipped_rule_lines_point_at_their_headers(shipped):
    lines = DEFAULT_RULES_PATH.read_text().splitlines()
    for rule in shipped.rules:
        assert lines[rule.line - 1].strip() == "[[rule]]"
        assert lines[rule.line].strip() == f'name = "{rule.name}"'


def test_explain_says_why_earlier_rules_were_skipped(shipped):
    explanation = shipped.explain(DEVICES["t4"][0])
    assert explanation.rule.name == "cuda-fp32-small"
    verdicts = {v.rule: v for v in explanation.verdicts}
    assert [v.rule for v in explanation.verdicts] == ["tpu-bf16", "cuda-bf16-small", "cuda-bf16", "cuda-fp16-volta",
                                                      "cuda-fp16-turing", "cuda-fp32-small"]
    assert verdicts["tpu-bf16"].reason == "platform tpu wanted, device is cuda"
    assert verdicts["cuda-bf16"].reason == "requires bf16, device lacks it"
    assert verdicts["cuda-fp16-turing"].reason.startswith("matches (platform is cuda; lacks bf16; kind 'Tesla T4' "
                                                          "fits '*T4*') but computes in fp16, which a job that names "
                                                          "no precision (fp16 rules are opt-in) does not allow")
    assert not any(v.matched for v in explanation.verdicts[:-1])
    assert explanation.verdicts[-1].matched
    assert explanation.verdicts[-1].reason == "platform is cuda; lacks bf16; memory 16 GB <= 20 GB"
    assert explanation.target_type == shipped.target_type(DEVICES["t4"][0])


def test_explain_reports_memory_and_forbidden_flags(shipped):
    explanation = shipped.explain(DEVICES["a100-80gb"][0])
    reasons = {v.rule: v.reason for v in explanation.verdicts}
    assert reasons["cuda-bf16-small"] == "needs memory <= 20 GB, device has 80 GB"
    assert reasons["cuda-bf16"] == "platform is cuda; has bf16"
    catch_all = shipped.explain(DEVICES["cpu-neon"][0])
    assert catch_all.verdicts[-1].reason == "catch-all: matches every device"
    assert "requires amx_bf16, avx512f, device lacks them" in [v.reason for v in catch_all.verdicts]
    assert len(catch_all.verdicts) == len(shipped.rules)


def test_target_type_groups_devices_that_can_share_an_artifact(shipped):
    first, second = catalog_device("a100-80gb", 0), catalog_device("a100-80gb", 1)
    assert shipped.target_type(first).key == shipped.target_type(second).key
    assert shipped.target_type(first).key != shipped.target_type(DEVICES["v100-32gb"][0]).key
    emulated = DEVICES["emulated-a100"][0]
    assert shipped.target_type(emulated).key != shipped.target_type(first).key
    assert shipped.target_type(emulated).execution_platform == "cpu"
    # Flags no rule reads (nvlink, tf32, ...) stay out of the key.
    assert shipped.target_type(first).capabilities == frozenset({"bf16"})
    assert shipped.read_flags() == frozenset({"bf16", "avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def test_kind_pattern_and_memory_bounds():
    table = loads_rules(
        """
[[rule]]
name = "a100-only"
description = "kind pattern, case-insensitive"
[rule.match]
kind = "*a100*"
min_memory_bytes = 50_000_000_000
[rule.build]
compute_dtype = "bf16"
tolerance = 0.05

[[rule]]
name = "rest"
description = "catch-all"
""",
        "inline.toml",
    )
    assert table.match(catalog_device("a100-80gb")).name == "a100-only"
    assert table.match(catalog_device("a100-40gb")).name == "rest"
    assert table.explain(catalog_device("a100-40gb")).verdicts[0].reason == "needs memory >= 50 GB, device has 40 GB"
    assert table.match(catalog_device("h100-sxm-80gb")).name == "rest"
    assert table.rules[1].build.compute_dtype == "fp32"  # build keys default to BuildOptions


GOOD_HEAD = """\
# header comment
[[rule]]
name = "tpu"
description = "tpus"
[rule.match]
platform = "tpu"
[rule.build]
compute_dtype = "bf16"
tolerance = 0.05
"""
CATCH_ALL = """
[[rule]]
name = "rest"
description = "everything else"
"""

BROKEN: dict[str, tuple[str, int, str]] = {  # label -> (file text, line in message, text in message)
    "syntax error": ("[[rule]]\nname = \"x\"\ndescription = oops\n", 3, "not valid TOML"),
    "bad dtype": (GOOD_HEAD.replace('"bf16"', '"bf17"') + CATCH_ALL, 8,
                  "rule[1] 'tpu': build.compute_dtype 'bf17' is not one of fp32, bf16, fp16"),
    "unknown match key": (GOOD_HEAD.replace('platform = "tpu"', 'platform = "tpu"\ncolour = "red"') + CATCH_ALL, 7,
                          "match.colour is not a known key; known keys: platform, requires"),
    "unknown build key": (GOOD_HEAD + "precision = 'high'\n" + CATCH_ALL, 10, "build.precision is not a known key"),
    "unknown capability": (GOOD_HEAD.replace('platform = "tpu"', 'requires = ["bf61"]') + CATCH_ALL, 6,
                           "match.requires names unknown capabilities ['bf61']; known: amx_bf16, amx_int8"),
    "unknown platform": (GOOD_HEAD.replace('platform = "tpu"', 'platform = "gpu"') + CATCH_ALL, 6,
                         "match.platform 'gpu' is not one of cpu, cuda, rocm, tpu"),
    "missing catch-all": (GOOD_HEAD, 5, "rule[1] 'tpu': match is not empty, but the last rule must be a catch-all"),
    "dead rules": (CATCH_ALL.replace("rest", "early") + GOOD_HEAD + CATCH_ALL, 2,
                   "rule[1] 'early': match is empty (a catch-all), so these rules are dead: tpu, rest"),
    "duplicate name": (GOOD_HEAD + GOOD_HEAD.replace("# header comment\n", "") + CATCH_ALL, 11,
                       "rule[2] 'tpu': name duplicates the name of rule[1]"),
    "max isa": (GOOD_HEAD.replace('platform = "tpu"', 'platform = "cpu"')
                + "[rule.build.xla_options]\nxla_cpu_max_isa = 'AVX2'\n" + CATCH_ALL, 11,
                "build.xla_options.xla_cpu_max_isa only takes effect process-wide through XLA_FLAGS"),
    "cpu option off cpu": (GOOD_HEAD + "[rule.build.xla_options]\nxla_cpu_prefer_vector_width = 512\n" + CATCH_ALL,
                           11, "exists only on the CPU backend"),
    "not an xla option": (GOOD_HEAD + "[rule.build.xla_options]\nfast = true\n" + CATCH_ALL, 11,
                          "build.xla_options.fast is not an XLA option"),
    "min above max": (GOOD_HEAD.replace('platform = "tpu"', "min_memory_bytes = 20\nmax_memory_bytes = 10") + CATCH_ALL,
                      6, "match.min_memory_bytes is larger than max_memory_bytes"),
    "tolerance zero": (GOOD_HEAD.replace("0.05", "0.0") + CATCH_ALL, 9, "build.tolerance is 0.0; a relative error"),
    "remat not bool": (GOOD_HEAD + "remat = 1\n" + CATCH_ALL, 10, "build.remat is 1, it must be true or false"),
    "missing description": (CATCH_ALL.replace('description = "everything else"\n', ""), 2,
                            "rule[1] 'rest': description must be a non-empty string"),
    "requires and forbids": (GOOD_HEAD.replace('platform = "tpu"', 'requires = ["bf16"]\nforbids = ["bf16"]')
                             + CATCH_ALL, 7, "match.forbids also requires bf16"),
}


@pytest.mark.parametrize(("text", "line", "message"), BROKEN.values(), ids=BROKEN.keys())
def test_broken_rule_files_name_file_line_and_field(tmp_path, text, line, message):
    path = tmp_path / "compile_rules.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as caught:
        load_rules(path)
    error = str(caught.value)
    assert message in error
    if "not valid TOML" in message:
        assert f"line {line}" in error
    else:
        assert error.startswith(f"{path}:{line}: ")


def test_empty_file_is_rejected():
    with pytest.raises(InvalidArgument, match=re.escape("empty.toml: no rules; write each rule as a [[rule]]")):
        loads_rules("# nothing\n", "empty.toml")


def test_environment_variable_chooses_the_file(tmp_path, monkeypatch):
    path = tmp_path / "mine.toml"
    path.write_text(CATCH_ALL.replace("rest", "only-rule"))
    monkeypatch.setenv(RULES_ENV, str(path))
    table = load_rules()
    assert (table.origin, [r.name for r in table.rules]) == (str(path), ["only-rule"])
    assert load_rules(env={}).origin == str(DEFAULT_RULES_PATH)  # an explicit env wins over os.environ


def test_missing_rule_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(RULES_ENV, str(tmp_path / "absent.toml"))
    with pytest.raises(FailedPrecondition, match=RULES_ENV):
        load_rules()
