"""Lowering under compile rules: one interface per program, rule-dependent internals, every platform."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from accelmesh import artifacts
from accelmesh.errors import FailedPrecondition, InvalidArgument
from accelmesh.programs import BuildOptions, OutputSpec, Program, TensorSpec
from compile_svc import lowering

FP32, BF16 = BuildOptions(), BuildOptions(compute_dtype="bf16")


def mlp(w1, b1, w2, x):
    return (jnp.tanh(x @ w1 + b1) @ w2,)


MLP = Program(
    name="test-mlp", version="1", kind="function", description="two dense layers",
    parameters=(TensorSpec("w1", "float32", (16, 32)), TensorSpec("b1", "float32", (32,)),
                TensorSpec("w2", "float32", (32, 4))),
    inputs=(TensorSpec("x", "float32", (None, 16)),),
    outputs=(OutputSpec("y", "float32", (None, 4)),),
    digest="test-mlp-1", fn=mlp,
)
RNG = np.random.default_rng(0)
PARAMS = [(RNG.standard_normal(s.shape) * 0.3).astype(np.float32) for s in MLP.parameters]
X8 = RNG.standard_normal((8, 16)).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    w1, b1, w2 = (p.astype(np.float64) for p in PARAMS)
    return np.tanh(x.astype(np.float64) @ w1 + b1) @ w2


def rel_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


_ARTIFACTS: dict[tuple, bytes] = {}


def portable(options: BuildOptions, platform: str = "cpu", program: Program = MLP) -> bytes:
    """Exports are shared across tests: each costs tens of milliseconds."""
    key = (program.digest, repr(options), platform)
    if key not in _ARTIFACTS:
        _ARTIFACTS[key] = lowering.export_portable(program, options, platform)
    return _ARTIFACTS[key]


def bf16_tensors(data: bytes) -> list[str]:
    # Match tensor types, not the debug locations (which quote test names like this file's).
    return re.findall(r"tensor<[^>]*bf16>", artifacts.hlo_text(data))


def test_bf16_rule_changes_the_hlo_and_fp32_does_not_use_bf16():
    assert "tensor<16x32xbf16>" in bf16_tensors(portable(BF16))
    assert bf16_tensors(portable(FP32)) == []


@pytest.mark.parametrize("options, tolerance", [
    (FP32, 1e-5),
    (BF16, 2e-2),
    (BuildOptions(compute_dtype="fp16"), 5e-3),
    (BuildOptions(remat=True), 1e-5),
    (BuildOptions(matmul_precision="highest"), 1e-5),
])
def test_portable_artifact_runs_on_cpu_within_the_rule_tolerance(options, tolerance):
    (y,) = artifacts.run_portable(artifacts.load_portable(portable(options)), options, *PARAMS, X8)
    assert y.dtype == jnp.float32 and y.shape == (8, 4)
    assert rel_error(y, reference(X8)) < tolerance


def test_fp32_is_tighter_than_bf16_so_the_tolerance_test_can_fail():
    errors = {o.compute_dtype: rel_error(
        artifacts.run_portable(artifacts.load_portable(portable(o)), o, *PARAMS, X8)[0], reference(X8))
        for o in (FP32, BF16)}
    assert errors["fp32"] < 1e-5 < errors["bf16"]


def test_interface_is_identical_across_rules_and_platforms():
    def interface(data: bytes):
        exp = artifacts.load_portable(data)
        return [(str(a.shape), a.dtype) for a in exp.in_avals], [(str(a.shape), a.dtype) for a in exp.out_avals]

    variants = [portable(FP32), portable(BF16), portable(BuildOptions(compute_dtype="fp16")), portable(BF16, "cuda")]
    assert all(interface(v) == interface(variants[0]) for v in variants)
    assert interface(variants[0])[1] == [("(b, 4)", jnp.float32)]


def test_matmul_precision_is_recorded_in_the_hlo():
    assert "HIGHEST" in artifacts.hlo_text(portable(BuildOptions(matmul_precision="highest")))
    assert "HIGHEST" not in artifacts.hlo_text(portable(FP32))


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_accelerator_artifacts_are_built_here_but_refuse_to_run_on_cpu(platform):
    exp = artifacts.load_portable(portable(BF16, platform))
    assert exp.platforms == (platform,)
    with pytest.raises(ValueError, match="exported for platforms"):
        exp.call(*PARAMS, X8)
    with pytest.raises(FailedPrecondition, match=platform):
        artifacts.run_portable(exp, BF16, *PARAMS, X8)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_one_portable_artifact_serves_every_batch_size(batch):
    (y,) = artifacts.run_portable(artifacts.load_portable(portable(FP32)), FP32, *PARAMS, X8[:batch])
    assert y.shape == (batch, 4)
    assert rel_error(y, reference(X8[:batch])) < 1e-5


def test_integer_inputs_are_not_cast_to_the_compute_dtype():
    # ids above 256 are not representable in bf16; a cast would fetch the wrong rows.
    table = (np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4) % 7) / 7
    embed = Program("embed", "1", "function", "lookup", (TensorSpec("table", "float32", (1000, 4)),),
                    (TensorSpec("ids", "int32", (None,)),), (OutputSpec("v", "float32", (None, 4)),),
                    "embed-1", fn=lambda t, ids: (t[ids],))
    ids = np.array([257, 999, 513], np.int32)
    exp = artifacts.load_portable(portable(BF16, program=embed))
    assert [a.dtype for a in exp.in_avals] == [jnp.float32, jnp.int32]
    (v,) = artifacts.run_portable(exp, BF16, table, ids)
    np.testing.assert_allclose(np.asarray(v), table[ids], rtol=1e-2)


def test_remat_gives_the_same_gradients():
    def loss(fn):
        return jax.grad(lambda p: jnp.sum(fn(*p, X8)[0] ** 2))(PARAMS)

    plain = loss(lowering.apply_build_options(MLP, FP32))
    remat = loss(lowering.apply_build_options(MLP, BuildOptions(remat=True)))
    for a, b in zip(plain, remat):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_executable_round_trips_and_matches():
    blob = lowering.compile_executable(MLP, BF16, batch_size=8)
    (y,) = artifacts.load_executable(blob)(*PARAMS, X8)
    assert y.dtype == jnp.float32 and rel_error(y, reference(X8)) < 2e-2


def test_an_executable_takes_numpy_arrays_held_arrays_and_other_dtypes_alike(monkeypatch):
    """Numpy arguments of the input's own dtype take the batched put, the rest device_put: the
    results are the same either way, and the same as with device_put alone."""
    run = artifacts.load_executable(lowering.compile_executable(MLP, FP32, batch_size=8))
    (direct,) = run(*PARAMS, X8)
    (mixed,) = run(*[jax.device_put(p) for p in PARAMS], X8.astype(np.float64))
    monkeypatch.setattr(artifacts, "_batched_put", None)
    (plain,) = run(*PARAMS, X8)
    assert np.array_equal(np.asarray(direct), np.asarray(plain))
    assert np.array_equal(np.asarray(mixed), np.asarray(plain))
    assert rel_error(direct, reference(X8)) < 1e-5


def test_executable_from_another_jaxlib_or_schema_is_refused():
    header, payload = artifacts.split_executable(lowering.compile_executable(MLP, FP32, batch_size=2))
    assert header["inputs"] == ([[str(np.dtype(p.dtype)), list(p.shape)] for p in PARAMS]
                                + [["float32", [2, X8.shape[1]]]])
    with pytest.raises(FailedPrecondition, match="jaxlib 0.0.1"):
        artifacts.load_executable(artifacts.join_executable({**header, "jaxlib": "0.0.1"}, payload))
    with pytest.raises(FailedPrecondition, match="schema 1"):
        artifacts.load_executable(artifacts.join_executable({**header, "schema": 1}, payload))


@pytest.mark.parametrize("data, words", [
    (pickle.dumps(({"schema": 1}, b"", None, None)), "not an accelmesh executable"),  # the old format
    (b"AMXE" + (2**31).to_bytes(4, "big") + b"{}", "does not fit"),
    (b"AMXE" + (5).to_bytes(4, "big") + b"[1,2]", "not a JSON object"),
    (b"AMXE" + (3).to_bytes(4, "big") + b"{x}", "not JSON"),
])
def test_bytes_that_are_not_an_executable_are_refused_before_anything_loads(data, words):
    with pytest.raises(InvalidArgument, match=words):
        artifacts.load_executable(data)


def test_executable_loads_in_a_fresh_process_on_another_device(tmp_path: Path):
    """One executable serves every device of a target type: built for cpu:0, run on cpu:1."""
    (tmp_path / "exe.bin").write_bytes(lowering.compile_executable(MLP, FP32, batch_size=8))
    np.savez(tmp_path / "args.npz", *PARAMS, X8)
    script = (
        "import json, sys, numpy as np, jax\n"
        "from accelmesh.artifacts import load_executable\n"
        "d = jax.devices()[1]\n"
        "f = load_executable(open(sys.argv[1], 'rb').read(), device=d)\n"
        "a = np.load(sys.argv[2]); args = [jax.device_put(a[f'arr_{i}'], d) for i in range(4)]\n"
        "(y,) = f(*args)\n"
        "print(json.dumps({'device': next(iter(y.devices())).id, 'y': np.asarray(y).tolist()}))\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "exe.bin"), str(tmp_path / "args.npz")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == 1
    assert rel_error(np.array(result["y"]), reference(X8)) < 1e-5


@pytest.mark.parametrize("width", [256, 512])
def test_vector_width_option_reaches_code_generation(tmp_path: Path, width: int):
    # The optimised HLO text is identical across widths (the dots go to a library); LLVM's
    # function attributes are where a per-compilation option shows it was honoured.
    options = BuildOptions(xla_options={"xla_cpu_prefer_vector_width": width, "xla_dump_to": str(tmp_path)})
    assert lowering.compile_executable(MLP, options, batch_size=8)
    llvm = "".join(p.read_text() for p in tmp_path.glob("*ir-with-opt.ll"))
    assert f'"prefer-vector-width"="{width}"' in llvm


@pytest.mark.parametrize("value", [True, "true", "False"])
def test_bool_xla_options_accept_python_and_toml_spellings(value):
    assert lowering.compile_executable(MLP, BuildOptions(xla_options={"xla_cpu_enable_fast_math": value}), 2)


def test_unknown_xla_option_is_a_failed_precondition_with_xla_reason():
    bad = BuildOptions(xla_options={"xla_no_such_flag": 1})
    with pytest.raises(FailedPrecondition, match="No such compile option"):
        lowering.compile_executable(MLP, bad, batch_size=2)
    with pytest.raises(FailedPrecondition, match="No such compile option"):
        artifacts.run_portable(artifacts.load_portable(portable(FP32)), bad, *PARAMS, X8)


def test_program_that_fails_to_trace_is_a_failed_precondition():
    broken = Program(**{**MLP.__dict__, "digest": "broken", "fn": lambda w1, b1, w2, x: (x @ w2,)})
    with pytest.raises(FailedPrecondition, match="dot_general"):
        lowering.export_portable(broken, FP32, "cpu")


def test_wrong_number_of_outputs_is_reported():
    twice = Program(**{**MLP.__dict__, "digest": "twice", "fn": lambda *a: mlp(*a) * 2})
    with pytest.raises(InvalidArgument, match="returned 2 outputs but declares 1"):
        lowering.export_portable(twice, FP32, "cpu")


def uploaded(platforms: list[str]) -> Program:
    (b,) = export.symbolic_shape("b")
    avals = [jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in MLP.parameters]
    exp = export.export(jax.jit(mlp), platforms=platforms)(*avals, jax.ShapeDtypeStruct((b, 16), jnp.float32))
    return Program(**{**MLP.__dict__, "kind": "uploaded", "digest": f"up-{platforms}", "fn": None,
                      "exported": bytes(exp.serialize())})


def test_uploaded_program_is_reexported_per_platform_and_compiled_with_rule_options():
    program = uploaded(["cpu", "cuda"])
    assert artifacts.load_portable(portable(FP32, "cuda", program)).platforms == ("cuda",)
    (y,) = artifacts.run_portable(artifacts.load_portable(portable(FP32, "cpu", program)), FP32, *PARAMS, X8)
    assert rel_error(y, reference(X8)) < 1e-5
    (y,) = artifacts.load_executable(lowering.compile_executable(program, FP32, batch_size=8))(*PARAMS, X8)
    assert rel_error(y, reference(X8)) < 1e-5
    with pytest.raises(FailedPrecondition, match=r"\['cpu', 'cuda'\]"):
        lowering.export_portable(program, FP32, "tpu")
