"""Pipeline stages as programs of their own: consecutive layers of a layered model (requirements B7).

A stage takes the parameter leaves its layers read, then one activation; it returns one
activation, or the model's outputs when it ends at the last layer. Its backward pass (for
pipeline training) takes the same leaves, the activation that entered it and the cotangent of
what it returned, recomputes its forward, and returns the gradient of every leaf (summed over
the rows) and the cotangent of its input (none for the first stage, whose input is the
model's: token ids have no gradient). Activation shapes come from
jax.eval_shape on abstract values with a symbolic batch, so no weight is ever allocated and a
stage of a multi-billion-parameter model is derived on a laptop. A stage is then lowered,
compiled and cached exactly like a whole program.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import export

from accelmesh.artifacts import xla_failures
from accelmesh.errors import FailedPrecondition, InvalidArgument
from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs.layers import LayerFn

ACTIVATION = "activation"  # name of a stage's input (unless it is the model's) and output (unless it ends the model)
COTANGENT = "cotangent"  # a backward stage's second input: d(loss)/d(the stage's output)
GRADIENT_PREFIX = "grad/"  # a backward stage's outputs: grad/<leaf>, then the input's cotangent
T = TypeVar("T")


@dataclass(frozen=True)
class LayerRange:
    """Consecutive layers by position in the forward pass: first .. first + count - 1."""

    first: int
    count: int
    backward: bool = False  # the stage's backward pass rather than its forward

    @property
    def last(self) -> int:
        return self.first + self.count - 1


def stage_name(program: Program, layers: LayerRange) -> str:
    return f"{program.name}:{layers.first}-{layers.last}" + (":backward" if layers.backward else "")


def check_range(program: Program, layer_count: int, layers: LayerRange) -> None:
    """Raise InvalidArgument naming the field of `layers` that does not fit the model."""
    if layer_count == 0:
        raise InvalidArgument(f"layers: {program.ref} is not a layered model (it registers no layer functions), "
                              "so it has no stages; leave layers unset to compile it whole")
    if not 0 <= layers.first < layer_count:
        raise InvalidArgument(f"layers.first is {layers.first}; {program.ref} has {layer_count} layers, "
                              f"so layers.first must be within 0..{layer_count - 1}")
    if not 1 <= layers.count <= layer_count - layers.first:
        raise InvalidArgument(f"layers.count is {layers.count}; from layers.first={layers.first} it must be within "
                              f"1..{layer_count - layers.first} ({program.ref} has {layer_count} layers)")


def stage_digest(program_digest: str, layers: LayerRange) -> str:
    """Keeps each stage's artifacts apart in the cache; this module's source enters it because
    how a stage is cut is part of what its artifact computes."""
    doc = {"program": program_digest, "first": layers.first, "count": layers.count, "backward": layers.backward}
    h = hashlib.sha256(json.dumps(doc, sort_keys=True).encode())
    h.update(_code_digest())
    return h.hexdigest()


def _code_digest() -> bytes:
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).digest()


def activations(program: Program, layer_fns: Sequence[LayerFn]) -> tuple[Any, ...]:
    """Abstract values at every layer boundary: [0] enters the first layer, [i] leaves layer i-1.

    The batch is one symbolic dimension, as in the portable artifact, so a layer that moved or
    reshaped it shows up here rather than as a stage that only works at one batch size.
    """
    specs = {spec.name: spec for spec in program.parameters}
    (batch,) = export.symbolic_shape("b")
    first = program.inputs[0]
    x = jax.ShapeDtypeStruct(tuple(batch if d is None else d for d in first.shape), jnp.dtype(first.dtype))
    out = [x]
    for layer in layer_fns:
        missing = [n for n in layer.param_names if n not in specs]
        if missing:
            raise FailedPrecondition(f"layer {layer.name!r} of {program.ref} reads unknown parameters {missing}; "
                                     "its param_names must be leaf names of Program.parameters")
        leaves = [jax.ShapeDtypeStruct(specs[n].shape, jnp.dtype(specs[n].dtype)) for n in layer.param_names]
        with xla_failures(f"tracing layer {layer.name!r} of {program.ref}"):
            x = jax.eval_shape(layer.apply, *leaves, x)
        out.append(x)
    return tuple(out)


def _activation_spec(program: Program, after: str, value: Any) -> TensorSpec:
    shape = getattr(value, "shape", None)
    batched = shape is not None and len(shape) > 0 and export.is_symbolic_dim(shape[0])
    if not batched or any(export.is_symbolic_dim(d) for d in shape[1:]):
        raise FailedPrecondition(f"the activation after layer {after!r} of {program.ref} is {value}; a stage boundary "
                                 "needs one array batched on axis 0 only, so cut the model elsewhere")
    return TensorSpec(ACTIVATION, str(value.dtype), (None, *(int(d) for d in shape[1:])))


def derive_stage(program: Program, layer_fns: Sequence[LayerFn], layers: LayerRange,
                 boundaries: Sequence[Any]) -> Program:
    """The stage as a Program: fn(*stage leaves, x) -> (y,), calling convention as any program's."""
    check_range(program, len(layer_fns), layers)
    chosen = tuple(layer_fns[layers.first : layers.last + 1])
    specs = {spec.name: spec for spec in program.parameters}
    # First use order without duplicates: a tied weight is one argument, whichever layer owns it.
    names = tuple(dict.fromkeys(n for layer in chosen for n in layer.param_names))
    if layers.first == 0:
        inputs = (program.inputs[0],)
    else:
        inputs = (_activation_spec(program, layer_fns[layers.first - 1].name, boundaries[layers.first]),)
    output = _activation_spec(program, chosen[-1].name, boundaries[layers.last + 1])
    if layers.last == len(layer_fns) - 1:
        if [(o.dtype, o.shape) for o in program.outputs] != [(output.dtype, output.shape)]:
            raise FailedPrecondition(f"the layer functions of {program.ref} end in {output.dtype}{list(output.shape)}, "
                                     f"not its outputs {[(o.name, o.dtype, o.shape) for o in program.outputs]}; "
                                     "fix the model's registration")
        outputs = program.outputs
    else:
        outputs = (OutputSpec(output.name, output.dtype, output.shape, "concat"),)
    parameters = tuple(specs[n] for n in names)
    fn = _compose(chosen, names)
    described = f"layers {layers.first}-{layers.last} ({', '.join(layer.name for layer in chosen)}) of {program.ref}"
    if layers.backward:
        if len(outputs) != 1:
            raise FailedPrecondition(f"{program.ref} returns {len(outputs)} outputs; a trained pipeline's last stage "
                                     "must return one (its loss is taken on it)")
        with_input = jnp.issubdtype(jnp.dtype(inputs[0].dtype), jnp.floating)
        described = f"backward pass of {described}"
        fn = _backward(fn, with_input)
        cotangent = TensorSpec(COTANGENT, outputs[0].dtype, outputs[0].shape)
        inputs = (inputs[0], cotangent)
        outputs = tuple(OutputSpec(f"{GRADIENT_PREFIX}{p.name}", p.dtype, p.shape, "sum") for p in parameters)
        if with_input:
            outputs += (OutputSpec(COTANGENT, inputs[0].dtype, inputs[0].shape, "concat"),)
    return Program(
        name=stage_name(program, layers),
        version=program.version,
        kind=program.kind,
        description=described,
        parameters=parameters,
        inputs=inputs,
        outputs=outputs,
        digest=stage_digest(program.digest, layers),
        fn=fn,
        layers=tuple(info for info in program.layers if layers.first <= info.order <= layers.last),
    )


