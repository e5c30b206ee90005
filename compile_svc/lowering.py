"""Lower a program once per target type under a compile rule's BuildOptions (MISSION A5).

Two artifact formats (model.FORMATS): "stablehlo" is portable `jax.export` bytes for any
platform, with one symbolic batch dimension, compiled by the worker with the rule's XLA
options; "executable" is a compiled XLA executable for the local backend at one batch size.
Every artifact keeps the program's declared interface whatever the rule: the compute dtype
lives inside the function, so shards built under different rules combine without casts.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export
from jax._src import compiler as _jax_compiler
from jax.experimental import serialize_executable

from accelmesh.errors import AccelmeshError, FailedPrecondition, InvalidArgument
from compile_svc.model import BuildOptions, Program

_COMPUTE_DTYPES = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}
_EXECUTABLE_SCHEMA = 1


@contextmanager
def _xla_failures(what: str) -> Iterator[None]:
    """Report XLA's or the program's own reason as FailedPrecondition: the build cannot happen as asked."""
    try:
        yield
    except AccelmeshError:
        raise
    except Exception as exc:  # a program's trace can fail with any exception; all mean "cannot build"
        raise FailedPrecondition(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def xla_compiler_options(options: BuildOptions) -> dict[str, str | int | float | bool]:
    """The rule's XLA options in the types XLA parses: it accepts a Python bool or "True"/"False"
    for bool flags but rejects "true"/"false", which is how TOML-minded operators write them."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in options.xla_options.items():
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        out[str(key)] = value
    return out


def _matmul_precision(name: str) -> AbstractContextManager[Any]:
    # Entered while tracing, which is when JAX reads it; "default" keeps the backend's choice.
    return nullcontext() if name == "default" else jax.default_matmul_precision(name)


def apply_build_options(program: Program, options: BuildOptions) -> Callable[..., tuple]:
    """program.fn with the rule applied: math in options.compute_dtype, declared dtypes at the edges.

    Uploaded programs come back as their Exported.call unchanged: their internals are fixed
    StableHLO, so compute dtype, matmul precision and remat cannot apply; only XLA options do.
    """
    if program.fn is None:
        return _uploaded(program).call
    if options.compute_dtype not in _COMPUTE_DTYPES:
        raise InvalidArgument(f"compute_dtype {options.compute_dtype!r} must be one of {sorted(_COMPUTE_DTYPES)}")
    compute = _COMPUTE_DTYPES[options.compute_dtype]
    body = jax.checkpoint(program.fn) if options.remat else program.fn

    def wrapped(*args: Any) -> tuple:
        if compute is not None:  # integer inputs (token ids, labels) must keep their exact values
            args = tuple(a.astype(compute) if _is_float(a.dtype) else a for a in args)
        with _matmul_precision(options.matmul_precision):
            outs = tuple(body(*args))
        if len(outs) != len(program.outputs):
            raise InvalidArgument(f"{program.ref} returned {len(outs)} outputs but declares {len(program.outputs)}")
        return tuple(
            o.astype(spec.dtype) if _is_float(o.dtype) and _is_float(jnp.dtype(spec.dtype)) else o
            for o, spec in zip(outs, program.outputs)
        )

    return wrapped


def _uploaded(program: Program) -> export.Exported:
    if program.exported is None:
        raise InvalidArgument(f"{program.ref} has neither fn nor exported bytes; register one of them")
    return load_portable(program.exported)


def _abstract_args(program: Program, batch: Any, sharding: Any = None) -> list[jax.ShapeDtypeStruct]:
    """Parameter leaves at their concrete shapes, then data inputs with `batch` on axis 0."""
    out = []
    for spec in (*program.parameters, *program.inputs):
        shape = tuple(batch if i == 0 and spec.batched else d for i, d in enumerate(spec.shape))
        if any(d is None for d in shape):
            raise InvalidArgument(f"{program.ref}: {spec.name}.shape {spec.shape} may use None only on axis 0")
        out.append(jax.ShapeDtypeStruct(shape, jnp.dtype(spec.dtype), sharding=sharding))
    return out


