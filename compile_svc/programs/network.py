"""A model as an ordered list of layers, so one definition yields the whole-model function,
the per-layer stage functions (pipeline placement, requirements B3/B7) and the parameter specs.

Tied weights: a layer may also read parameters owned by an earlier layer (a language-model
head reusing the token embedding). They stay one leaf of the owner; the reader names them with
`shared_from` and its apply gets them as a second params tree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from accelmesh.programs import TensorSpec
from compile_svc.programs.layers import LayerFn
from compile_svc.programs.pytrees import SEPARATOR, flatten_params, unflatten_params


@dataclass(frozen=True)
class Layer:
    """One top-level entry of the params tree and the code that uses it.

    apply is `(own params, x) -> x`, or with shared_from set `(own params, shared, x) -> x`
    where shared is the owner's params tree cut down to the leaves shared_from names.
    shared_from is a path into an earlier layer's params: its name ('embed': every leaf of it)
    or a subtree or leaf of it ('embed/wte').
    """

    name: str
    kind: str  # LayerInfo.kind: "dense", "embedding", "transformer_block", ...
    init: Callable[[jax.Array], dict[str, Any]]  # PRNG key -> this layer's params (nested dict)
    apply: Callable[..., jax.Array]
    shared_from: str = ""

    @property
    def owner(self) -> str:
        """The layer owning the shared leaves; empty when none are shared."""
        return self.shared_from.split(SEPARATOR, 1)[0]


@dataclass(frozen=True)
class _Binding:
    """Which flat leaves a layer reads, under which names its apply sees them."""

    own: tuple[str, ...]  # full leaf names
    own_local: tuple[str, ...]  # the same without the 'layer/' prefix
    shared: tuple[str, ...]
    shared_local: tuple[str, ...]  # without the owner's prefix


class Network:
    """Layers applied in list order; parameters flattened in sorted-key order (see pytrees)."""

    def __init__(self, layers: Sequence[Layer]):
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique: {names}")
        self.layers = tuple(layers)
        self.leaf_names, abstract = flatten_params(self._abstract_tree())
        self.parameters = tuple(TensorSpec(n, str(a.dtype), tuple(a.shape)) for n, a in zip(self.leaf_names, abstract))
        self._bindings = {layer.name: self._bind(layer, names[:i]) for i, layer in enumerate(self.layers)}
        self._init_jit = jax.jit(self._init_tree)

    def _init_tree(self, seed: jax.Array | int) -> dict[str, Any]:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.layers))
        return {layer.name: layer.init(key) for layer, key in zip(self.layers, keys)}

    def _abstract_tree(self) -> dict[str, Any]:
        """Shapes of _init_tree's result. eval_shape traces init without allocating, so specs of
        a huge model cost nothing; layers sharing an init function (identical blocks) trace once."""
        key = jax.random.PRNGKey(0)
        by_init: dict[Callable[[jax.Array], dict[str, Any]], dict[str, Any]] = {}
        for layer in self.layers:
            if layer.init not in by_init:
                by_init[layer.init] = jax.eval_shape(layer.init, key)
        return {layer.name: by_init[layer.init] for layer in self.layers}

    def _bind(self, layer: Layer, earlier: Sequence[str]) -> _Binding:
        own = tuple(n for n in self.leaf_names if n.startswith(layer.name + SEPARATOR))
        shared: tuple[str, ...] = ()
        if layer.shared_from:
            if layer.owner not in earlier:
                raise ValueError(f"layer {layer.name!r}: shared_from {layer.shared_from!r} must name an earlier "
                                 f"layer's parameters; earlier layers: {list(earlier)}")
            shared = tuple(n for n in self.leaf_names
                           if n == layer.shared_from or n.startswith(layer.shared_from + SEPARATOR))
            if not shared:
                raise ValueError(f"layer {layer.name!r}: shared_from {layer.shared_from!r} names no parameter of "
                                 f"layer {layer.owner!r}")
        return _Binding(own, _strip(own, layer.name), shared, _strip(shared, layer.owner))

    def init_params(self, seed: int) -> list[np.ndarray]:
        """Deterministic float32 leaves in `parameters` order."""
        _, leaves = flatten_params(self._init_jit(seed))
        return [np.asarray(leaf) for leaf in leaves]

    def apply(self, leaves: Sequence[Any], x: jax.Array) -> jax.Array:
        by_name = dict(zip(self.leaf_names, leaves, strict=True))
        for layer in self.layers:
            x = self._apply_layer(layer, by_name, x)
        return x

    def _apply_layer(self, layer: Layer, by_name: Mapping[str, Any], x: jax.Array) -> jax.Array:
        b = self._bindings[layer.name]
        own = unflatten_params(b.own_local, [by_name[n] for n in b.own])
        if not layer.shared_from:
            return layer.apply(own, x)
        return layer.apply(own, unflatten_params(b.shared_local, [by_name[n] for n in b.shared]), x)

    def layer_fns(self) -> tuple[LayerFn, ...]:
        return tuple(self._layer_fn(layer) for layer in self.layers)

    def _layer_fn(self, layer: Layer) -> LayerFn:
        b = self._bindings[layer.name]
        wanted = set(b.own + b.shared)
        full_names = tuple(n for n in self.leaf_names if n in wanted)  # Program.parameters order

        def apply(*args: Any) -> jax.Array:
            *leaves, x = args
            return self._apply_layer(layer, dict(zip(full_names, leaves, strict=True)), x)

        apply.__name__ = f"{layer.name}_apply"
        # Layers running the same code on the same leaf names compute the same thing; with equal
        # shapes they lower identically, so describe_layers lowers one of them.
        template = (layer.apply, b.own_local, b.shared_local)
        return LayerFn(name=layer.name, kind=layer.kind, param_names=full_names, apply=apply,
                       shared_from=layer.owner, template=template)


def _strip(names: Sequence[str], layer: str) -> tuple[str, ...]:
    return tuple(n[len(layer) + len(SEPARATOR):] for n in names)