def _backward(forward: Callable[..., tuple], with_input: bool) -> Callable[..., tuple]:
    """fn(*leaves, x, dy) -> (*d leaves, [dx]): the forward recomputed under jax.vjp (no
    activation is kept between the passes), its cotangents pulled back."""

    def fn(*args: Any) -> tuple:
        *leaves, x, dy = args
        if with_input:
            _, pull = jax.vjp(lambda ls, xs: forward(*ls, xs)[0], tuple(leaves), x)
            d_leaves, dx = pull(dy)
            return (*d_leaves, dx)
        _, pull = jax.vjp(lambda ls: forward(*ls, x)[0], tuple(leaves))
        (d_leaves,) = pull(dy)
        return tuple(d_leaves)

    return fn


def _compose(chosen: Sequence[LayerFn], names: Sequence[str]) -> Callable[..., tuple]:
    index = {n: i for i, n in enumerate(names)}
    picks = [tuple(index[n] for n in layer.param_names) for layer in chosen]

    def fn(*args: Any) -> tuple:
        *leaves, x = args
        for layer, pick in zip(chosen, picks):
            x = layer.apply(*(leaves[i] for i in pick), x)
        return (x,)

    return fn


class StageCatalog:
    """Stages derived once per (program, range) and shared by every caller.

    Thread-safe and single-flight: deriving traces the model's layers, and concurrent Compile
    calls for one pipeline ask for the same stages. Failures are not kept, so a call after a
    fixed registration derives again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._derived: dict[Hashable, Future[Any]] = {}

    def stage(self, program: Program, layer_fns: Sequence[LayerFn], layers: LayerRange) -> Program:
        check_range(program, len(layer_fns), layers)
        model = (program.ref, program.digest)
        boundaries = self._once((*model, "activations"), lambda: activations(program, layer_fns))
        return self._once((*model, layers), lambda: derive_stage(program, layer_fns, layers, boundaries))

    def _once(self, key: Hashable, make: Callable[[], T]) -> T:
        with self._lock:
            pending = self._derived.get(key)
            owner = pending is None
            if owner:
                pending = self._derived[key] = Future()
        if owner:
            try:
                pending.set_result(make())
            except BaseException as exc:  # noqa: BLE001 - every caller waiting on this key gets it
                pending.set_exception(exc)
                with self._lock:
                    del self._derived[key]
        return pending.result()
