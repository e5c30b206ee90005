"""Plain-text tables for the CLI."""

from __future__ import annotations

from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import program_pb2 as program_pb

GIB = 1024**3
SHOWN_CAPABILITIES = ("bf16", "fp16", "tf32", "fp8", "avx512f", "avx512_bf16", "amx_bf16", "avx2")


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_size(n: int) -> str:
    """Bytes in the largest binary unit they reach: 512 B, 1.5 KiB, 8.0 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_devices(devices, jobs: dict[str, list[str]] | None = None) -> str:
    """The device table; `jobs` (device id -> jobs holding a reservation on it) adds a JOBS column."""
    head = ("DEVICE", "TYPE", "KIND", "CAPABILITIES", "FREE/TOTAL GiB", "RESERVED GiB", "UTIL", "TFLOP/s fp32|bf16",
            "HEALTH")
    rows = [head + (("JOBS",) if jobs is not None else ())]
    for d in devices:
        peak = d.performance.peak_tflops
        caps = [c for c in d.capabilities if c in SHOWN_CAPABILITIES]
        lost = d.health == common_pb2.DEVICE_HEALTH_LOST
        row = (
            d.id,
            d.type,
            d.kind,
            ",".join(caps) or "-",
            f"{_gib(d.status.memory_free_bytes)}/{_gib(d.status.memory_total_bytes or d.performance.memory_bytes)}",
            _gib(d.status.memory_reserved_bytes),
            "-" if lost else f"{100 * d.status.utilization:.0f}%",
            f"{peak.get('fp32', 0):.1f}|{peak['bf16']:.1f}" if "bf16" in peak else f"{peak.get('fp32', 0):.1f}|-",
            "LOST" if lost else _tail(common_pb2.DeviceHealth, d.health, "DEVICE_HEALTH_"),
        )
        if jobs is not None:
            row += (",".join(jobs.get(d.id, ())) or "-",)
        rows.append(row)
    return table(rows)


def format_ranking(response) -> str:
    w = response.weights
    lines = [f"weights: compute {w.compute:.2f}  memory {w.memory:.2f}  bandwidth {w.bandwidth:.2f}"]
    for rank, s in enumerate(response.devices, 1):
        c = s.components
        lines.append(
            f"  {rank}. {s.device.id:<22} score {s.score:.3f}  (compute {c.compute:.2f}, memory {c.memory:.2f}, "
            f"bandwidth {c.bandwidth:.2f})  {s.device.type}"
        )
    return "\n".join(lines)


def format_programs(programs) -> str:
    rows = [("PROGRAM", "VERSION", "KIND", "INPUTS", "OUTPUTS", "PARAMETERS")]
    for p in programs:
        rows.append((
            p.name,
            p.version,
            _tail(program_pb.ProgramKind, p.kind, "PROGRAM_KIND_"),
            ", ".join(f"{i.name}{list(i.shape)}" for i in p.inputs),
            ", ".join(f"{o.tensor.name}:{_tail(program_pb.CombineRule, o.combine, 'COMBINE_RULE_')}"
                      for o in p.outputs[:3])
            + (f" +{len(p.outputs) - 3}" if len(p.outputs) > 3 else ""),
            f"{p.parameter_count:,}",
        ))
    return table(rows)


def format_rules(rules) -> str:
    rows = [("#", "RULE", "MATCH", "BUILD")]
    for i, r in enumerate(rules, 1):
        m, b = r.match, r.build
        match = [_tail(common_pb2.Platform, m.platform, "PLATFORM_")] if m.platform else []
        match += [f"+{f}" for f in m.requires] + [f"-{f}" for f in m.forbids]
        if m.max_memory_bytes:
            match.append(f"mem<={m.max_memory_bytes / 1e9:g}GB")
        if m.min_memory_bytes:
            match.append(f"mem>={m.min_memory_bytes / 1e9:g}GB")
        build = [b.compute_dtype, f"matmul={b.matmul_precision}"] + (["remat"] if b.remat else [])
        build += [f"{k}={v}" for k, v in b.xla_options.items()]
        rows.append((str(i), r.name, " ".join(match) or "(any device)", " ".join(build)))
    return table(rows)


def format_builds(builds) -> str:
    rows = [("TARGET TYPE", "RULE", "DTYPE", "DEVICES", "ARTIFACT", "SIZE", "BUILD")]
    for b in builds:
        for a in [b.portable, *b.executables]:
            fmt = "stablehlo" if a.batch_size == 0 else f"executable b={a.batch_size}"
            rows.append((
                b.target_type,
                b.rule.name,
                b.rule.build.compute_dtype,
                ",".join(d.split("/", 1)[1] for d in b.device_ids),
                f"{a.key[:12]} {fmt}",
                f"{a.size_bytes / 1024:.0f} KiB",
                "cached" if a.cache_hit else f"{a.build_seconds * 1000:.0f} ms",
            ))
    return table(rows)


def _tail(enum, value, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()
