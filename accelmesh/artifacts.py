"""The artifact formats, shared by their producer (compile_svc) and their consumer (the worker).

- "stablehlo": bytes of a serialized `jax.export`, portable to any platform it was exported for;
  the consumer finishes the compilation with the rule's XLA options (`compile_portable`).
- "executable": a compiled XLA executable for one backend and batch size, serialized with
  `jax.experimental.serialize_executable` behind a small header. Its payload pickles pytree
  definitions, so executables are only ever produced by the compile service and fetched over the
  mesh's own channels; clients upload StableHLO, never executables.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import export
from jax._src import compiler as _jax_compiler
from jax.experimental import serialize_executable

from accelmesh.errors import AccelmeshError, FailedPrecondition, InvalidArgument
from accelmesh.programs import BuildOptions

EXECUTABLE_SCHEMA = 1


@contextmanager
def xla_failures(what: str) -> Iterator[None]:
    """Report XLA's or the program's own reason as FailedPrecondition: the build cannot happen as asked."""
    try:
        yield
    except AccelmeshError:
        raise
    except Exception as exc:  # a program's trace can fail with any exception; all mean "cannot build"
        raise FailedPrecondition(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def xla_compiler_options(options: BuildOptions) -> dict[str, str | int | float | bool]:
    """The rule's XLA options in the types XLA parses: it accepts a Python bool or "True"/"False"
    for bool flags but rejects "true"/"false", which is how TOML-minded operators write them."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in options.xla_options.items():
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        out[str(key)] = value
    return out


def load_portable(data: bytes) -> export.Exported:
    try:
        return export.deserialize(bytearray(data))
    except Exception as exc:  # flatbuffers raises assorted errors on foreign bytes
        raise InvalidArgument(f"artifact is not a serialized jax.export: {exc}") from exc


def hlo_text(data: bytes) -> str:
    """StableHLO MLIR text of a portable artifact, for tests and inspection."""
    return load_portable(data).mlir_module()


def compile_portable(exported: export.Exported, options: BuildOptions, *args: Any,
                     device: jax.Device | None = None) -> jax.stages.Compiled:
    """Compile a portable artifact for these argument shapes with the rule's XLA options."""
    if device is not None:
        args = jax.device_put(args, device)
    with xla_failures(f"compiling artifact for platforms {list(exported.platforms)}"):
        return jax.jit(exported.call).lower(*args).compile(compiler_options=xla_compiler_options(options))


def run_portable(exported: export.Exported, options: BuildOptions, *args: Any,
                 device: jax.Device | None = None) -> tuple:
    """Compile (with the rule's XLA options) and run a portable artifact; workers call this."""
    if device is not None:
        args = jax.device_put(args, device)
    return compile_portable(exported, options, *args)(*args)


def pack_executable(compiled: jax.stages.Compiled, platform: str, options: BuildOptions) -> bytes:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    header = {"schema": EXECUTABLE_SCHEMA, "jaxlib": jaxlib.__version__, "platform": platform,
              "xla_options": xla_compiler_options(options)}
    return pickle.dumps((header, payload, in_tree, out_tree))


def load_executable(data: bytes, backend: str | None = None, device: jax.Device | None = None) -> jax.stages.Compiled:
    """Load an executable from compile_executable onto `device` (default: first of `backend`).

    An XLA executable carries its device assignment, and serialize_executable binds it to the
    compiling device's id; we retarget it so one artifact serves every device of a target type.
    """
    header, payload, in_tree, out_tree = pickle.loads(data)  # trusted: written by pack_executable
    device = device or jax.devices(backend)[0]
    if header.get("schema") != EXECUTABLE_SCHEMA or header.get("jaxlib") != jaxlib.__version__:
        raise FailedPrecondition(f"executable built by jaxlib {header.get('jaxlib')}, this is {jaxlib.__version__}; "
                                 "fetch the stablehlo format or rebuild")
    if header.get("platform") != device.platform:
        raise FailedPrecondition(f"executable built for {header.get('platform')}, device is {device.platform}")
    with xla_failures("loading executable"):
        unloaded, args_info_flat, no_kwargs = _RetargetingUnpickler(
            io.BytesIO(payload), device, header["xla_options"]).load()
        return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                                   no_kwargs=no_kwargs)


class _RetargetingUnpickler(serialize_executable._JaxPjrtUnpickler):
    """serialize_executable's unpickler with every device id mapped to one target device.

    Private jax API, pinned by tests/compile/test_lowering.py: jax's own persistent cache retargets the
    same way (deserialize_executable with compile options naming the new device assignment).
    """

    def __init__(self, file: io.BytesIO, device: jax.Device, xla_options: dict[str, Any]):
        super().__init__(file, device.client, [device])
        self._device = device
        self._compile_options = _jax_compiler.get_compile_options(
            num_replicas=1, num_partitions=1, device_assignment=np.array([[device]]),
            env_options_overrides=dict(xla_options), backend=device.client)

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "exec":
            return self.backend.deserialize_executable(pid[1], self.execution_devices, self._compile_options)
        if pid[0] == "device":
            return self._device
        return super().persistent_load(pid)
