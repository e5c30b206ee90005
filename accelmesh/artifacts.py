"""The artifact formats, shared by their producer (compile_svc) and their consumer (the worker).

- "stablehlo": bytes of a serialized `jax.export`, portable to any platform it was exported for;
  the consumer finishes the compilation with the rule's XLA options (`compile_portable`).
- "executable": a compiled XLA executable for one backend and batch size: a magic, a JSON header
  (schema, jaxlib, platform, XLA options, the flat inputs' dtypes and shapes, the output count)
  and the backend's own serialization of the XLA executable. Nothing in it is pickled or run on
  load: the bytes go to PJRT's deserialize_executable, which reads them as data. Programs take
  flat arguments and return a flat tuple (accelmesh.programs), so no pytree needs to travel.
  Executables are only produced by the compile service; clients upload StableHLO.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import export
from jax._src import compiler as _jax_compiler
from jax._src import core as _jax_core

try:  # jax's own put of one array onto one device, under device_put (LoadedExecutable)
    from jax._src.interpreters.pxla import batched_device_put as _batched_put
except ImportError:  # moved or gone in another jax: device_put it is
    _batched_put = None

from accelmesh.errors import AccelmeshError, FailedPrecondition, InvalidArgument
from accelmesh.programs import BuildOptions

EXECUTABLE_SCHEMA = 2  # 1 was a pickle; refused
EXECUTABLE_MAGIC = b"AMXE"  # accelmesh executable
_HEADER_LENGTH = struct.Struct(">I")
MAX_EXECUTABLE_HEADER_BYTES = 1 << 20


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
    """The "executable" format of a compilation whose arguments were all kept (jit keep_unused)."""
    runtime = compiled.runtime_executable()
    header = {"schema": EXECUTABLE_SCHEMA, "jaxlib": jaxlib.__version__, "platform": platform,
              "xla_options": xla_compiler_options(options),
              "inputs": [[np.dtype(a.dtype).name, list(a.shape)] for a in jax.tree.leaves(compiled.in_avals)],
              "outputs": len(jax.tree.leaves(compiled.out_info))}
    return join_executable(header, runtime.client.serialize_executable(runtime))


def join_executable(header: dict[str, Any], payload: bytes) -> bytes:
    text = json.dumps(header, sort_keys=True).encode()
    return EXECUTABLE_MAGIC + _HEADER_LENGTH.pack(len(text)) + text + payload


def split_executable(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and the XLA payload of an executable; InvalidArgument for anything else."""
    start = len(EXECUTABLE_MAGIC) + _HEADER_LENGTH.size
    if len(data) < start or data[:len(EXECUTABLE_MAGIC)] != EXECUTABLE_MAGIC:
        raise InvalidArgument("artifact is not an accelmesh executable (no AMXE header); fetch it again or use "
                              "the stablehlo format")
    (length,) = _HEADER_LENGTH.unpack_from(data, len(EXECUTABLE_MAGIC))
    if length > MAX_EXECUTABLE_HEADER_BYTES or start + length > len(data):
        raise InvalidArgument(f"executable header of {length} bytes does not fit the artifact")
    try:
        header = json.loads(data[start: start + length])
    except ValueError as exc:
        raise InvalidArgument(f"executable header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument("executable header is not a JSON object")
    return header, bytes(data[start + length:])


class LoadedExecutable:
    """An executable loaded onto one device: call it with the program's flat arguments.

    A numpy argument already of its input's shape and dtype goes onto the device through jax's
    batched put directly (4-7 us here, aliasing an aligned array as device_put does); device_put
    itself, with its tree and sharding handling, took 35-55 us an argument, a fifth of a small
    shard's worker time. Anything else (a held jax.Array, another dtype to convert) still goes
    through device_put, and so does every argument where jax no longer has that function."""

    def __init__(self, executable: Any, device: jax.Device, in_avals: Sequence[jax.ShapeDtypeStruct], outputs: int):
        self._executable, self.device, self.in_avals, self._outputs = executable, device, list(in_avals), outputs
        self._avals = [_jax_core.ShapedArray(tuple(a.shape), np.dtype(a.dtype)) for a in self.in_avals]
        self._sharding = jax.sharding.SingleDeviceSharding(device)

    def _on_device(self, args: Sequence[Any]) -> list[jax.Array]:
        if _batched_put is None:
            return list(jax.device_put(list(args), self.device))
        return [_batched_put(aval, self._sharding, [arg], [self.device])
                if type(arg) is np.ndarray and arg.dtype == aval.dtype and arg.shape == aval.shape
                else jax.device_put(arg, self.device) for arg, aval in zip(args, self._avals)]

    def __call__(self, *args: Any) -> tuple[jax.Array, ...]:
        if len(args) != len(self.in_avals):
            raise InvalidArgument(f"the executable takes {len(self.in_avals)} arguments, got {len(args)}")
        results = self._executable.execute_sharded(self._on_device(args))
        outputs = tuple(shards[0] for shards in results.disassemble_into_single_device_arrays())
        if len(outputs) != self._outputs:
            raise FailedPrecondition(f"the executable returned {len(outputs)} outputs; its header says {self._outputs}")
        return outputs


def load_executable(data: bytes, backend: str | None = None, device: jax.Device | None = None) -> LoadedExecutable:
    """Load an executable from pack_executable onto `device` (default: first of `backend`).

    An XLA executable carries its device assignment; compile options naming `device` retarget it,
    as jax's own persistent cache does, so one artifact serves every device of a target type.
    """
    header, payload = split_executable(data)
    device = device or jax.devices(backend)[0]
    if header.get("schema") != EXECUTABLE_SCHEMA or header.get("jaxlib") != jaxlib.__version__:
        raise FailedPrecondition(f"executable built by jaxlib {header.get('jaxlib')} (schema {header.get('schema')}), "
                                 f"this is {jaxlib.__version__} (schema {EXECUTABLE_SCHEMA}); fetch the stablehlo "
                                 "format or rebuild")
    if header.get("platform") != device.platform:
        raise FailedPrecondition(f"executable built for {header.get('platform')}, device is {device.platform}")
    try:
        in_avals = [jax.ShapeDtypeStruct(tuple(int(d) for d in shape), np.dtype(dtype))
                    for dtype, shape in header["inputs"]]
        outputs, xla_options = int(header["outputs"]), dict(header["xla_options"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"executable header is malformed: {exc!r}") from None
    options = _jax_compiler.get_compile_options(
        num_replicas=1, num_partitions=1, device_assignment=np.array([[device]]),
        env_options_overrides=xla_options, backend=device.client)
    with xla_failures("loading executable"):
        executable = device.client.deserialize_executable(payload, [device], options)
    return LoadedExecutable(executable, device, in_avals, outputs)


class JaxCaches:
    """Clears jax's in-memory caches once no build that may use them is in progress.

    jax keeps every function it traced and every executable it compiled (about 0.7 MiB an
    executable, in caches 2048 entries long), so a process that builds for ever new shapes (the
    compile service for new batch sizes, a worker compiling portable artifacts for new shard
    shapes) grew by what it had built: 45 MiB over 1,000 fuzzed Compile calls. Neither reuses
    them: the compile service serves a key again from its artifact cache, a worker from its
    loaded-executable LRU. Build inside ``building()``; when the last build ends and something
    was built, the caches are cleared, so no build loses them midway.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._built = False

    @contextmanager
    def building(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                clear = self._active == 0 and self._built
                if clear:
                    self._built = False
            if clear:
                jax.clear_caches()

    def built(self) -> None:
        """Something was traced or compiled in the current build."""
        self._built = True
