"""Run a shard on one of this node's devices (requirements A6).

A shard is admitted only on a device this node owns whose target type is the one its artifact
was built for. Its artifact becomes runnable once per (artifact, input shapes, device): an
executable is loaded, a portable StableHLO artifact is compiled with the rule's XLA options,
and the result stays in memory for the next shard of that shape. Shards on one device run one
at a time, in the order they get its lock; shards on different devices run concurrently.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from accelmesh import errors
from accelmesh.artifacts import JaxCaches, compile_portable, load_executable, load_portable
from accelmesh.hardware.model import DeviceSpec
from accelmesh.programs import BuildOptions, TargetType

FORMATS = ("stablehlo", "executable")
QUEUED, LOADING, RUNNING, DONE = "queued", "loading", "running", "done"  # stages, in order
LOAD_EXECUTABLE, COMPILE_PORTABLE = "executable", "compiled"  # how an artifact was made runnable
MAX_LOADED_EXECUTABLES = 64  # runnables kept in memory, least recently used dropped first
LOCK_POLL_S = 0.05  # how often a queued shard checks whether its caller is still there
MAX_MATCHED_TYPES = 1024  # (device, target type) pairs remembered as matching; forgotten all at once past it


@dataclass(frozen=True)
class Shard:
    """What to run, where and with which build; inputs travel separately."""

    job_id: str
    shard_index: int
    attempt: int
    device_id: str  # must be one of this node's devices
    target_type: str  # the artifact's target type; must match the device
    artifact_key: str
    artifact_digest: str  # sha256 hex; the bytes are verified against it before loading
    artifact_format: str  # one of FORMATS
    build: BuildOptions  # the rule's options; its XLA options finish a portable artifact
    input_count: int  # parameters first, then data inputs
    batch_size: int


@dataclass(frozen=True)
class ShardTimings:
    receive_seconds: float  # receiving the inputs
    queue_seconds: float  # waiting for the device
    load_seconds: float  # fetching, loading or compiling the artifact
    execute_seconds: float  # inputs onto the device, the run, outputs back to the host
    artifact_cached: bool  # the artifact came from this worker's memory or disk, not the network
    load_kind: str  # LOAD_EXECUTABLE or COMPILE_PORTABLE


@dataclass(frozen=True)
class ShardResult:
    outputs: tuple[np.ndarray, ...]  # in the program's output order
    timings: ShardTimings


@dataclass(frozen=True)
class FetchedArtifact:
    data: bytes  # verified against the digest asked for
    cached: bool  # read from local disk rather than fetched


class ArtifactSource(Protocol):
    def fetch(self, key: str, digest: str) -> FetchedArtifact: ...


class ShardCancelled(Exception):
    """The caller went away before the shard ran; nothing was started on the device."""


@dataclass(frozen=True)
class _Runnable:
    call: Callable[..., Any]
    kind: str


def _never() -> bool:
    return False


def _ignore(stage: str) -> None:
    pass


def check_target_type(target_type: str, device: DeviceSpec) -> None:
    """The artifact's target type must name the device's platforms and type, and only flags it has."""
    want = TargetType.parse(target_type)
    problems = [f"{what} {wanted} != {have}" for what, wanted, have in (
        ("platform", want.platform, device.platform),
        ("execution platform", want.execution_platform, device.execution_platform),
        ("device type", want.device_type, device.type),
    ) if wanted != have]
    if missing := sorted(want.capabilities - device.capabilities):
        problems.append(f"device lacks {', '.join(missing)}")
    if problems:
        raise errors.FailedPrecondition(
            f"artifact for target type {target_type} cannot run on {device.id} "
            f"({TargetType(device.platform, device.execution_platform, device.type, device.capabilities).key}): "
            f"{'; '.join(problems)}; send the artifact built for this device's target type")


def check_inputs(expected: Sequence[Any], inputs: Sequence[np.ndarray], what: str) -> None:
    """Inputs against the artifact's avals; a symbolic dimension must take one value throughout."""
    if len(expected) != len(inputs):
        raise errors.InvalidArgument(f"{what} takes {len(expected)} inputs (parameters, then data inputs) "
                                     f"but the shard sent {len(inputs)}")
    bound: dict[str, int] = {}
    for index, (aval, array) in enumerate(zip(expected, inputs)):
        fits = np.dtype(aval.dtype) == array.dtype and len(aval.shape) == array.ndim and all(
            want == got if isinstance(want, int) else bound.setdefault(str(want), got) == got
            for want, got in zip(aval.shape, array.shape))
        if not fits:
            shape = [d if isinstance(d, int) else str(d) for d in aval.shape]
            raise errors.InvalidArgument(f"input {index}: {what} takes {np.dtype(aval.dtype)}{shape}, "
                                         f"the shard sent {array.dtype}{list(array.shape)}")


