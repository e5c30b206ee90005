"""Checks a client's intended input signature against a program's, and digests programs."""

from __future__ import annotations

import hashlib
import inspect
import json
import types
from collections.abc import Iterable, Sequence

from accelmesh.errors import InvalidArgument, quoted
from accelmesh.programs import OutputSpec, Program, TensorSpec

SHOWN_DIMS = 16  # a client's shape may have any rank; messages show this many dims of it


def check_signature(program: Program, inputs: Sequence[TensorSpec], field: str = "inputs") -> None:
    """Raise InvalidArgument naming the first input that the program cannot take.

    Names, dtypes, ranks and non-batch dims must match exactly; where the program has the
    symbolic batch dim (None) the client may give any positive size, or None when it does not
    know the size yet.
    """
    expected = program.inputs
    if len(inputs) != len(expected):
        raise InvalidArgument(
            f"{field}: {len(inputs)} given, {program.ref} expects {len(expected)} "
            f"({', '.join(_describe(s) for s in expected)})")
    for i, (got, want) in enumerate(zip(inputs, expected)):
        where = f"{field}[{i}] {quoted(got.name)}"
        if got.name != want.name:
            raise InvalidArgument(f"{where}: name differs, {program.ref} expects {want.name!r} at this position")
        if got.dtype != want.dtype:
            raise InvalidArgument(f"{where}: dtype {got.dtype}, program expects {want.dtype}")
        if len(got.shape) != len(want.shape):
            raise InvalidArgument(f"{where}: rank {len(got.shape)} {_shape(got.shape)}, "
                                  f"program expects rank {len(want.shape)} {_shape(want.shape)}")
        for axis, (g, w) in enumerate(zip(got.shape, want.shape)):
            if w is None:
                if g is not None and (not isinstance(g, int) or g <= 0):
                    raise InvalidArgument(f"{where}: batch dimension (axis {axis}) is {g}; "
                                          "give a positive size, or leave it unset")
            elif g != w:
                raise InvalidArgument(f"{where}: shape {_shape(got.shape)}, axis {axis} is {g}, "
                                      f"program expects {w} ({_shape(want.shape)})")


def program_digest(name: str, version: str, kind: str, parameters: Iterable[TensorSpec],
                   inputs: Iterable[TensorSpec], outputs: Iterable[OutputSpec],
                   code: Iterable[object] = ()) -> str:
    """sha256 over the signature and the source of the modules defining `code`.

    `code` holds modules, functions or classes; each contributes the full text of its module,
    so editing a helper the function calls also changes the digest. Sorted by module name so
    the digest does not depend on argument order; nothing process-specific (ids, hashes of
    str) enters it, so it is stable across processes.
    """
    signature = {
        "name": name,
        "version": version,
        "kind": kind,
        "parameters": [_spec(s) for s in parameters],
        "inputs": [_spec(s) for s in inputs],
        "outputs": [[*_spec(s), s.combine] for s in outputs],
    }
    h = hashlib.sha256(json.dumps(signature, sort_keys=True).encode())
    modules = {}
    for obj in code:
        module = obj if isinstance(obj, types.ModuleType) else inspect.getmodule(obj)
        if module is None:
            raise ValueError(f"cannot find the module defining {obj!r}")
        modules[module.__name__] = module
    for module_name in sorted(modules):
        h.update(b"\0module\0" + module_name.encode() + b"\0")
        h.update(inspect.getsource(modules[module_name]).encode())
    return h.hexdigest()


def _spec(spec: TensorSpec) -> list[object]:
    return [spec.name, spec.dtype, list(spec.shape)]


def _shape(shape: Sequence[int | None]) -> str:
    dims = ["None" if d is None else str(d) for d in shape[:SHOWN_DIMS]]
    return "[" + ", ".join(dims) + (f", ... ({len(shape)} dims)]" if len(shape) > SHOWN_DIMS else "]")


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.dtype}{_shape(spec.shape)}"
