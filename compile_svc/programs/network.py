"""A model as an ordered list of layers, so one definition yields the whole-model function,
the per-layer stage functions (pipeline placement, MISSION B3/B7) and the parameter specs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from accelmesh.programs import TensorSpec
from compile_svc.programs.layers import LayerFn
from compile_svc.programs.pytrees import SEPARATOR, flatten_params, unflatten_params


@dataclass(frozen=True)
class Layer:
    """One top-level entry of the params tree and the code that uses it."""

    name: str
    kind: str  # LayerInfo.kind: "dense", "embedding", "transformer_block", ...
    init: Callable[[jax.Array], dict[str, Any]]  # PRNG key -> this layer's params (nested dict)
    apply: Callable[[dict[str, Any], jax.Array], jax.Array]  # (this layer's params, x) -> x


class Network:
    """Layers applied in list order; parameters flattened in sorted-key order (see pytrees)."""

    def __init__(self, layers: Sequence[Layer]):
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique: {names}")
        self.layers = tuple(layers)
        # eval_shape traces init without allocating, so specs of a huge model cost nothing.
        self.leaf_names, abstract = flatten_params(jax.eval_shape(self._init_tree, 0))
        self.parameters = tuple(TensorSpec(n, str(a.dtype), tuple(a.shape)) for n, a in zip(self.leaf_names, abstract))
        self._init_jit = jax.jit(self._init_tree)

    def _init_tree(self, seed: jax.Array | int) -> dict[str, Any]:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.layers))
        return {layer.name: layer.init(key) for layer, key in zip(self.layers, keys)}

    def init_params(self, seed: int) -> list[np.ndarray]:
        """Deterministic float32 leaves in `parameters` order."""
        _, leaves = flatten_params(self._init_jit(seed))
        return [np.asarray(leaf) for leaf in leaves]

    def apply(self, leaves: Sequence[Any], x: jax.Array) -> jax.Array:
        tree = unflatten_params(self.leaf_names, leaves)
        for layer in self.layers:
            x = layer.apply(tree[layer.name], x)
        return x

    def layer_fns(self) -> tuple[LayerFn, ...]:
        return tuple(self._layer_fn(layer) for layer in self.layers)

    def _layer_fn(self, layer: Layer) -> LayerFn:
        prefix = layer.name + SEPARATOR
        full_names = tuple(n for n in self.leaf_names if n.startswith(prefix))
        local_names = [n[len(prefix):] for n in full_names]

        def apply(*args: Any) -> jax.Array:
            *leaves, x = args
            return layer.apply(unflatten_params(local_names, leaves), x)

        apply.__name__ = f"{layer.name}_apply"
        return LayerFn(name=layer.name, kind=layer.kind, param_names=full_names, apply=apply)
