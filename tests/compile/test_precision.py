"""A job's precision as the compile service applies it: rules whose compute dtype it does not allow
are passed over, fp16 rules only for inference that allows them (their tolerance measured on real
JAX against fp32), fp32 and bf16 builds of one device type kept apart in the artifact cache, and
every bad precision refused with its status code."""

from __future__ import annotations

import dataclasses

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _service_helpers import compile_config_at, compile_config_fixture, service_fixture, serving  # noqa: F401

from accelmesh import artifacts
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.errors import FailedPrecondition, InvalidArgument
from accelmesh.hardware.catalog import resolve_type
from accelmesh.hardware.model import DeviceSpec, Performance
from accelmesh.programs import BuildOptions
from accelmesh.runtime.devices import device_to_proto
from compile_svc.lowering import apply_build_options
from compile_svc.programs import default_registry
from compile_svc.rules import DEFAULT_RULES_PATH, PrecisionUnmet, load_rules, loads_rules

from conftest import rpc_error

SHIPPED = load_rules(DEFAULT_RULES_PATH)


def cpu_device(*flags: str) -> DeviceSpec:
    return DeviceSpec(id="10.0.0.1/cpu:0", node_ip="10.0.0.1", local_index=0, platform="cpu", kind="Test CPU",
                      type="cpu", capabilities=frozenset(flags), performance=Performance(memory_bytes=64 * 10**9))


# A real 16 GB Ampere card (not in the catalog): bf16, with the memory cuda-bf16-small is for.
A2 = DeviceSpec(id="10.0.0.2/cuda:0", node_ip="10.0.0.2", local_index=0, platform="cuda", kind="NVIDIA A2", type="a2",
                capabilities=frozenset({"tf32", "bf16", "fp16", "int8", "tensor_cores"}), compute_capability="8.6",
                performance=Performance(memory_bytes=16 * 10**9))
DEVICES = {
    **{name: resolve_type(name).device_spec("10.0.0.1", 0) for name in (
        "a100-80gb", "tpu-v4", "mi250x", "t4", "v100-16gb", "v100-32gb", "p100-16gb", "k80")},
    "a2-16gb": A2, "cpu-avx2": cpu_device("avx2", "fma"), "cpu-amx": cpu_device("amx_bf16", "amx_tile", "avx512f"),
    "cpu-avx512-bf16": cpu_device("avx512f", "avx512_bf16"),
}

# (device label, precision) -> (rule, compute dtype): "" is the table as written, fp16 rules excepted.
CHOICES = {
    ("a100-80gb", ""): ("cuda-bf16", "bf16"),
    ("a100-80gb", "bf16"): ("cuda-bf16", "bf16"),
    ("a100-80gb", "fp32"): ("default-fp32", "fp32"),  # fp32 at the highest matmul precision: no TF32
    ("a100-80gb", "fp16"): ("cuda-bf16", "bf16"),  # bf16 comes first: fp16 allows it too
    ("a2-16gb", "fp32"): ("default-fp32", "fp32"),
    ("tpu-v4", "fp32"): ("default-fp32", "fp32"),
    ("mi250x", "fp32"): ("default-fp32", "fp32"),
    ("cpu-amx", "fp32"): ("cpu-avx512", "fp32"),  # the same vector width, without bf16
    ("cpu-avx512-bf16", "fp32"): ("cpu-avx512", "fp32"),
    ("t4", ""): ("cuda-fp32-small", "fp32"),
    ("t4", "bf16"): ("cuda-fp32-small", "fp32"),
    ("t4", "fp16"): ("cuda-fp16-turing", "fp16"),
    ("v100-32gb", "fp32"): ("cuda-fp32", "fp32"),
    ("v100-32gb", "fp16"): ("cuda-fp16-volta", "fp16"),
    ("p100-16gb", "fp16"): ("cuda-fp32-small", "fp32"),  # fp16 but no tensor cores
    ("k80", "fp16"): ("cuda-fp32-small", "fp32"),
    ("cpu-avx2", "fp16"): ("cpu-avx2", "fp32"),
}


def device(type_name, index=0, emulated_on="cpu:0"):
    return device_to_proto(resolve_type(type_name).device_spec("127.0.0.1", index, emulated_on=emulated_on))


# --- the rule table ------------------------------------------------------------------------------

@pytest.mark.parametrize(("label", "precision"), CHOICES, ids=[f"{d}-{p or 'unset'}" for d, p in CHOICES])
def test_a_device_gets_the_first_matching_rule_its_precision_allows(label, precision):
    rule = SHIPPED.match(DEVICES[label], precision)
    assert (rule.name, rule.build.compute_dtype) == CHOICES[label, precision]


def test_both_v100s_get_the_volta_fp16_rule_only_when_fp16_is_allowed():
    assert SHIPPED.match(DEVICES["v100-16gb"], "fp16").name == "cuda-fp16-volta"
    assert SHIPPED.match(DEVICES["v100-16gb"]).name == "cuda-fp32-small"


