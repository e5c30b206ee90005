"""Parameter files: .npz archives whose keys are leaf names ('block_0/attn/wq').

Loaded with allow_pickle=False: a parameter file is data and must never execute code.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

from accelmesh.errors import InvalidArgument
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
