"""What the program registry validates and records: input signatures, parameter files, digests
that are stable across processes, uploads that must be jax.export artifacts, target type keys,
and a program's trip through its proto. The registry and the built-in networks are in
test_programs.py."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _program_helpers import _params
from jax import export

from accelmesh import errors
from accelmesh.errors import InvalidArgument
from accelmesh.programs import OutputSpec, Program, TargetType, TensorSpec
from accelmesh.runtime.programs import program_from_proto, program_to_proto
from compile_svc.programs import (
    check_signature,
    default_registry,
    load_params,
    program_digest,
    program_from_export,
    save_params,
)
from compile_svc.programs.builtin import builtin_entries
from compile_svc.programs.mlp import mlp_classifier, mlp_train_step
from compile_svc.programs.transformer import transformer_encoder

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