def test_the_explanation_says_which_rules_the_precision_passed_over():
    explanation = SHIPPED.explain(DEVICES["a100-80gb"], "fp32")
    reasons = {v.rule: v.reason for v in explanation.verdicts}
    assert explanation.rule.name == "default-fp32" and explanation.precision == "fp32"
    assert reasons["cuda-bf16"] == "matches (platform is cuda; has bf16) but computes in bf16, which precision fp32 " \
                                   "does not allow"
    assert not any(v.matched for v in explanation.verdicts[:-1]) and explanation.verdicts[-1].matched
    # The target type does not change with the precision: the rule and its options key the artifact.
    assert explanation.target_type == SHIPPED.explain(DEVICES["a100-80gb"]).target_type


def test_an_unknown_precision_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument, match="precision 'fp8' is not one of") as caught:
        SHIPPED.match(DEVICES["a100-80gb"], "fp8")
    assert caught.value.field == "precision"


BF16_CATCH_ALL = loads_rules('''
[[rule]]
name = "cpu-fp32"
description = "CPUs compute in fp32"
[rule.match]
platform = "cpu"
[rule.build]
compute_dtype = "fp32"

[[rule]]
name = "everything-bf16"
description = "every other device computes in bf16"
[rule.build]
compute_dtype = "bf16"
tolerance = 5e-2
''', "bf16.toml")


def test_a_precision_no_matching_rule_meets_names_the_device_and_its_rules():
    tpu = DEVICES["tpu-v4"]
    with pytest.raises(PrecisionUnmet) as caught:
        BF16_CATCH_ALL.match(tpu, "fp32")
    assert str(caught.value) == (f"device {tpu.id} (tpu:tpu-v4[]) matches only rules computing in dtypes precision "
                                 "fp32 does not allow: everything-bf16 (bf16)")
    assert isinstance(caught.value, FailedPrecondition)
    assert BF16_CATCH_ALL.match(DEVICES["cpu-avx2"], "fp32").name == "cpu-fp32"


# --- fp16 on real JAX: the rule's tolerance against the fp32 reference ----------------------------

def _inputs(program, seed: int, rows: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=(rows, *s.shape[1:])).astype(s.dtype) if "int" in s.dtype
            else (3 * rng.standard_normal((rows, *s.shape[1:]))).astype(s.dtype) for s in program.inputs]


def _relative_error(program, options: BuildOptions, seed: int) -> float:
    params, xs = program.init_params(seed) if program.init_params else [], _inputs(program, seed)
    reference = jax.jit(program.fn)(*params, *xs)
    got = jax.jit(apply_build_options(program, options))(*params, *xs)
    assert all(g.dtype == r.dtype for g, r in zip(got, reference))  # the interface keeps its dtypes
    return max(float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) for g, r in zip(got, reference))


# The shipped inference programs a V100 or T4 runs that fit a test (the zoo's billion-parameter
# models are measured in compile_rules.toml's comment instead).
@pytest.mark.parametrize("name", ["identity", "mlp_classifier", "transformer_encoder"])
@pytest.mark.parametrize("rule", ["cuda-fp16-volta", "cuda-fp16-turing"])
def test_fp16_builds_stay_within_their_rules_tolerance_of_fp32(name, rule):
    program = default_registry().get(name)
    options = next(r for r in SHIPPED.rules if r.name == rule).build
    bf16 = next(r for r in SHIPPED.rules if r.name == "cuda-bf16").build
    for seed in (0, 1):
        error = _relative_error(program, options, seed)
        # Above zero: the math really ran in fp16; below bf16's: 11 significant bits, not 8.
        assert 0 < error <= options.tolerance, (name, seed, error)
        assert error < _relative_error(program, bf16, seed) / 2, (name, seed)


# --- through the service -------------------------------------------------------------------------

def test_an_a100s_fp32_and_bf16_builds_are_cached_apart_and_never_served_for_each_other(service):
    stub, compiler = service

    def build(precision):
        response = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=[device("a100-80gb")],
                                                  batch_sizes=[4], precision=precision))
        (only,) = response.builds
        return only

    bf16, fp32 = build(common_pb2.PRECISION_UNSPECIFIED), build(common_pb2.PRECISION_FP32)
    assert (bf16.rule.name, fp32.rule.name) == ("cuda-bf16", "default-fp32")
    assert bf16.target_type == fp32.target_type  # one target type, two rules: the rule keys the artifact
    assert bf16.portable.key != fp32.portable.key and bf16.executables[0].key != fp32.executables[0].key
    assert compiler.cache.builds == 4  # a portable and an executable each
    again = {p: build(p) for p in (common_pb2.PRECISION_BF16_ALLOWED, common_pb2.PRECISION_FP32,
                                   common_pb2.PRECISION_UNSPECIFIED)}
    assert compiler.cache.builds == 4 and all(b.portable.cache_hit for b in again.values())
    assert again[common_pb2.PRECISION_FP32].portable.key == fp32.portable.key
    assert (again[common_pb2.PRECISION_BF16_ALLOWED].portable.key
            == again[common_pb2.PRECISION_UNSPECIFIED].portable.key == bf16.portable.key)
    fetched = {rule: artifacts.hlo_text(b"".join(p.chunk for p in stub.FetchArtifact(
        pb.FetchArtifactRequest(key=key)))) for rule, key in (("bf16", bf16.portable.key), ("fp32", fp32.portable.key))}
    assert "xbf16>" in fetched["bf16"] and "xbf16>" not in fetched["fp32"]