def export_portable(program: Program, options: BuildOptions, platform: str) -> bytes:
    """Serialized jax.export of the rule-applied program for `platform`, batch dimension symbolic."""
    if program.fn is None:
        exp = _uploaded(program)
        if platform not in exp.platforms:
            raise FailedPrecondition(
                f"{program.ref} was uploaded for platforms {list(exp.platforms)}, not {platform!r}; "
                "upload an export that includes it")
    (batch,) = export.symbolic_shape("b")  # one shared dim: every batched input has the same batch
    with _xla_failures(f"exporting {program.ref} for {platform}"):
        exported = export.export(jax.jit(apply_build_options(program, options)), platforms=[platform])(
            *_abstract_args(program, batch))
        return bytes(exported.serialize())


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
    with _xla_failures(f"compiling artifact for platforms {list(exported.platforms)}"):
        return jax.jit(exported.call).lower(*args).compile(compiler_options=xla_compiler_options(options))


def run_portable(exported: export.Exported, options: BuildOptions, *args: Any,
                 device: jax.Device | None = None) -> tuple:
    """Compile (with the rule's XLA options) and run a portable artifact; workers call this."""
    if device is not None:
        args = jax.device_put(args, device)
    return compile_portable(exported, options, *args)(*args)


def compile_executable(program: Program, options: BuildOptions, batch_size: int,
                       device: jax.Device | None = None) -> bytes:
    """A compiled executable for the local backend at a fixed batch, serialized.

    The blob is a pickle (serialize_executable itself pickles the pytree definitions): that is
    acceptable only because the compile service produces these itself. Never load an executable
    a client supplied; clients upload portable StableHLO instead.
    """
    return lower_executable(program, options, batch_size, device)()


def lower_executable(program: Program, options: BuildOptions, batch_size: int,
                     device: jax.Device | None = None) -> Callable[[], bytes]:
    """compile_executable in two steps: trace and lower now, and return the function that
    compiles and serializes. Tracing is Python and holds the GIL; the XLA compile releases it,
    so a caller can run the second step on another thread while it traces something else."""
    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    what = f"compiling {program.ref} for {device.platform} at batch {batch_size}"
    with _xla_failures(what):
        lowered = jax.jit(apply_build_options(program, options)).lower(*_abstract_args(program, batch_size, sharding))

    def compile_and_serialize() -> bytes:
        with _xla_failures(what):
            compiled = lowered.compile(compiler_options=xla_compiler_options(options))
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        header = {"schema": _EXECUTABLE_SCHEMA, "jaxlib": jaxlib.__version__, "platform": device.platform,
                  "xla_options": xla_compiler_options(options)}
        return pickle.dumps((header, payload, in_tree, out_tree))

    return compile_and_serialize


def load_executable(data: bytes, backend: str | None = None, device: jax.Device | None = None) -> jax.stages.Compiled:
    """Load an executable from compile_executable onto `device` (default: first of `backend`).

    An XLA executable carries its device assignment, and serialize_executable binds it to the
    compiling device's id; we retarget it so one artifact serves every device of a target type.
    """
    header, payload, in_tree, out_tree = pickle.loads(data)  # trusted: written by compile_executable
    device = device or jax.devices(backend)[0]
    if header.get("schema") != _EXECUTABLE_SCHEMA or header.get("jaxlib") != jaxlib.__version__:
        raise FailedPrecondition(f"executable built by jaxlib {header.get('jaxlib')}, this is {jaxlib.__version__}; "
                                 "fetch the stablehlo format or rebuild")
    if header.get("platform") != device.platform:
        raise FailedPrecondition(f"executable built for {header.get('platform')}, device is {device.platform}")
    with _xla_failures("loading executable"):
        unloaded, args_info_flat, no_kwargs = _RetargetingUnpickler(
            io.BytesIO(payload), device, header["xla_options"]).load()
        return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                                   no_kwargs=no_kwargs)


class _RetargetingUnpickler(serialize_executable._JaxPjrtUnpickler):
    """serialize_executable's unpickler with every device id mapped to one target device.

    Private jax API, pinned by tests/test_lowering.py: jax's own persistent cache retargets the
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
