"""The program registry and the built-in networks: lookups, versions and plugins, every built-in
runs under jit and decomposes into its layers, the training step's shard gradients combine into
the full-batch gradient, and layer tables come from abstract shapes. Signatures, parameter
files, digests and uploads are in test_programs_validation.py."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _program_helpers import _inputs, _params
from jax import export

from accelmesh import errors
from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs import ProgramEntry, ProgramRegistry, default_registry, describe_layers, program_digest
from compile_svc.programs.builtin import identity
from compile_svc.programs.mlp import mlp_classifier, mlp_train_step
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.transformer import transformer_encoder

BUILTIN_NAMES = ("identity", "mlp_classifier", "mlp_train_step", "transformer_encoder")


@pytest.fixture(scope="module")
def registry() -> ProgramRegistry:
    return default_registry()


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



@pytest.mark.parametrize("flops", [None, 0.0, 2.5e6])
def test_a_layers_flops_cross_the_proto_as_they_are_unknown_stays_unknown_and_zero_stays_zero(flops):
    from accelmesh.runtime.programs import layer_from_proto, layer_to_proto
    from dispatch_svc.planner.throughput import flops_per_row

    (first, second) = mlp_classifier().program.layers[:2]
    layer = dataclasses.replace(first, flops_per_sample=flops)
    msg = layer_to_proto(layer)
    assert msg.HasField("flops_per_sample") == (flops is not None)
    assert layer_from_proto(msg) == layer
    program = dataclasses.replace(mlp_classifier().program, layers=(layer, second))
    # a row cannot be timed by FLOPs when any layer's are unknown: the catalog rate is not guessed
    assert flops_per_row(program) == (None if flops is None else flops + second.flops_per_sample)