def test_a_mixed_request_under_fp16_builds_fp16_only_where_a_rule_allows_it(service):
    stub, _ = service
    response = stub.Compile(pb.CompileRequest(
        program="transformer_encoder", precision=common_pb2.PRECISION_FP16_ALLOWED,
        targets=[device("a100-80gb"), device("v100-32gb", 1, "cpu:1"), device("t4", 2, "cpu:2"),
                 device("p100-16gb", 3, "cpu:3")]))
    rules = {b.target_type.split(":")[1].split("[")[0]: (b.rule.name, b.rule.build.compute_dtype)
             for b in response.builds}
    assert rules == {"a100-80gb": ("cuda-bf16", "bf16"), "v100-32gb": ("cuda-fp16-volta", "fp16"),
                     "t4": ("cuda-fp16-turing", "fp16"), "p100-16gb": ("cuda-fp32-small", "fp32")}


def test_explain_rule_applies_the_precision(service):
    stub, _ = service
    explained = stub.ExplainRule(pb.ExplainRuleRequest(device=device("t4"),
                                                       precision=common_pb2.PRECISION_FP16_ALLOWED))
    assert explained.rule.name == "cuda-fp16-turing" and explained.rule.build.compute_dtype == "fp16"
    assert explained.rule.build.tolerance == pytest.approx(1e-2)
    fp32 = stub.ExplainRule(pb.ExplainRuleRequest(device=device("a100-80gb"), precision=common_pb2.PRECISION_FP32))
    assert fp32.rule.name == "default-fp32"
    assert "which precision fp32 does not allow" in {v.rule: v.reason for v in fp32.verdicts}["cuda-bf16"]


@pytest.mark.parametrize(("request_for", "message"), [
    (lambda: pb.CompileRequest(program="mlp_classifier", targets=[device("t4")], precision=99),
     "precision 99 is not a Precision"),
    (lambda: pb.CompileRequest(program="mlp_train_step", targets=[device("t4")],
                               precision=common_pb2.PRECISION_FP16_ALLOWED),
     "precision fp16 is for inference only, and mlp_train_step@1 is a training step"),
    (lambda: pb.CompileRequest(program="transformer_encoder", targets=[device("t4")],
                               layers=pb.LayerRange(first=1, count=2, backward=True),
                               precision=common_pb2.PRECISION_FP16_ALLOWED),
     "is a stage's backward pass asked for"),
    (lambda: pb.ExplainRuleRequest(device=device("t4"), precision=7), "precision 7 is not a Precision"),
], ids=["unknown-compile", "fp16-training-step", "fp16-backward-stage", "unknown-explain"])
def test_a_bad_precision_is_invalid_argument_naming_the_field(service, request_for, message):
    stub, _ = service
    request = request_for()
    method = stub.ExplainRule if isinstance(request, pb.ExplainRuleRequest) else stub.Compile
    error = rpc_error(method, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
    assert "precision" in error.details()


def test_a_precision_that_leaves_devices_without_a_rule_is_failed_precondition(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "cpu-fp32"\ndescription = "CPUs in fp32"\n[rule.match]\nplatform = "cpu"\n'
                     '[rule.build]\ncompute_dtype = "fp32"\n\n[[rule]]\nname = "everything-bf16"\n'
                     'description = "every other device in bf16"\n[rule.build]\ncompute_dtype = "bf16"\n'
                     'tolerance = 5e-2\n')
    config = dataclasses.replace(compile_config_at(tmp_path), rules=str(rules))
    with serving(config) as (stub, compiler):
        targets = [device("a100-80gb"), device("a100-80gb", 1, "cpu:1"), device("tpu-v4", 2, "cpu:2")]
        error = rpc_error(stub.Compile, pb.CompileRequest(program="identity", targets=targets,
                                                          precision=common_pb2.PRECISION_FP32))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = error.details()
        assert "precision fp32 leaves all of the 3 target devices without a compile rule" in details
        assert "device 127.0.0.1/cuda:0 (cuda@cpu:a100-80gb[]) matches only rules computing in dtypes precision " \
               "fp32 does not allow: everything-bf16 (bf16)" in details
        assert "127.0.0.1/tpu:2" in details and "127.0.0.1/cuda:1" not in details  # one line per target type
        assert "Allow bf16 in precision, leave these devices out (constraints)" in details
        assert compiler.cache.builds == 0
        explain = rpc_error(stub.ExplainRule,
                            pb.ExplainRuleRequest(device=targets[2], precision=common_pb2.PRECISION_FP32))
        assert explain.code() == grpc.StatusCode.FAILED_PRECONDITION and "everything-bf16 (bf16)" in explain.details()
        # Without the precision, the same devices build.
        assert len(stub.Compile(pb.CompileRequest(program="identity", targets=targets)).builds) == 2

