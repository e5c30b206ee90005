"""The layer table of a model (requirements B3), measured on abstract shapes only.

Parameter figures come from TensorSpecs and compute figures from XLA's cost analysis of each
layer's function lowered on jax.ShapeDtypeStructs, so no weight is ever allocated and a
multi-billion-parameter model can be described on a laptop. Layers sharing a template (the 48
identical blocks of GPT-2 XL) are lowered once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from accelmesh.programs import LayerInfo, Program, TensorSpec

PROFILE_BATCH = 1  # per-sample figures: layers are lowered at batch 1


@dataclass(frozen=True)
class LayerFn:
    """A pipeline stage: `apply(*leaves named by param_names, x) -> x`.

    param_names are full leaf names ('block_0/attn/wq') in Program.parameters order, so a stage
    picks its leaves out of the model's flat list by name. Composing a model's LayerFns in
    order equals the model's fn: the first takes the program input, the last gives the output.

    shared_from names the earlier layer owning the param_names under its prefix (tied weights):
    the stage reads them, the owner's row counts them. template, when given, is hashable and
    equal for stages that compute the same function of equally named leaves, so stages equal in
    template and shapes share one lowering.
    """

    name: str
    kind: str
    param_names: tuple[str, ...]
    apply: Callable[..., Any]
    shared_from: str = ""
    template: Hashable | None = None


@dataclass(frozen=True)
class ProgramEntry:
    """What the registry stores: a Program and, for layered models, its pipeline stages."""

    program: Program
    layer_fns: tuple[LayerFn, ...] = ()


class DeferredEntry:
    """A program known by name and version up front and built on first use.

    For models whose table costs more than start-up can spend: the registry lists the program
    from `summary()` (signature, parameters, digest; no layer table) and serves get/describe
    from `entry()`. Each is built once, under this entry's lock, so concurrent first requests
    wait for one build instead of starting several, and requests for other programs never wait.
    """

    def __init__(self, name: str, version: str, summary: Callable[[], Program], entry: Callable[[], ProgramEntry]):
        self.name, self.version = name, version
        self._build_summary, self._build_entry = summary, entry
        self._summary: Program | None = None
        self._entry: ProgramEntry | None = None
        self._lock = threading.Lock()

    def summary(self) -> Program:
        """The program without its layer table (with it, once entry() has run)."""
        with self._lock:
            if self._entry is not None:
                return self._entry.program
            if self._summary is None:
                self._summary = self._checked(self._build_summary())
            return self._summary

    def entry(self) -> ProgramEntry:
        with self._lock:
            if self._entry is None:
                entry = self._build_entry()
                self._checked(entry.program)
                self._entry = entry
            return self._entry

    def _checked(self, program: Program) -> Program:
        if (program.name, program.version) != (self.name, self.version):
            raise ValueError(f"deferred program {self.name}@{self.version} built {program.ref}")
        return program


_cache: dict[tuple[str, str, str], tuple[LayerInfo, ...]] = {}
_cache_lock = threading.Lock()


def describe_layers(program: Program, layer_fns: Sequence[LayerFn], model_input: TensorSpec | None = None
                    ) -> tuple[LayerInfo, ...]:
    """One LayerInfo per stage, in execution order; cached per (program ref, digest).

    model_input is what the first stage consumes (default: the program's first input; a
    training step's model input is `x`, not the labels).
    """
    first = model_input or program.inputs[0]
    key = (program.ref, program.digest, first.name)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    specs = {spec.name: spec for spec in program.parameters}
    x = jax.ShapeDtypeStruct(tuple(PROFILE_BATCH if d is None else d for d in first.shape), np.dtype(first.dtype))
    lowered_by_template: dict[Hashable, tuple[dict[str, float], jax.ShapeDtypeStruct]] = {}
    infos = []
    for order, layer in enumerate(layer_fns):
        missing = [n for n in layer.param_names if n not in specs]
        if missing:
            raise ValueError(f"layer {layer.name!r} of {program.ref} names unknown parameters {missing}")
        params = [specs[n] for n in layer.param_names]
        abstract = [jax.ShapeDtypeStruct(p.shape, np.dtype(p.dtype)) for p in params]
        template = (layer.template if layer.template is not None else layer.apply,
                    tuple((a.shape, str(a.dtype)) for a in abstract), x.shape, str(x.dtype))
        if template not in lowered_by_template:
            lowered = jax.jit(layer.apply).lower(*abstract, x)
            lowered_by_template[template] = (_cost(lowered.cost_analysis()),
                                             _single_output(lowered.out_info, layer.name))
        cost, out = lowered_by_template[template]
        shared_prefix = layer.shared_from + "/" if layer.shared_from else None
        shared = [p for p in params if shared_prefix and p.name.startswith(shared_prefix)]
        own = [p for p in params if not (shared_prefix and p.name.startswith(shared_prefix))]
        prefix = layer.name + "/"
        infos.append(LayerInfo(
            name=layer.name,
            kind=layer.kind,
            order=order,
            parameter_shapes={p.name.removeprefix(prefix): tuple(int(d) for d in p.shape) for p in own},
            parameter_count=sum(math.prod(p.shape) for p in own),
            parameter_bytes=_bytes(own),
            flops_per_sample=cost["flops"] / PROFILE_BATCH if "flops" in cost else None,  # absent: unknown
            bytes_accessed_per_sample=cost.get("bytes accessed", 0.0) / PROFILE_BATCH,
            activation_bytes_per_sample=math.prod(out.shape) * np.dtype(out.dtype).itemsize // PROFILE_BATCH,
            shared_from=layer.shared_from if shared else "",
            shared_parameter_bytes=_bytes(shared),
        ))
        x = out
    result = tuple(infos)
    with _cache_lock:
        _cache[key] = result
    return result


def _bytes(specs: Sequence[TensorSpec]) -> int:
    return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in specs)


def _single_output(out_info: Any, layer: str) -> jax.ShapeDtypeStruct:
    leaves = jax.tree_util.tree_leaves(out_info)
    if len(leaves) != 1:
        raise ValueError(f"layer {layer!r} must return one array (the next layer's input), got {len(leaves)}")
    return jax.ShapeDtypeStruct(leaves[0].shape, leaves[0].dtype)


def _cost(analysis: Any) -> dict[str, float]:
    """jax 0.10 returns a dict; older releases returned a list with one dict per computation."""
    if analysis is None:
        return {}
    if isinstance(analysis, (list, tuple)):
        merged: dict[str, float] = {}
        for part in analysis:
            for name, value in (part or {}).items():
                merged[name] = merged.get(name, 0.0) + float(value)
        return merged
    return {name: float(value) for name, value in analysis.items()}
