"""Host CPU probe: model, cores, memory and ISA flags from /proc, plus estimated peak rates."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.capabilities import CAPABILITIES
from accelmesh.hardware.model import Performance

# Nothing in /proc states memory bandwidth. One DDR4-3200 channel moves 25.6 GB/s and servers
# have 4-12 channels, while memcpy on the 2-core development VM measured ~19 GB/s, so 20 GB/s
# is a floor that keeps planners from over-trusting host memory. Operators who measured their
# hosts set ACCELMESH_CPU_MEMORY_BANDWIDTH_GBPS instead.
CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE = 20.0
MEMORY_BANDWIDTH_ENV = "ACCELMESH_CPU_MEMORY_BANDWIDTH_GBPS"

# ARM kernels print no clock in cpuinfo; 2 GHz is below every current server ARM core, so the
# estimate errs low. ACCELMESH_CPU_GHZ overrides it (and any clock cpuinfo reports).
DEFAULT_CLOCK_GHZ = 2.0
CLOCK_ENV = "ACCELMESH_CPU_GHZ"

# Most server cores issue two vector FMAs per cycle (some AVX-512 parts have one 512-bit unit,
# so this is a peak, not a promise).
FMA_UNITS_PER_CORE = 2

# Widest vector unit first: (raw cpuinfo flag, fp32 lanes per vector, fused multiply-add).
_VECTOR_UNITS = (("avx512f", 16, True), ("fma", 8, True), ("avx", 8, False), ("asimd", 4, True))
_SSE2_UNIT = (None, 4, False)  # every x86-64 core has it

# Low-precision ops per cycle per core, fastest unit first within a precision: AMX tiles do
# 1024 bf16 / 2048 int8 ops; AVX-512 BF16 packs 2 and VNNI 4 products into each fp32 lane.
_LOW_PRECISION_UNITS = (
    ("amx_bf16", "bf16", 1024),
    ("avx512_bf16", "bf16", 2 * FMA_UNITS_PER_CORE * 16 * 2),
    ("amx_int8", "int8", 2048),
    ("avx512_vnni", "int8", 4 * FMA_UNITS_PER_CORE * 16 * 2),
    ("avx_vnni", "int8", 4 * FMA_UNITS_PER_CORE * 8 * 2),
)

# cpuinfo spells some flags differently from our vocabulary (ARM says asimd for NEON).
_FLAG_ALIASES = {"asimd": "neon"}

# Numeric formats a raw flag gives; every CPU computes fp64 at half its fp32 rate.
_FORMAT_FLAGS = {
    "bf16": {"avx512_bf16", "amx_bf16", "bf16"},
    "fp16": {"avx512_fp16", "asimdhp"},
    "int8": {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"},
}


@dataclass(frozen=True)
class CpuInfo:
    """What the host CPU is; ``performance`` covers the whole host."""

    model: str
    logical_cores: int
    physical_cores: int
    mhz: float | None  # clock used for the estimate; None when cpuinfo states none
    memory_total_bytes: int
    memory_available_bytes: int
    flags: frozenset[str]  # ISA flags, filtered to the capability vocabulary
    capabilities: frozenset[str]  # flags plus the numeric formats they give
    performance: Performance


def probe_cpu(proc_root: str | Path = "/proc", env: Mapping[str, str] = os.environ) -> CpuInfo:
    """Describe the host CPU; a missing /proc file gives zeros, not an exception."""
    root = Path(proc_root)
    processors = _cpuinfo_blocks(_read(root / "cpuinfo"))
    meminfo = _meminfo(_read(root / "meminfo"))
    first = processors[0] if processors else {}
    raw_flags = set((first.get("flags") or first.get("Features") or "").split())
    flags = frozenset(f for f in (_FLAG_ALIASES.get(raw, raw) for raw in raw_flags) if f in CAPABILITIES)
    formats = {fmt for fmt, sources in _FORMAT_FLAGS.items() if raw_flags & sources}
    cores = {(p.get("physical id"), p.get("core id")) for p in processors if "core id" in p}
    physical_cores = len(cores) or len(processors)
    mhz = _clock_mhz(first.get("model name", ""), processors, env)
    total = meminfo.get("MemTotal", 0)

    ghz = (mhz or DEFAULT_CLOCK_GHZ * 1000) / 1000
    _, lanes, fma = next((u for u in _VECTOR_UNITS if u[0] in raw_flags), _SSE2_UNIT)
    fp32_per_cycle = FMA_UNITS_PER_CORE * lanes * (2 if fma else 1)
    peak = {"fp32": fp32_per_cycle, "fp64": fp32_per_cycle / 2}
    for flag, precision, per_cycle in _LOW_PRECISION_UNITS:
        if flag in raw_flags and precision not in peak:
            peak[precision] = per_cycle
    performance = Performance(
        peak_tflops={p: physical_cores * ghz * per_cycle / 1000 for p, per_cycle in peak.items()},
        memory_bytes=total,
        memory_bandwidth_gbps=_env_float(env, MEMORY_BANDWIDTH_ENV, CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE),
        estimated=True,
    )
    return CpuInfo(
        model=_model_name(first),
        logical_cores=len(processors),
        physical_cores=physical_cores,
        mhz=mhz,
        memory_total_bytes=total,
        memory_available_bytes=meminfo.get("MemAvailable", meminfo.get("MemFree", 0)),
        flags=flags,
        capabilities=flags | formats | ({"fp64"} if processors else set()),
        performance=performance,
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    """One dict per logical processor; ARM's trailing summary block has no 'processor' key."""
    blocks = []
    for chunk in text.split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" in fields:
            blocks.append(fields)
    return blocks


def _meminfo(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*(kB)?", line)
        if match:
            values[match[1]] = int(match[2]) * (1024 if match[3] else 1)
    return values


def _clock_mhz(model: str, processors: list[dict[str, str]], env: Mapping[str, str]) -> float | None:
    if env.get(CLOCK_ENV):
        return _env_float(env, CLOCK_ENV, DEFAULT_CLOCK_GHZ) * 1000
    # Intel names its base clock; under sustained vector load cores run near base, whereas
    # "cpu MHz" is a momentary reading that may be an idle or a turbo clock.
    named = re.search(r"@\s*([\d.]+)\s*GHz", model)
    if named:
        return float(named[1]) * 1000
    readings = [float(p["cpu MHz"]) for p in processors if p.get("cpu MHz")]
    return max(readings) if readings else None


def _model_name(first: dict[str, str]) -> str:
    if first.get("model name"):
        return first["model name"]
    if "CPU implementer" in first:
        return f"ARM CPU (implementer {first['CPU implementer']}, part {first.get('CPU part', '?')})"
    return "unknown CPU"


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise InvalidArgument(f"{name}={raw!r} must be a positive number; unset it to use {default}")
    return value
