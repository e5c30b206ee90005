"""Parameter files: .npz archives whose keys are leaf names ('block_0/attn/wq'), and the size
limit on initial parameters a service materialises.

Loaded with allow_pickle=False: a parameter file is data and must never execute code.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

from accelmesh.errors import InvalidArgument, ResourceExhausted
from accelmesh.programs import Program

ParamSource = str | os.PathLike[str] | bytes | BinaryIO


def load_params(program: Program, source: ParamSource) -> list[np.ndarray]:
    """Leaves in Program.parameters order, validated against the program's parameter specs."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        with np.load(source, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise InvalidArgument("parameters: a single .npy array was given; "
                                      "give a .npz archive keyed by leaf name")
            arrays = {name: archive[name] for name in archive.files}
    except InvalidArgument:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InvalidArgument(f"parameters: not a readable .npz archive: {exc}") from exc
    return _validated(program, arrays)


def save_params(program: Program, leaves: Sequence[np.ndarray], target: str | os.PathLike[str] | BinaryIO) -> None:
    """Write leaves (Program.parameters order) as an .npz archive, refusing ones load would reject."""
    if len(leaves) != len(program.parameters):
        raise InvalidArgument(f"parameters: {len(leaves)} leaves given, {program.ref} has "
                              f"{len(program.parameters)}")
    arrays = {spec.name: np.asarray(leaf) for spec, leaf in zip(program.parameters, leaves)}
    _validated(program, arrays)
    np.savez(target, **arrays)


def parameter_bytes(program: Program) -> int:
    """Bytes of the program's parameters at their declared dtypes, from the specs alone."""
    return sum(math.prod(spec.shape) * np.dtype(spec.dtype).itemsize for spec in program.parameters)


def check_initialisable(program: Program, max_bytes: int) -> None:
    """Refuse to materialise initial parameters beyond max_bytes (a published-size model would
    take this host's memory): raise ResourceExhausted naming the program, its size and the limit."""
    size = parameter_bytes(program)
    if size > max_bytes:
        raise ResourceExhausted(
            f"program {program.ref} has {size} parameter bytes ({size / 1024**3:.2f} GiB), over this compile "
            f"service's limit of {max_bytes} bytes for initial parameters (ACCELMESH_MAX_PARAMETER_BYTES); "
            "models of this size are served here for planning (DescribeProgram, placement), not to run: "
            "send the parameters with the job, or raise the limit on a host with the memory")


def _validated(program: Program, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    expected = {spec.name for spec in program.parameters}
    missing = [spec.name for spec in program.parameters if spec.name not in arrays]
    if missing:
        raise InvalidArgument(f"parameters: missing leaf {missing[0]!r} of {program.ref}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(arrays) - expected)
    if unexpected:
        raise InvalidArgument(f"parameters: unexpected leaf {unexpected[0]!r}; {program.ref} has no such "
                              "parameter (check the program version)")
    leaves = []
    for spec in program.parameters:
        array = arrays[spec.name]
        if tuple(array.shape) != tuple(spec.shape):
            raise InvalidArgument(f"parameters[{spec.name!r}]: shape {list(array.shape)}, "
                                  f"{program.ref} expects {list(spec.shape)}")
        if str(array.dtype) != spec.dtype:
            raise InvalidArgument(f"parameters[{spec.name!r}]: dtype {array.dtype}, "
                                  f"{program.ref} expects {spec.dtype}")
        leaves.append(array)
    return leaves
