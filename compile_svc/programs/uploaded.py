"""Programs uploaded by clients as serialized jax.export artifacts.

Only jax.export's flatbuffer format is accepted, never pickle: an upload is untrusted data.
An uploaded program takes everything, weights included, as inputs, so parameters is empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
from jax import export

from accelmesh.errors import InvalidArgument, ResourceExhausted, quoted
from accelmesh.programs import COMBINE_RULES, DTYPES, OutputSpec, Program, TensorSpec

# Inputs, and outputs, an upload may have: each is listed in every ListPrograms answer and
# checked on every job, and a function taking more is better uploaded with its arrays stacked.
MAX_UPLOAD_TENSORS = 1024


def program_from_export(name: str, version: str, data: bytes, outputs_combine: Sequence[str],
                        input_names: Sequence[str] | None, max_bytes: int) -> Program:
    if not name or not version:
        raise InvalidArgument("name and version: both are required for an uploaded program")
    if len(data) > max_bytes:
        raise ResourceExhausted(f"exported: the artifact is {len(data)} bytes, over the upload limit of "
                                f"{max_bytes} bytes; export a smaller function or pass weights as inputs, or "
                                "raise ACCELMESH_MAX_UPLOAD_BYTES")
    try:
        exp = export.deserialize(bytearray(data))
        in_avals, out_avals = tuple(exp.in_avals), tuple(exp.out_avals)
    except Exception as exc:  # the deserializer raises whatever its parser trips on
        raise InvalidArgument(f"exported: not a serialized jax.export artifact: {type(exc).__name__}: {exc}") from exc

    for what, avals in (("inputs", in_avals), ("outputs", out_avals)):
        if len(avals) > MAX_UPLOAD_TENSORS:
            raise InvalidArgument(f"exported: the function has {len(avals)} {what}, over the {MAX_UPLOAD_TENSORS} "
                                  "an upload may have; stack arrays of one shape into one")
    flat_args = jax.tree_util.tree_structure((tuple(range(len(in_avals))), {}))
    if exp.in_tree != flat_args:
        raise InvalidArgument(f"exported: the function must take only positional arrays, got argument "
                              f"structure {exp.in_tree}; wrap it so it takes flat arrays")
    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(in_avals))]
    if len(names) != len(in_avals):
        raise InvalidArgument(f"input_names: {len(names)} names given, the artifact takes {len(in_avals)} inputs")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"input_names: names must be unique, got {quoted(names)}")
    if len(outputs_combine) != len(out_avals):
        raise InvalidArgument(f"outputs_combine: {len(outputs_combine)} rules given, the artifact returns "
                              f"{len(out_avals)} outputs")

    batch_symbols: set[str] = set()
    inputs = []
    for i, (input_name, aval) in enumerate(zip(names, in_avals)):
        where = f"inputs[{i}] {quoted(input_name)}"
        inputs.append(TensorSpec(input_name, _dtype(aval, where), _shape(aval, where, batch_symbols, None)))
    if len(batch_symbols) > 1:
        raise InvalidArgument(f"exported: inputs use several batch dimensions {sorted(batch_symbols)}; "
                              "all batched inputs must share one symbolic batch dimension")
    outputs = []
    for i, (combine, aval) in enumerate(zip(outputs_combine, out_avals)):
        where = f"outputs[{i}]"
        if combine not in COMBINE_RULES:
            raise InvalidArgument(f"outputs_combine[{i}]: {combine!r} is not one of {', '.join(COMBINE_RULES)}")
        shape = _shape(aval, where, set(), batch_symbols)
        if combine == "concat" and not (shape and shape[0] is None):
            raise InvalidArgument(f"outputs_combine[{i}]: concat needs the output batched on axis 0, "
                                  f"but its shape is {list(shape)}; use sum or mean")
        outputs.append(OutputSpec(f"output_{i}", _dtype(aval, where), shape, combine))

    return Program(
        name=name, version=version, kind="uploaded",
        description=f"uploaded jax.export of {exp.fun_name}",
        parameters=(), inputs=tuple(inputs), outputs=tuple(outputs),
        digest=hashlib.sha256(data).hexdigest(),
        exported=bytes(data),
        metadata={"platforms": ",".join(exp.platforms), "fun_name": str(exp.fun_name),
                  "out_tree": str(exp.out_tree)},
    )


def _dtype(aval: Any, where: str) -> str:
    dtype = str(aval.dtype)
    if dtype not in DTYPES:
        raise InvalidArgument(f"{where}: dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return dtype


def _shape(aval: Any, where: str, batch_symbols: set[str], allowed: set[str] | None) -> tuple[int | None, ...]:
    """Symbolic axis 0 becomes the batch dim (None); any other symbolic dim is rejected, because
    dispatch can only vary the batch. For outputs, `allowed` holds the inputs' batch symbol."""
    shape: list[int | None] = []
    for axis, dim in enumerate(aval.shape):
        if not export.is_symbolic_dim(dim):
            shape.append(int(dim))
            continue
        symbol = str(dim)
        if axis != 0:
            raise InvalidArgument(f"{where}: axis {axis} is symbolic ({symbol}); only axis 0 (the batch) "
                                  "may be symbolic, export the other dims with fixed sizes")
        if allowed is not None and symbol not in allowed:
            inputs_batch = ", ".join(sorted(allowed)) or "none"
            raise InvalidArgument(f"{where}: batch dim {symbol!r} is not the inputs' batch dim ({inputs_batch}); "
                                  "outputs may only be batched like the inputs")
        batch_symbols.add(symbol)
        shape.append(None)
    return tuple(shape)