class ShardExecutor:
    def __init__(self, devices: Mapping[str, DeviceSpec], jax_devices: Mapping[str, Any], artifacts: ArtifactSource,
                 *, clock: Callable[[], float] = time.perf_counter, max_loaded: int = MAX_LOADED_EXECUTABLES):
        self._devices = dict(devices)  # device id -> spec
        self._jax_devices = dict(jax_devices)  # execution device name ("cpu:2") -> jax device
        self._device_locks = {name: threading.Lock() for name in self._jax_devices}
        self._artifacts = artifacts
        self._clock = clock
        self._max_loaded = max_loaded
        self._loaded: OrderedDict[tuple, _Runnable] = OrderedDict()
        self._matched: set[tuple[str, str]] = set()  # (device id, target type) pairs that passed the check
        self._lock = threading.Lock()
        self._jax_caches = JaxCaches()  # what portable compiles leave in jax, cleared (accelmesh/artifacts.py)
        self.on_done: Callable[[Shard, ShardTimings], None] = lambda shard, timings: None  # metrics.py
        self.executions = 0  # shards that ran on a device

    def admit(self, shard: Shard) -> DeviceSpec:
        """Check that the shard can run here, before its inputs are received."""
        for field in ("device_id", "target_type", "artifact_key", "artifact_digest"):
            if not getattr(shard, field):
                raise errors.InvalidArgument(f"header.{field} is required")
        if shard.artifact_format not in FORMATS:
            raise errors.InvalidArgument(f"header.artifact_format must be one of {', '.join(FORMATS)}")
        if shard.input_count < 0 or shard.batch_size < 0:
            raise errors.InvalidArgument("header.input_count and header.batch_size must not be negative")
        device = self._devices.get(shard.device_id)
        if device is None:
            raise errors.NotFound(f"device {shard.device_id} is not on this node; it holds "
                                  f"{', '.join(sorted(self._devices)) or 'no devices'}")
        if (shard.device_id, shard.target_type) in self._matched:
            return device  # every shard of a job asks the same: parsed and checked once
        check_target_type(shard.target_type, device)
        if device.execution_device not in self._jax_devices:
            raise errors.FailedPrecondition(f"device {device.id} runs on {device.execution_device or device.platform}, "
                                            "which this worker process has no JAX device for")
        with self._lock:
            if len(self._matched) >= MAX_MATCHED_TYPES:
                self._matched.clear()
            self._matched.add((shard.device_id, shard.target_type))
        return device

    def run(self, shard: Shard, inputs: Sequence[np.ndarray], *, receive_seconds: float = 0.0,
            on_stage: Callable[[str], None] = _ignore, cancelled: Callable[[], bool] = _never) -> ShardResult:
        """Run the shard on its device, blocking until the outputs are on the host.

        `on_stage` hears QUEUED, LOADING, RUNNING and DONE as they happen; `cancelled` is asked
        before each step, and once it says True the shard stops with ShardCancelled. A run
        that has started cannot be interrupted (XLA offers no way), so it is checked last just
        before the run.
        """
        device = self.admit(shard)
        if len(inputs) != shard.input_count:
            raise errors.InvalidArgument(f"header.input_count is {shard.input_count} but {len(inputs)} inputs came")
        name = device.execution_device
        jax_device, lock = self._jax_devices[name], self._device_locks[name]
        on_stage(QUEUED)
        queued = self._clock()
        while not lock.acquire(timeout=LOCK_POLL_S):
            if cancelled():
                raise ShardCancelled(f"shard {shard.shard_index} of job {shard.job_id}: caller gone while queued")
        try:
            queue_s = self._clock() - queued
            if cancelled():
                raise ShardCancelled(f"shard {shard.shard_index} of job {shard.job_id}: caller gone while queued")
            on_stage(LOADING)
            loading = self._clock()
            runnable, cached = self._runnable(shard, inputs, name, jax_device)
            load_s = self._clock() - loading
            if cancelled():
                raise ShardCancelled(f"shard {shard.shard_index} of job {shard.job_id}: caller gone while loading")
            on_stage(RUNNING)
            running = self._clock()
            outputs = _execute(runnable.call, inputs, jax_device)
            execute_s = self._clock() - running
            with self._lock:
                self.executions += 1
            on_stage(DONE)  # while the device is still ours: DONE of one shard precedes RUNNING of the next
        finally:
            lock.release()
        timings = ShardTimings(receive_seconds, queue_s, load_s, execute_s, cached, runnable.kind)
        self.on_done(shard, timings)
        return ShardResult(outputs, timings)

    def _runnable(self, shard: Shard, inputs: Sequence[np.ndarray], name: str,
                  jax_device: Any) -> tuple[_Runnable, bool]:
        # The input shapes stand for the batch size (and catch a shard whose shapes changed).
        signature = tuple((a.shape, a.dtype.str) for a in inputs)
        key = (shard.artifact_key, shard.artifact_digest, shard.artifact_format, name, signature)
        with self._lock:
            runnable = self._loaded.get(key)
            if runnable is not None:
                self._loaded.move_to_end(key)
                return runnable, True
        fetched = self._artifacts.fetch(shard.artifact_key, shard.artifact_digest)
        runnable = self._load(shard, fetched.data, inputs, name, jax_device)
        with self._lock:
            self._loaded[key] = runnable
            while len(self._loaded) > self._max_loaded:
                self._loaded.popitem(last=False)
        return runnable, fetched.cached

    def _load(self, shard: Shard, data: bytes, inputs: Sequence[np.ndarray], name: str, jax_device: Any) -> _Runnable:
        what = f"artifact {shard.artifact_key} ({shard.artifact_format})"
        try:
            if shard.artifact_format == "executable":
                loaded = load_executable(data, device=jax_device)
                expected, kind = jax.tree.leaves(loaded.in_avals), LOAD_EXECUTABLE
            else:
                loaded = load_portable(data)
                expected, kind = loaded.in_avals, COMPILE_PORTABLE
        except Exception as exc:  # unpickling, flatbuffers and XLA fail in their own ways; all mean "unusable"
            raise errors.FailedPrecondition(f"{what} did not load on {name}: {exc}") from exc
        check_inputs(expected, inputs, what)
        if kind == LOAD_EXECUTABLE:
            return _Runnable(loaded, kind)
        sharding = jax.sharding.SingleDeviceSharding(jax_device)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in inputs]
        try:
            with self._jax_caches.building():  # the LRU above keeps what is reused, not jax's caches
                self._jax_caches.built()
                return _Runnable(compile_portable(loaded, shard.build, *specs), kind)
        except errors.AccelmeshError as exc:
            raise errors.FailedPrecondition(f"{what} did not compile for {name}: {exc}") from exc


def _execute(call: Callable[..., Any], inputs: Sequence[np.ndarray], jax_device: Any) -> tuple[np.ndarray, ...]:
    # The inputs go as they are: both runnables put them on their device themselves (a loaded
    # executable with one device_put of them all, a compiled portable artifact through jax's own
    # call path, onto the device its argument shardings name). Putting them here as well cost a
    # second device_put per shard (about 90 us of a small shard's 250 here).
    try:
        outputs = jax.block_until_ready(call(*inputs))
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" in str(exc):
            raise errors.ResourceExhausted(f"device {jax_device} ran out of memory: {exc}") from exc
        raise
    leaves = jax.tree.leaves(outputs)
    for index, leaf in enumerate(leaves):
        if leaf.devices() != {jax_device}:
            raise errors.FailedPrecondition(
                f"output {index} is on {sorted(map(str, leaf.devices()))}, not on {jax_device}; the artifact is bound "
                "to another device")
    return tuple(np.asarray(leaf) for leaf in leaves)
