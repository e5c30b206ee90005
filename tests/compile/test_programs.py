"""The program registry: built-in networks run and decompose into layers, the training step's
shard gradients combine into the full-batch gradient, layer tables come from abstract shapes,
signatures and parameter files are validated, and uploads are jax.export artifacts only."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from accelmesh import errors
from accelmesh.errors import InvalidArgument
from accelmesh.programs import OutputSpec, Program, TargetType, TensorSpec
from accelmesh.runtime.programs import program_from_proto, program_to_proto
from compile_svc.programs import (
    ProgramEntry, ProgramRegistry, check_signature, default_registry, describe_layers, load_params,
    program_digest, program_from_export, save_params,
)
from compile_svc.programs.builtin import builtin_entries, identity
from compile_svc.programs.mlp import mlp_classifier, mlp_train_step
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.transformer import transformer_encoder

SEED = 0
BUILTIN_NAMES = ("identity", "mlp_classifier", "mlp_train_step", "transformer_encoder")


@pytest.fixture(scope="module")
def registry() -> ProgramRegistry:
    return default_registry()


def _batch(spec: TensorSpec, batch: int, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(batch if d is None else d for d in spec.shape)
    if spec.dtype == "int32":
        high = 512 if spec.name == "tokens" else 10  # vocabulary size; number of classes
        return rng.integers(0, high, size=shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(spec.dtype)


def _inputs(program: Program, batch: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_batch(spec, batch, rng) for spec in program.inputs]


def _params(program: Program) -> list[np.ndarray]:
    return program.init_params(SEED) if program.init_params else []


# --- registry ---------------------------------------------------------------------------------------

def test_default_registry_lists_every_builtin(registry):
    assert {p.name for p in registry.list()} >= set(BUILTIN_NAMES)
    assert registry.get("mlp_classifier").ref == "mlp_classifier@1"


def test_unknown_program_is_not_found_and_lists_the_names(registry):
    with pytest.raises(errors.NotFound) as info:
        registry.get("resnet")
    assert "'resnet'" in str(info.value) and all(name in str(info.value) for name in BUILTIN_NAMES)


def test_empty_version_picks_the_highest_and_unknown_versions_are_listed():
    base = identity().program
    reg = ProgramRegistry()
    for version in ("1", "2", "1.10", "10", "1.9", "2.0rc1"):
        reg.register(dataclasses.replace(base, version=version))
    assert reg.get("identity").version == "10"
    assert reg.get("identity", "1.9").version == "1.9"
    assert [p.version for p in reg.list()] == ["1", "1.9", "1.10", "2", "2.0rc1", "10"]
    with pytest.raises(errors.NotFound, match=r"no version '3'; available versions: 1, 1\.9, 1\.10, 2, 2\.0rc1, 10"):
        reg.get("identity", "3")


def test_reregistering_is_idempotent_but_different_content_needs_a_new_version():
    base = identity().program
    reg = ProgramRegistry()
    reg.register(base)
    assert reg.register(dataclasses.replace(base)) is base
    with pytest.raises(errors.FailedPrecondition, match="new version"):
        reg.register(dataclasses.replace(base, digest="0" * 64))
    with pytest.raises(errors.FailedPrecondition, match="identity@1 is already registered"):
        reg.register(dataclasses.replace(base, outputs=(dataclasses.replace(base.outputs[0], combine="sum"),)))


def test_layer_functions_are_registered_with_layered_models(registry):
    assert [f.name for f in registry.layer_functions("mlp_classifier")] == ["dense_0", "dense_1", "head"]
    assert registry.layer_functions("identity") == ()


class FakeEntryPoint:
    """The two attributes of importlib.metadata.EntryPoint that the registry uses."""

    def __init__(self, name, target):
        self.name, self._target = name, target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_entry_points_register_plugins_and_skip_broken_ones(caplog):
    base = identity().program
    one, two, three = (dataclasses.replace(base, name=f"plugin_{i}") for i in range(3))
    plugins = [
        FakeEntryPoint("single", lambda: one),
        FakeEntryPoint("several", lambda: [two, ProgramEntry(three)]),
        FakeEntryPoint("missing_module", ModuleNotFoundError("No module named 'gone'")),
        FakeEntryPoint("raises", lambda: 1 / 0),
        FakeEntryPoint("wrong_type", lambda: ["not a program"]),
    ]
    groups = []

    def entry_points(group):
        groups.append(group)
        return plugins

    reg = ProgramRegistry()
    with caplog.at_level(logging.WARNING):
        added = reg.load_entry_points(entry_points=entry_points)
    assert groups == ["accelmesh.programs"]
    assert [p.name for p in added] == ["plugin_0", "plugin_1", "plugin_2"]
    assert {p.name for p in reg.list()} == {"plugin_0", "plugin_1", "plugin_2"}
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"'{name}'" in skipped for name in ("missing_module", "raises", "wrong_type"))


# --- built-in programs ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_runs_under_jit_with_outputs_matching_its_specs(registry, name):
    program = registry.get(name)
    params = _params(program)
    assert [(p.shape, str(p.dtype)) for p in params] == [(s.shape, s.dtype) for s in program.parameters]
    outputs = jax.jit(program.fn)(*params, *_inputs(program, batch=3))
    assert len(outputs) == len(program.outputs)
    for out, spec in zip(outputs, program.outputs):
        assert out.shape == tuple(3 if d is None else d for d in spec.shape), spec.name
        assert str(out.dtype) == spec.dtype, spec.name
        assert np.all(np.isfinite(out)), spec.name


def test_init_params_are_deterministic_and_seeded():
    program = mlp_classifier().program
    first, again, other = program.init_params(0), program.init_params(0), program.init_params(1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[-1], other[-1])  # a weight matrix, not a zero bias
    assert all(leaf.dtype == np.float32 for leaf in first)


def test_parameter_leaves_are_named_layer_slash_leaf_in_sorted_order():
    names = [p.name for p in transformer_encoder().program.parameters]
    assert names == sorted(names, key=lambda n: n.split("/"))
    assert "block_0/attn/wq" in names and "embed/tok" in names and "head/w" in names


@pytest.mark.parametrize("make", [mlp_classifier, transformer_encoder])
def test_composing_the_layer_functions_equals_the_program(make):
    entry = make()
    program = entry.program
    params = _params(program)
    by_name = dict(zip((p.name for p in program.parameters), params))
    (x,) = _inputs(program, batch=4)
    activation = x
    for layer in entry.layer_fns:
        activation = jax.jit(layer.apply)(*(by_name[n] for n in layer.param_names), activation)
    (expected,) = jax.jit(program.fn)(*params, x)
    np.testing.assert_allclose(activation, expected, rtol=1e-5, atol=1e-6)
    assert sorted(n for f in entry.layer_fns for n in f.param_names) == sorted(by_name)


def test_train_step_size_weighted_mean_of_shard_gradients_is_the_full_batch_gradient():
    program = mlp_train_step().program
    params = _params(program)
    x, y = _inputs(program, batch=8)
    step = jax.jit(program.fn)
    full = step(*params, x, y)
    shards = [step(*params, x[:3], y[:3]), step(*params, x[3:], y[3:])]
    sizes = [3, 5]
    for i, spec in enumerate(program.outputs):
        parts = [np.asarray(shard[i], dtype=np.float64) for shard in shards]
        if spec.combine == "mean":
            combined = sum(size * part for size, part in zip(sizes, parts)) / sum(sizes)
        else:
            assert spec.combine == "sum"
            combined = sum(parts)
        np.testing.assert_allclose(combined, full[i], rtol=1e-5, atol=1e-7, err_msg=spec.name)
    assert [o.name for o in program.outputs[:-2]] == [f"grad/{p.name}" for p in program.parameters]
    assert 0 <= int(full[-1]) <= 8


def test_transformer_exports_with_a_symbolic_batch_for_cpu_and_cuda():
    program = transformer_encoder().program
    (batch,) = export.symbolic_shape("b")
    args = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in program.parameters]
    args.append(jax.ShapeDtypeStruct((batch, 32), jnp.int32))
    exported = export.export(jax.jit(program.fn), platforms=("cpu", "cuda"))(*args)
    assert str(exported.out_avals[0].shape[0]) == "b"


# --- layer tables -----------------------------------------------------------------------------------

def test_transformer_layer_table_accounts_for_every_parameter():
    program = transformer_encoder().program
    assert [layer.name for layer in program.layers] == ["embed", "block_0", "block_1", "block_2", "block_3", "head"]
    assert [layer.order for layer in program.layers] == list(range(6))
    total = sum(math.prod(p.shape) for p in program.parameters)
    assert sum(layer.parameter_count for layer in program.layers) == total
    for layer in program.layers:
        assert layer.flops_per_sample > 0, layer.name
        assert layer.bytes_accessed_per_sample > 0, layer.name
        assert layer.parameter_bytes == 4 * layer.parameter_count, layer.name
    assert program.layers[1].parameter_shapes["attn/wq"] == (128, 128)
    assert program.layers[1].activation_bytes_per_sample == 32 * 128 * 4
    assert program.layers[-1].activation_bytes_per_sample == 16 * 4
    # Identical blocks cost the same, and a block costs more than the head.
    assert len({layer.flops_per_sample for layer in program.layers[1:5]}) == 1
    assert program.layers[1].flops_per_sample > program.layers[-1].flops_per_sample


def test_train_step_describes_the_model_it_trains():
    assert mlp_train_step().program.layers == mlp_classifier().program.layers
    assert [layer.parameter_count for layer in mlp_classifier().program.layers] == [64 * 128 + 128, 128 * 128 + 128,
                                                                                    128 * 10 + 10]


def test_a_multi_billion_parameter_model_is_described_without_materialising_weights():
    width = 60_000  # one 60k x 60k layer: 3.6e9 parameters, 14.4 GB of float32

    def init(key):
        return {"w": jax.random.normal(key, (width, width), jnp.float32)}

    net = Network([Layer("huge", "dense", init, lambda p, x: x @ p["w"])])
    inputs = (TensorSpec("x", "float32", (None, width)),)
    outputs = (OutputSpec("y", "float32", (None, width)),)
    program = Program("huge", "1", "model", "", net.parameters, inputs, outputs,
                      program_digest("huge", "1", "model", net.parameters, inputs, outputs))
    (layer,) = describe_layers(program, net.layer_fns())
    assert layer.parameter_count == width * width
    assert layer.parameter_bytes == 4 * width * width
    assert layer.flops_per_sample == pytest.approx(2 * width * width)


# --- signatures -------------------------------------------------------------------------------------

TOKENS = TensorSpec("tokens", "int32", (None, 32))

SIGNATURE_CASES = {
    "symbolic batch": ([TOKENS], None),
    "concrete batch": ([TensorSpec("tokens", "int32", (7, 32))], None),
    "wrong dtype": ([TensorSpec("tokens", "float32", (None, 32))],
                    "inputs[0] 'tokens': dtype float32, program expects int32"),
    "wrong name": ([TensorSpec("ids", "int32", (None, 32))], "inputs[0] 'ids': name differs"),
    "wrong rank": ([TensorSpec("tokens", "int32", (None, 32, 1))], "inputs[0] 'tokens': rank 3"),
    "wrong width": ([TensorSpec("tokens", "int32", (None, 64))],
                    "inputs[0] 'tokens': shape [None, 64], axis 1 is 64, program expects 32"),
    "zero batch": ([TensorSpec("tokens", "int32", (0, 32))], "inputs[0] 'tokens': batch dimension"),
    "too many": ([TOKENS, TOKENS], "inputs: 2 given, transformer_encoder@1 expects 1 (tokens int32[None, 32])"),
    "none": ([], "inputs: 0 given"),
}


@pytest.mark.parametrize("case", SIGNATURE_CASES)
def test_check_signature(case):
    given, message = SIGNATURE_CASES[case]
    program = transformer_encoder().program
    if message is None:
        check_signature(program, given)
    else:
        with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
            check_signature(program, given)


def test_check_signature_names_the_field_and_the_second_input():
    program = mlp_train_step().program
    bad = [TensorSpec("x", "float32", (4, 64)), TensorSpec("y", "int64", (4,))]
    with pytest.raises(errors.InvalidArgument, match=r"request\.inputs\[1\] 'y': dtype int64, program expects int32"):
        check_signature(program, bad, field="request.inputs")


# --- parameter files --------------------------------------------------------------------------------

def test_params_round_trip_through_npz_file_and_bytes(tmp_path):
    program = transformer_encoder().program
    params = _params(program)
    path = tmp_path / "params.npz"
    save_params(program, params, path)
    buffer = io.BytesIO()
    save_params(program, params, buffer)
    for source in (path, str(path), buffer.getvalue()):
        loaded = load_params(program, source)
        for a, b in zip(loaded, params):
            np.testing.assert_array_equal(a, b)


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _mlp_arrays() -> dict[str, np.ndarray]:
    program = mlp_classifier().program
    return dict(zip((p.name for p in program.parameters), _params(program)))


BAD_NPZ = {
    "missing leaf": (lambda a: {k: v for k, v in a.items() if k != "dense_1/w"}, "missing leaf 'dense_1/w'"),
    "wrong shape": (lambda a: {**a, "head/w": np.zeros((128, 11), np.float32)},
                    r"parameters\['head/w'\]: shape \[128, 11\], mlp_classifier@1 expects \[128, 10\]"),
    "wrong dtype": (lambda a: {**a, "head/b": a["head/b"].astype(np.float64)},
                    r"parameters\['head/b'\]: dtype float64"),
    "unexpected leaf": (lambda a: {**a, "extra/w": np.zeros(1, np.float32)}, "unexpected leaf 'extra/w'"),
    "object array": (lambda a: {**a, "head/b": np.array([{}], dtype=object)}, "not a readable .npz"),
}


@pytest.mark.parametrize("case", BAD_NPZ)
def test_bad_param_files_are_rejected_naming_the_leaf(case):
    mutate, message = BAD_NPZ[case]
    with pytest.raises(errors.InvalidArgument, match=message):
        load_params(mlp_classifier().program, _npz(mutate(_mlp_arrays())))


def test_not_an_npz_is_invalid():
    with pytest.raises(errors.InvalidArgument, match="not a readable .npz"):
        load_params(mlp_classifier().program, b"definitely not a zip archive")


# --- digests ----------------------------------------------------------------------------------------

def _recomputed_digest(program: Program, code) -> str:
    return program_digest(program.name, program.version, program.kind, program.parameters, program.inputs,
                          program.outputs, code)


def test_digests_are_stable_and_distinct():
    digests = [entry.program.digest for entry in builtin_entries()]
    assert len(set(digests)) == len(digests)
    program = mlp_classifier().program
    code = (program.fn,)
    assert _recomputed_digest(program, code) == _recomputed_digest(program, code)
    changed = dataclasses.replace(program, outputs=(dataclasses.replace(program.outputs[0], combine="sum"),))
    assert _recomputed_digest(changed, code) != _recomputed_digest(program, code)
    assert _recomputed_digest(program, (np.add,)) != _recomputed_digest(program, code)


def test_digests_are_the_same_in_another_process():
    script = ("from compile_svc.programs.builtin import builtin_entries\n"
              "print(' '.join(e.program.digest for e in builtin_entries()))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [entry.program.digest for entry in builtin_entries()]


# --- uploaded programs ------------------------------------------------------------------------------

def _exported_bytes(x_shape: str = "b, 4") -> bytes:
    def scale_and_sum(w, x):
        return x * jnp.sum(w), jnp.sum(x)

    w = jax.ShapeDtypeStruct((4,), jnp.float32)
    x = jax.ShapeDtypeStruct(export.symbolic_shape(x_shape), jnp.float32)
    return export.export(jax.jit(scale_and_sum), platforms=("cpu",))(w, x).serialize()


def test_uploaded_export_round_trips_and_runs_at_any_batch():
    data = _exported_bytes()
    program = program_from_export("scaler", "1", data, ["concat", "sum"], ["w", "x"], max_bytes=1 << 20)
    assert program.kind == "uploaded" and program.parameters == () and program.fn is None
    assert program.inputs == (TensorSpec("w", "float32", (4,)), TensorSpec("x", "float32", (None, 4)))
    assert program.outputs == (OutputSpec("output_0", "float32", (None, 4), "concat"),
                               OutputSpec("output_1", "float32", (), "sum"))
    assert program.exported == data
    assert program.digest == program_from_export("scaler", "2", data, ["concat", "sum"], None, 1 << 20).digest
    assert program.metadata["platforms"] == "cpu"
    w = np.arange(4, dtype=np.float32)
    for batch in (3, 5):
        x = np.ones((batch, 4), np.float32)
        scaled, total = export.deserialize(bytearray(program.exported)).call(w, x)
        np.testing.assert_allclose(scaled, x * w.sum())
        assert float(total) == 4 * batch


UPLOAD_ERRORS = {
    "not an export": (lambda: b"\x00garbage" * 10, ["concat", "sum"], None, errors.InvalidArgument,
                      "not a serialized jax.export artifact"),
    "too big": (_exported_bytes, ["concat", "sum"], None, errors.ResourceExhausted, "limit of 100 bytes"),
    "combine count": (_exported_bytes, ["concat"], None, errors.InvalidArgument, "outputs_combine: 1 rules given"),
    "bad combine": (_exported_bytes, ["concat", "max"], None, errors.InvalidArgument, "outputs_combine\\[1\\]: 'max'"),
    "concat of a scalar": (_exported_bytes, ["concat", "concat"], None, errors.InvalidArgument,
                           "outputs_combine\\[1\\]: concat needs the output batched"),
    "input name count": (_exported_bytes, ["concat", "sum"], ["x"], errors.InvalidArgument, "input_names: 1 names"),
    "symbolic inner dim": (lambda: _exported_bytes("b, n"), ["concat", "sum"], None, errors.InvalidArgument,
                           "inputs\\[1\\] 'input_1': axis 1 is symbolic \\(n\\)"),
}


@pytest.mark.parametrize("case", UPLOAD_ERRORS)
def test_bad_uploads_are_refused(case):
    make, combine, names, error, message = UPLOAD_ERRORS[case]
    max_bytes = 100 if case == "too big" else 1 << 20
    with pytest.raises(error, match=message):
        program_from_export("scaler", "1", make(), combine, names, max_bytes=max_bytes)


@pytest.mark.parametrize("target", [
    TargetType("cuda", "cpu", "a100-80gb", frozenset({"bf16", "tf32"})),
    TargetType("cpu", "cpu", "cpu", frozenset()),
    TargetType("tpu", "tpu", "tpu-v4", frozenset({"bf16"})),
])
def test_a_target_type_key_parses_back_to_the_same_target_type(target):
    assert TargetType.parse(target.key) == target


@pytest.mark.parametrize("key", ["a100-80gb", "cuda:a100[bf16", "cuda@:a100[]", ""])
def test_a_malformed_target_type_is_refused_naming_the_field(key):
    with pytest.raises(InvalidArgument, match="header.target_type .* is not of the form"):
        TargetType.parse(key, "header.target_type")


@pytest.mark.parametrize("name", ["transformer_encoder", "mlp_train_step", "identity"])
def test_a_program_survives_the_trip_through_its_proto(name):
    program = default_registry().get(name)
    back = program_from_proto(program_to_proto(program))
    fields = ("name", "version", "kind", "description", "parameters", "inputs", "outputs", "digest", "layers")
    assert [getattr(back, f) for f in fields] == [getattr(program, f) for f in fields]
