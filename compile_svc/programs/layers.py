"""The layer table of a model (MISSION B3), measured on abstract shapes only.

Parameter figures come from TensorSpecs and compute figures from XLA's cost analysis of each
layer's function lowered on jax.ShapeDtypeStructs, so no weight is ever allocated and a
multi-billion-parameter model can be described on a laptop.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
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
    """

    name: str
    kind: str
    param_names: tuple[str, ...]
    apply: Callable[..., Any]


@dataclass(frozen=True)
class ProgramEntry:
    """What the registry stores: a Program and, for layered models, its pipeline stages."""

    program: Program
    layer_fns: tuple[LayerFn, ...] = ()


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
    infos = []
    for order, layer in enumerate(layer_fns):
        missing = [n for n in layer.param_names if n not in specs]
        if missing:
            raise ValueError(f"layer {layer.name!r} of {program.ref} names unknown parameters {missing}")
        params = [specs[n] for n in layer.param_names]
        abstract = [jax.ShapeDtypeStruct(p.shape, np.dtype(p.dtype)) for p in params]
        lowered = jax.jit(layer.apply).lower(*abstract, x)
        cost = _cost(lowered.cost_analysis())
        out = jax.eval_shape(layer.apply, *abstract, x)
        prefix = layer.name + "/"
        infos.append(LayerInfo(
            name=layer.name,
            kind=layer.kind,
            order=order,
            parameter_shapes={p.name.removeprefix(prefix): tuple(int(d) for d in p.shape) for p in params},
            parameter_count=sum(math.prod(p.shape) for p in params),
            parameter_bytes=sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params),
            flops_per_sample=cost.get("flops", 0.0) / PROFILE_BATCH,
            bytes_accessed_per_sample=cost.get("bytes accessed", 0.0) / PROFILE_BATCH,
            activation_bytes_per_sample=math.prod(out.shape) * out.dtype.itemsize // PROFILE_BATCH,
        ))
        x = out
    result = tuple(infos)
    with _cache_lock:
        _cache[key] = result
    return result


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
