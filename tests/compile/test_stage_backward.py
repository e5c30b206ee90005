"""A stage's backward pass (pipeline training): chained from the last stage to the first, the
stages' gradients are the whole model's, computed by JAX in one piece."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile_svc.programs import default_registry
from compile_svc.programs.stages import COTANGENT, GRADIENT_PREFIX, LayerRange, StageCatalog


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


@pytest.mark.parametrize("model, cuts", [("transformer_encoder", [(0, 2), (2, 3), (5, 1)]),
                                         ("mlp_classifier", [(0, 1), (1, 2)])])
def test_stage_backwards_chained_give_the_whole_models_gradient(model, cuts):
    registry = default_registry()
    program = registry.get(model)
    layer_fns = registry.layer_functions(model)
    catalog = StageCatalog()
    params = program.init_params(0)
    by_name = dict(zip((p.name for p in program.parameters), params))
    spec = program.inputs[0]
    rng = np.random.default_rng(0)
    if np.issubdtype(np.dtype(spec.dtype), np.integer):
        x = rng.integers(0, 64, size=(6, *spec.shape[1:]), dtype=spec.dtype)
    else:
        x = rng.normal(size=(6, *spec.shape[1:])).astype(spec.dtype)
    classes = program.outputs[0].shape[-1]
    labels = rng.integers(0, classes, size=6)

    # forward, stage by stage, keeping each stage's input
    stages = [catalog.stage(program, layer_fns, LayerRange(first, count)) for first, count in cuts]
    backs = [catalog.stage(program, layer_fns, LayerRange(first, count, backward=True)) for first, count in cuts]
    inputs, h = [], x
    for stage in stages:
        inputs.append(h)
        (h,) = stage.fn(*(by_name[p.name] for p in stage.parameters), h)
    loss, dy = jax.value_and_grad(cross_entropy)(h, labels)

    grads: dict[str, np.ndarray] = {}
    for back, x_in in zip(reversed(backs), reversed(inputs)):
        assert [i.name for i in back.inputs][1:] == [COTANGENT]
        outs = back.fn(*(by_name[p.name] for p in back.parameters), x_in, dy)
        names = [o.name for o in back.outputs]
        assert all(o.combine == "sum" for o in back.outputs if o.name.startswith(GRADIENT_PREFIX))
        for name, value in zip(names, outs):
            if name.startswith(GRADIENT_PREFIX):
                leaf = name.removeprefix(GRADIENT_PREFIX)
                grads[leaf] = grads.get(leaf, 0) + np.asarray(value)
        dy = outs[-1] if names[-1] == COTANGENT else None
    assert dy is None or names[-1] == COTANGENT  # the first stage of a token model returns no input cotangent

    def whole(leaves):
        return cross_entropy(program.fn(*leaves, x)[0], labels)

    expected = jax.grad(whole)(list(params))
    assert set(grads) == {p.name for p in program.parameters}
    for spec_, want in zip(program.parameters, expected):
        np.testing.assert_allclose(grads[spec_.name], np.asarray(want), rtol=2e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(whole(list(params))), rel=1e-6)


def test_a_backward_stage_is_its_own_program_and_cache_entry():
    registry = default_registry()
    program = registry.get("transformer_encoder")
    layer_fns = registry.layer_functions("transformer_encoder")
    catalog = StageCatalog()
    forward = catalog.stage(program, layer_fns, LayerRange(2, 2))
    backward = catalog.stage(program, layer_fns, LayerRange(2, 2, backward=True))
    assert backward.name == forward.name + ":backward" and backward.digest != forward.digest
    assert [i.name for i in backward.inputs] == ["activation", COTANGENT]
    assert [o.name for o in backward.outputs] == [
        *(f"{GRADIENT_PREFIX}{p.name}" for p in forward.parameters), COTANGENT]
