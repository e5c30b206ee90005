"""Compile a program for a set of devices: one build per target type, cached by content (requirements A4, A5).

A request may name consecutive layers of a layered model instead: the stage is derived as a
program of its own (compile_svc.programs.stages) and built exactly like a whole program.

Devices are grouped by target type (platform, execution platform, kind, rule-relevant flags)
and the rule each gets under the request's precision; every group is lowered once. Artifacts are
keyed by rule and options as well as target type, so a device type's fp32 and bf16 builds never
stand in for each other. The portable StableHLO artifact is always
built; where the group's execution backend is local, compiled executables are built too for
the batch sizes asked for, so a worker can load instead of compiling.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax

from accelmesh import errors
from accelmesh.artifacts import JaxCaches
from accelmesh.errors import quoted
from accelmesh.hardware.model import DeviceSpec
from accelmesh.programs import Program, TargetType, TensorSpec
from compile_svc import lowering
from compile_svc.cache import ArtifactCache, CachedArtifact
from compile_svc.programs import ProgramRegistry, check_signature
from compile_svc.programs.stages import LayerRange, StageCatalog
from compile_svc.rules import (
    Explanation,
    PrecisionUnmet,
    Rule,
    RuleTable,
    allowed_compute_dtypes,
    describe_precision,
)

STABLEHLO, EXECUTABLE = "stablehlo", "executable"
# The most rows one executable is built for: far past any shard, and small enough that no
# program's shapes at that batch overflow XLA's 64-bit element counts.
MAX_BATCH_SIZE = 2**31 - 1


@dataclass(frozen=True)
class BuiltArtifact:
    key: str
    format: str  # STABLEHLO or EXECUTABLE
    batch_size: int  # 0 for the portable artifact
    size_bytes: int
    digest: str
    platform: str
    cache_hit: bool
    build_seconds: float


@dataclass(frozen=True)
class TargetBuild:
    target_type: TargetType
    rule: Rule
    device_ids: tuple[str, ...]
    portable: BuiltArtifact
    executables: tuple[BuiltArtifact, ...]


@dataclass(frozen=True)
class CompileResult:
    program: Program  # the registered program
    builds: tuple[TargetBuild, ...]
    stage: Program | None = None  # what was built when the request named layers


def local_platforms() -> frozenset[str]:
    return frozenset(d.platform for d in jax.devices())


class Compiler:
    def __init__(
        self,
        registry: ProgramRegistry,
        rules: RuleTable,
        cache: ArtifactCache,
        *,
        max_batch_sizes: int = 16,
        local: frozenset[str] | None = None,
    ):
        self.registry = registry
        self.rules = rules
        self.cache = cache
        self._max_batch_sizes = max_batch_sizes
        self._local = local if local is not None else local_platforms()
        self._lock = threading.Lock()
        self.stages = StageCatalog()
        self._jax_caches = JaxCaches()  # cleared once no build is in progress (see JaxCaches)

    def explain(self, device: DeviceSpec, precision: str = "") -> Explanation:
        return self.rules.explain(device, precision)

    def compile(
        self,
        name: str,
        version: str,
        targets: Sequence[DeviceSpec],
        *,
        inputs: Sequence[TensorSpec] = (),
        batch_sizes: Sequence[int] = (),
        layers: LayerRange | None = None,
        precision: str = "",
    ) -> CompileResult:
        allowed = allowed_compute_dtypes(precision)
        program = self.registry.get(name, version)
        if "fp16" in allowed and (program.kind == "training_step" or (layers is not None and layers.backward)):
            # Gradients underflow fp16's range without loss scaling, which no rule applies.
            what = "a training step" if program.kind == "training_step" else "a stage's backward pass asked for"
            raise errors.InvalidArgument(
                f"precision fp16 is for inference only, and {program.ref} is {what}; ask for bf16 or fp32",
                field="precision")
        stage = None
        if layers is not None:
            stage = self.stages.stage(program, self.registry.layer_functions(name, program.version), layers)
        to_build = stage if stage is not None else program
        if inputs:
            check_signature(to_build, list(inputs))
        if not targets:
            raise errors.InvalidArgument(
                "targets is empty; pass the devices to build for (as ListDevices returns them)")
        sizes = sorted(set(batch_sizes))
        if len(sizes) > self._max_batch_sizes:
            raise errors.InvalidArgument(
                f"batch_sizes asks for {len(sizes)} executables; at most {self._max_batch_sizes} per call "
                f"(bucket shard sizes, rely on the portable artifact, or raise ACCELMESH_MAX_BATCH_SIZES)",
                field="batch_sizes",
            )
        if any(not 0 < b <= MAX_BATCH_SIZE for b in sizes):
            # XLA aborts the whole process (not an exception) when a shape's element count overflows.
            raise errors.InvalidArgument(f"batch_sizes {quoted(list(batch_sizes))} must all be within "
                                         f"1..{MAX_BATCH_SIZE}", field="batch_sizes")
        groups: dict[tuple[str, str], tuple[TargetType, Rule, list[str]]] = {}
        unmet: dict[str, PrecisionUnmet] = {}  # by target type: one line per kind of device
        for device in targets:
            try:
                rule = self.rules.match(device, precision)
            except PrecisionUnmet as refusal:
                unmet.setdefault(refusal.target_type.key, refusal)
                continue
            target = self.rules.target_type(device)
            groups.setdefault((target.key, rule.name), (target, rule, []))[2].append(device.id)
        if unmet:
            raise _unmet(precision, list(unmet.values()), len(targets), every=not groups)
        with self._jax_caches.building():
            builds = [self._build(to_build, target, rule, ids, sizes) for target, rule, ids in groups.values()]
        return CompileResult(program, tuple(builds), stage)

    def _build(self, program: Program, target: TargetType, rule: Rule, ids: list[str], sizes: list[int]) -> TargetBuild:
        platform = target.execution_platform

        def export() -> bytes:
            return lowering.export_portable(program, rule.build, platform)

        if not sizes or platform not in self._local or program.fn is None:
            portable = self._artifact(program, target, rule, STABLEHLO, 0, export)
            return TargetBuild(target, rule, tuple(ids), portable, ())
        device = jax.devices(platform)[0]
        # The export overlaps the executables' XLA compiles, which release the GIL (tracing, like
        # the export, holds it): once the first executable is traced, the export starts on a
        # second thread while this one compiles (bench/compile.py measures the gain). The pool
        # starts its thread on first submit, so when everything is cached no thread is made.
        # Leaving the block waits for the export, so nothing outlives the call.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-export") as pool:
            exporting: list[Future[BuiltArtifact]] = []  # the export, once started

            def build_executable(size: int) -> bytes:
                compile_and_serialize = lowering.lower_executable(program, rule.build, size, device)
                if not exporting:
                    exporting.append(pool.submit(self._artifact, program, target, rule, STABLEHLO, 0, export))
                return compile_and_serialize()

            try:
                executables = tuple(self._artifact(program, target, rule, EXECUTABLE, size,
                                                   functools.partial(build_executable, size)) for size in sizes)
            except BaseException:
                if exporting and exporting[0].exception() is not None:
                    raise exporting[0].exception() from None  # the export's error first, as when the export ran first
                raise
            portable = (exporting[0].result() if exporting
                        else self._artifact(program, target, rule, STABLEHLO, 0, export))
        return TargetBuild(target, rule, tuple(ids), portable, executables)

    def _artifact(self, program: Program, target: TargetType, rule: Rule, fmt: str, batch: int, make) -> BuiltArtifact:
        key = self.cache.key_for(
            program=program.digest,
            target=target.key,
            rule=rule.name,
            options=build_options_key(rule.build),
            format=fmt,
            batch_size=batch,
        )
        spent = {}

        def build():
            started = time.perf_counter()
            payload = make()
            spent["s"] = time.perf_counter() - started
            return payload, {"program": program.ref, "target": target.key, "rule": rule.name, "format": fmt,
                             "batch_size": batch, "platform": target.execution_platform}

        artifact, built = self.cache.get_or_build(key, build)
        if built:
            self._jax_caches.built()
        return _built(artifact, fmt, batch, target.execution_platform, not built, spent.get("s", 0.0))

    def fetch(self, key: str) -> CachedArtifact:
        artifact = self.cache.get(key)
        if artifact is None:
            raise errors.NotFound(f"artifact {quoted(key)} is not in the cache; call Compile to (re)build it")
        return artifact


def _unmet(precision: str, refusals: list[PrecisionUnmet], targets: int, every: bool) -> errors.FailedPrecondition:
    """One error for every kind of device the precision leaves without a rule, naming the fix."""
    dtypes = sorted({r.build.compute_dtype for refusal in refusals for r in refusal.matched})
    return errors.FailedPrecondition(
        f"{describe_precision(precision)} leaves {'all' if every else 'some'} of the {targets} "
        "target devices without a compile rule: " + "; ".join(str(refusal) for refusal in refusals)
        + f". Allow {' or '.join(dtypes)} in precision, leave these devices out (constraints), or add a rule that "
        "computes in an allowed dtype for them", field="precision")


def build_options_key(options) -> dict:
    """The rule's options as plain data for the cache key (xla_options may be a read-only mapping)."""
    return {f.name: dict(getattr(options, f.name)) if f.name == "xla_options" else getattr(options, f.name)
            for f in dataclasses.fields(options)}


def _built(artifact: CachedArtifact, fmt: str, batch: int, platform: str, hit: bool, seconds: float) -> BuiltArtifact:
    return BuiltArtifact(artifact.key, fmt, batch, artifact.size, artifact.digest, platform, hit, seconds)
