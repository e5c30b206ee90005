"""Lower a program once per target type under a compile rule's BuildOptions (requirements A5).

Two artifact formats (accelmesh.programs.FORMATS; loading them is accelmesh.artifacts): "stablehlo" is portable
`jax.export` bytes for any platform, with one symbolic batch dimension, compiled by the worker with the rule's XLA
options; "executable" is a compiled XLA executable for the local backend at one batch size.
Every artifact keeps the program's declared interface whatever the rule: the compute dtype
lives inside the function, so shards built under different rules combine without casts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
from jax import export

from accelmesh.artifacts import load_portable, pack_executable, xla_compiler_options, xla_failures
from accelmesh.errors import FailedPrecondition, InvalidArgument
from accelmesh.programs import BuildOptions, Program

_COMPUTE_DTYPES = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


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
    with xla_failures(f"exporting {program.ref} for {platform}"):
        exported = export.export(jax.jit(apply_build_options(program, options)), platforms=[platform])(
            *_abstract_args(program, batch))
        return bytes(exported.serialize())


def compile_executable(program: Program, options: BuildOptions, batch_size: int,
                       device: jax.Device | None = None) -> bytes:
    """A compiled executable for the local backend at a fixed batch, serialized as data
    (accelmesh.artifacts: a JSON header and XLA's own serialization, nothing pickled). Clients
    still upload portable StableHLO only: an executable is machine code for the device."""
    return lower_executable(program, options, batch_size, device)()


def lower_executable(program: Program, options: BuildOptions, batch_size: int,
                     device: jax.Device | None = None) -> Callable[[], bytes]:
    """compile_executable in two steps: trace and lower now, and return the function that
    compiles and serializes. Tracing is Python and holds the GIL; the XLA compile releases it,
    so a caller can run the second step on another thread while it traces something else."""
    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    what = f"compiling {program.ref} for {device.platform} at batch {batch_size}"
    with xla_failures(what):
        # keep_unused: the executable takes every argument the program declares, in order, so its
        # caller needs no record of which ones jit would have pruned.
        lowered = jax.jit(apply_build_options(program, options), keep_unused=True).lower(
            *_abstract_args(program, batch_size, sharding))

    def compile_and_serialize() -> bytes:
        with xla_failures(what):
            compiled = lowered.compile(compiler_options=xla_compiler_options(options))
            return pack_executable(compiled, device.platform, options)

    return compile_and_serialize


