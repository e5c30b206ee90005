"""Compile benchmark: what the compile service adds to a cold XLA compile, and what a cache hit costs.

    .venv/bin/python bench/compile.py [--quick]

Prints one JSON document on stdout (progress on stderr). Every time is paired with a baseline
measured in the same run (STYLE rule 12):

- cold_compile: one Compile RPC through a real in-process compile server (built afresh, with an
  empty cache directory, for every repetition) for one emulated device that executes on the
  local CPU, asking for one executable at BATCH, against `jax.jit(f).lower(*arrays).compile(opts)`
  of the same rule-applied function with the same XLA options. Both arms run cold: JAX's
  in-memory caches are cleared before every repetition and the persistent compilation cache is
  off. The arms alternate so drift on a shared machine hits both.
- cache_hit: a Compile RPC answered from the cache, and FetchArtifact of a ~1 MB executable on
  loopback, against the gRPC floor (a ListRules round trip) and the in-process calls.
- compilations_per_type: builds on a fresh cache for 6 emulated devices of 2 types.
- security: the servers above run mutual TLS with the operator's bearer token, as in production;
  cache_hit and fetch_artifact are measured on a second server started insecure (plaintext, no
  authentication) held open beside the TLS one, in alternating blocks, and set TLS beside
  plaintext with their ratio (summary.security_cost). Cold compiles, seconds of XLA, are not.

The "bigger" program is the built-in transformer encoder's layers with more blocks, registered
in the benchmark's server only; its executable (~1 MB) is also the artifact FetchArtifact moves,
since no built-in program compiles to one that large.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jax
import jaxlib
import numpy as np
from common import percentile, progress, ratio, summary_ms, time_calls, tls_vs_plaintext
from jax.experimental import serialize_executable

from accelmesh import artifacts
from accelmesh.compile.v1 import compile_service_pb2 as pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.hardware.catalog import resolve_type
from accelmesh.programs import OutputSpec, Program, TensorSpec
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_to_proto
from accelmesh.security.config import INSECURE
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role
from compile_svc import lowering
from compile_svc.compiler import Compiler
from compile_svc.config import CompileConfig
from compile_svc.programs import default_registry, network, program_digest, pytrees, transformer
from compile_svc.programs.network import Layer, Network
from compile_svc.rules import load_rules
from compile_svc.server import build_compile_service

TARGET_TYPE = "v100-32gb"  # no bf16 -> rule cuda-fp32; emulated, so it executes on the local CPU
EMULATED_ON = "cpu:0"
BATCH = 64
GOAL_RATIO = 1.15  # service / baseline, cold
FETCH_GOAL_MS = 5.0
BIG_BLOCKS = 26  # transformer blocks of the bigger program: ~1 MB executable at BATCH
PER_TYPE = (("a100-80gb", 3), ("v100-32gb", 3))
RPC_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Plan:
    small_reps: int  # cold repetitions per arm for the built-in programs
    big_reps: int  # cold repetitions per arm for the bigger program
    hit_calls: int
    fetch_calls: int
    floor_calls: int
    warmup: int


FULL = Plan(small_reps=11, big_reps=5, hit_calls=200, fetch_calls=200, floor_calls=300, warmup=5)
QUICK = Plan(small_reps=3, big_reps=1, hit_calls=30, fetch_calls=30, floor_calls=30, warmup=2)






def summary_min_ms(values: list[float]) -> dict:
    return {**summary_ms(values), "min_ms": round(min(values), 3)}


def summary_s(values: list[float]) -> dict:
    return {"p50_s": round(percentile(values, 50), 4), "min_s": round(min(values), 4),
            "max_s": round(max(values), 4), "n": len(values)}






# -- programs ------------------------------------------------------------------------------------


def bigger_transformer(blocks: int = BIG_BLOCKS) -> Program:
    """transformer_encoder's layers with `blocks` blocks instead of 4 (registered by this bench only)."""
    layers = [Layer(f"block_{i}", "transformer_block", transformer._block_init, transformer._block)
              for i in range(blocks)]
    net = Network([Layer("embed", "embedding", transformer._embed_init, transformer._embed), *layers,
                   Layer("head", "classifier_head", transformer._head_init, transformer._head)])

    def fn(*args: Any) -> tuple[jax.Array]:
        *leaves, tokens = args
        return (net.apply(leaves, tokens),)

    name, version = f"bench_transformer_{blocks}_blocks", "1"
    inputs = (TensorSpec("tokens", "int32", (None, transformer.SEQ_LEN)),)
    outputs = (OutputSpec("logits", "float32", (None, transformer.CLASSES), "concat"),)
    return Program(
        name=name, version=version, kind="model",
        description=f"bench only: transformer_encoder with {blocks} blocks",
        parameters=net.parameters, inputs=inputs, outputs=outputs,
        digest=program_digest(name, version, "model", net.parameters, inputs, outputs,
                              (fn, transformer, network, pytrees)),
        fn=fn, init_params=net.init_params,
    )


def concrete_args(program: Program, batch: int, device: jax.Device) -> list[jax.Array]:
    """Real arrays on the device: the initial parameters and zero data inputs at `batch`."""
    params = program.init_params(0) if program.init_params else []
    data = [np.zeros(tuple(batch if i == 0 and s.batched else d for i, d in enumerate(s.shape)), s.dtype)
            for s in program.inputs]
    return [jax.device_put(a, device) for a in (*params, *data)]


# -- servers -------------------------------------------------------------------------------------


@dataclass
class Timings:
    """What the server spent inside one Compile: filled by wrappers on the Compiler instance."""

    server_s: float = 0.0
    cache_put_s: float = 0.0


@contextmanager
def compile_server(workdir: Path, extra: tuple[Program, ...] = (),
                   secure: bool = True) -> Iterator[tuple[Any, Compiler, Timings]]:
    """A real compile server on loopback port 0 with an empty cache; connected before it yields.
    Mutual TLS as in production, from the run's throwaway CA; the stub calls as the local operator.
    `secure=False`: plaintext without authentication (--insecure), for the security comparison."""
    root = Path(tempfile.mkdtemp(prefix="svc-", dir=workdir))
    credentials = MeshCredentials(workdir / "credentials") if secure else None  # made on first use, kept for the run
    config = CompileConfig(listen="127.0.0.1:0", cache_dir=str(root / "artifacts"), programs_dir=str(root / "programs"),
                           security=credentials.service(Role.COMPILE) if secure else INSECURE)
    server, compiler = build_compile_service(config)
    for program in extra:
        compiler.registry.register(program)
    timings = Timings()
    instrument(compiler, timings)
    server.start()
    channel = open_channel(f"127.0.0.1:{server.port}", security=credentials.client() if secure else INSECURE)
    try:
        stub = compile_service_pb2_grpc.CompileServiceStub(channel)
        stub.ListRules(pb.ListRulesRequest(), timeout=RPC_TIMEOUT_S)  # connect outside any timing
        yield stub, compiler, timings
    finally:
        channel.close()
        server.stop(0)
        shutil.rmtree(root, ignore_errors=True)


def instrument(compiler: Compiler, timings: Timings) -> None:
    """Time Compiler.compile and every cache write of this instance (the servicer calls both)."""
    compile_call, put = compiler.compile, compiler.cache.put

    def timed_compile(*args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_call(*args, **kwargs)
        finally:
            timings.server_s += time.perf_counter() - start

    def timed_put(*args, **kwargs):
        start = time.perf_counter()
        try:
            return put(*args, **kwargs)
        finally:
            timings.cache_put_s += time.perf_counter() - start

    compiler.compile = timed_compile
    compiler.cache.put = timed_put


def target_device(type_name: str = TARGET_TYPE, index: int = 0, emulated_on: str = EMULATED_ON):
    return resolve_type(type_name).device_spec("127.0.0.1", index, emulated_on=emulated_on)


# -- cold compile --------------------------------------------------------------------------------


def service_rep(workdir: Path, program: Program, extra: tuple[Program, ...]) -> dict:
    request = pb.CompileRequest(program=program.name, version=program.version,
                                targets=[device_to_proto(target_device())], batch_sizes=[BATCH])
    with compile_server(workdir, extra) as (stub, compiler, timings):
        jax.clear_caches()
        start = time.perf_counter()
        response = stub.Compile(request, timeout=RPC_TIMEOUT_S)
        client_s = time.perf_counter() - start
        builds = compiler.cache.builds
    (build,) = response.builds
    (executable,) = build.executables
    if build.portable.cache_hit or executable.cache_hit or builds != 2:
        raise AssertionError(f"{program.name}: a cold Compile hit the cache ({builds} builds)")
    return {
        "client_s": client_s,
        "server_s": timings.server_s,
        "grpc_s": client_s - timings.server_s,
        "cache_write_s": timings.cache_put_s,
        "export_s": build.portable.build_seconds,
        "executable_build_s": executable.build_seconds,
        "rule": build.rule.name,
        "target_type": build.target_type,
        "portable_bytes": build.portable.size_bytes,
        "executable_bytes": executable.size_bytes,
    }


def baseline_rep(program: Program, options, args: list[jax.Array], device: jax.Device) -> dict:
    fn = lowering.apply_build_options(program, options)
    xla_options = artifacts.xla_compiler_options(options)
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options=xla_options)
    compiled_at = time.perf_counter()
    # Not part of the baseline: what turning this executable into an artifact costs, done the
    # way lowering.compile_executable does it.
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    header = {"schema": 1, "jaxlib": jaxlib.__version__, "platform": device.platform, "xla_options": xla_options}
    blob = pickle.dumps((header, payload, in_tree, out_tree))
    serialized_at = time.perf_counter()
    return {"total_s": compiled_at - start, "lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
            "serialize_s": serialized_at - compiled_at, "executable_bytes": len(blob)}


def bench_cold(workdir: Path, program: Program, reps: int, extra: tuple[Program, ...]) -> dict:
    device = jax.devices("cpu")[0]
    rule = load_rules().match(target_device())
    args = concrete_args(program, BATCH, device)
    service, baseline = [], []
    for rep in range(reps):
        # Alternate which arm goes first so slow drift on a shared machine hits both alike.
        if rep % 2 == 0:
            baseline.append(baseline_rep(program, rule.build, args, device))
            service.append(service_rep(workdir, program, extra))
        else:
            service.append(service_rep(workdir, program, extra))
            baseline.append(baseline_rep(program, rule.build, args, device))
        progress(f"cold {program.name} rep {rep + 1}/{reps}: service {service[-1]['client_s']:.3f} s, "
                 f"baseline {baseline[-1]['total_s']:.3f} s")
    if {s["rule"] for s in service} != {rule.name}:
        raise AssertionError(f"service used rules {[s['rule'] for s in service]}, baseline {rule.name}")

    def p50_ms(rows: list[dict], field: str) -> float:
        return round(1e3 * percentile([r[field] for r in rows], 50), 2)

    service_p50 = percentile([s["client_s"] for s in service], 50)
    baseline_p50 = percentile([b["total_s"] for b in baseline], 50)
    return {
        "program": program.ref,
        "rule": rule.name,
        "target_type": service[0]["target_type"],
        "batch_size": BATCH,
        "service": summary_s([s["client_s"] for s in service]),
        "baseline": summary_s([b["total_s"] for b in baseline]),
        "ratio_service_over_baseline_p50": ratio(service_p50, baseline_p50),
        "ratio_goal": GOAL_RATIO,
        "meets_goal": service_p50 <= GOAL_RATIO * baseline_p50,
        "artifact_bytes": {"portable": service[0]["portable_bytes"], "executable": service[0]["executable_bytes"]},
        # p50 of each part over the repetitions. Service parts: export and executable build
        # (trace + lower + XLA compile + serialize) are each artifact's build time as the
        # Compile response reports it; when they run concurrently they overlap, so the parts
        # do not add up to server_ms. grpc_ms is the client's wall time minus the server's.
        "breakdown_p50_ms": {
            "service": {
                "client_total": p50_ms(service, "client_s"),
                "server_compile_call": p50_ms(service, "server_s"),
                "portable_export": p50_ms(service, "export_s"),
                "executable_build": p50_ms(service, "executable_build_s"),
                "cache_write": p50_ms(service, "cache_write_s"),
                "grpc": p50_ms(service, "grpc_s"),
            },
            "baseline": {
                "total": p50_ms(baseline, "total_s"),
                "trace_and_lower": p50_ms(baseline, "lower_s"),
                "xla_compile": p50_ms(baseline, "compile_s"),
            },
            "serialize_executable": p50_ms(baseline, "serialize_s"),
        },
    }


# -- cache hits and fetches ----------------------------------------------------------------------


def fetch(stub, key: str) -> bytes:
    parts = list(stub.FetchArtifact(pb.FetchArtifactRequest(key=key), timeout=RPC_TIMEOUT_S))
    data = b"".join(p.chunk for p in parts)
    if len(data) != parts[0].total_bytes:
        raise AssertionError(f"fetched {len(data)} of {parts[0].total_bytes} bytes")
    return data


def compile_request(program: Program) -> pb.CompileRequest:
    return pb.CompileRequest(program=program.name, version=program.version,
                             targets=[device_to_proto(target_device())], batch_sizes=[BATCH])


def time_service(stub, compiler: Compiler, program: Program, key: str, plan: Plan, share: float) -> dict:
    """One block of every timed call on one server: the gRPC floor (ListRules), a Compile answered from
    the cache, FetchArtifact of `key`, and the in-process calls behind the last two; `share` of the
    plan's calls each. Seconds lists by name."""
    request = compile_request(program)
    spec = target_device()

    def hit() -> None:
        response = stub.Compile(request, timeout=RPC_TIMEOUT_S)
        (b,) = response.builds
        if not (b.portable.cache_hit and all(e.cache_hit for e in b.executables)):
            raise AssertionError("a repeated Compile missed the cache")

    def calls(n: int) -> int:
        return max(1, round(n * share))

    builds_before = compiler.cache.builds
    times = {
        "floor": time_calls(lambda: stub.ListRules(pb.ListRulesRequest(), timeout=RPC_TIMEOUT_S),
                            calls(plan.floor_calls), plan.warmup),
        "hit": time_calls(hit, calls(plan.hit_calls), plan.warmup),
        "in_process_hit": time_calls(lambda: compiler.compile(program.name, program.version, [spec],
                                                              batch_sizes=[BATCH]), calls(plan.hit_calls), plan.warmup),
        "fetch": time_calls(lambda: fetch(stub, key), calls(plan.fetch_calls), plan.warmup),
        "in_process_fetch": time_calls(lambda: compiler.fetch(key), calls(plan.fetch_calls), plan.warmup),
    }
    if compiler.cache.builds != builds_before:
        raise AssertionError("cache hits built something")
    return times


def bench_hits(workdir: Path, program: Program, plan: Plan) -> dict[str, tuple[dict, dict]]:
    """(cache_hit, fetch_artifact) by server: "tls" as in production, and "plaintext", a second server
    without security held open beside it. The calls run in blocks of half the plan's calls, in the
    order TLS, plaintext, plaintext, TLS, so drift on a shared machine hits both alike."""
    servers = {"tls": True, "plaintext": False}
    with ExitStack() as stack:
        opened = {label: stack.enter_context(compile_server(workdir, (program,), secure=secure))
                  for label, secure in servers.items()}
        built = {}
        for label, (stub, _, _) in opened.items():
            (build,) = stub.Compile(compile_request(program), timeout=RPC_TIMEOUT_S).builds
            (executable,) = build.executables
            data = fetch(stub, executable.key)
            if len(data) != executable.size_bytes:
                raise AssertionError("fetched artifact size differs from the Compile response")
            built[label] = (build, executable, data)
            progress(f"cache ({label}): built {program.name}, executable {executable.size_bytes} bytes")
        times: dict[str, dict[str, list[float]]] = {label: {} for label in servers}
        for block, order in enumerate((list(servers), list(servers)[::-1])):
            for label in order:
                stub, compiler, _ = opened[label]
                for name, values in time_service(stub, compiler, program, built[label][1].key, plan, 0.5).items():
                    times[label].setdefault(name, []).extend(values)
            progress(f"cache: Compile hits and FetchArtifact, block {block + 1}/2 done")
    return {label: hit_records(program, *built[label], times[label]) for label in servers}


def hit_records(program: Program, build, executable, data: bytes, times: dict[str, list[float]]) -> tuple[dict, dict]:
    floor_p50 = percentile(times["floor"], 50)
    hit_p50, fetch_p50 = percentile(times["hit"], 50), percentile(times["fetch"], 50)
    cache_hit = {
        "program": program.ref,
        "batch_sizes": [BATCH],
        "artifacts_per_call": 1 + len(build.executables),
        "bytes_read_per_call": build.portable.size_bytes + executable.size_bytes,
        "grpc": summary_min_ms(times["hit"]),
        "in_process": summary_min_ms(times["in_process_hit"]),
        "grpc_floor_list_rules": summary_min_ms(times["floor"]),
        "ratio_grpc_over_in_process_p50": ratio(hit_p50, percentile(times["in_process_hit"], 50)),
        "ratio_grpc_over_floor_p50": ratio(hit_p50, floor_p50),
    }
    fetch_result = {
        "artifact": f"executable of {program.ref} at batch {BATCH} (bench-registered program, see docstring)",
        "artifact_bytes": len(data),
        "chunk_bytes": "server default",
        "grpc": summary_min_ms(times["fetch"]),
        "in_process_cache_read": summary_min_ms(times["in_process_fetch"]),
        "ratio_grpc_over_in_process_p50": ratio(fetch_p50, percentile(times["in_process_fetch"], 50)),
        "ratio_grpc_over_floor_p50": ratio(fetch_p50, floor_p50),
        "throughput_mb_per_s_p50": round(len(data) / 1e6 / (fetch_p50 / 1e3), 1),
        "goal_ms": FETCH_GOAL_MS,
        "meets_goal": fetch_p50 < FETCH_GOAL_MS,
    }
    return cache_hit, fetch_result


def security_section(hits: dict[str, tuple[dict, dict]]) -> dict:
    """What mutual TLS + bearer tokens cost on the service path: each figure TLS beside plaintext."""
    (tls_hit, tls_fetch), (plain_hit, plain_fetch) = hits["tls"], hits["plaintext"]
    return {
        "how": "cache_hit and fetch_artifact measured on two compile servers open side by side, one with mutual "
               "TLS + the operator's bearer token (as above), one started insecure (plaintext, no authentication); "
               "blocks of half the calls each, in the order TLS, plaintext, plaintext, TLS",
        "list_rules_floor_p50_ms": tls_vs_plaintext(tls_hit["grpc_floor_list_rules"]["p50_ms"],
                                                    plain_hit["grpc_floor_list_rules"]["p50_ms"]),
        "cached_compile_p50_ms": tls_vs_plaintext(tls_hit["grpc"]["p50_ms"], plain_hit["grpc"]["p50_ms"]),
        "fetch_artifact_p50_ms": tls_vs_plaintext(tls_fetch["grpc"]["p50_ms"], plain_fetch["grpc"]["p50_ms"]),
        "fetch_artifact_mb_per_s_p50": tls_vs_plaintext(tls_fetch["throughput_mb_per_s_p50"],
                                                        plain_fetch["throughput_mb_per_s_p50"]),
        "fetch_artifact_bytes": tls_fetch["artifact_bytes"],
        "plaintext": {"cache_hit": plain_hit, "fetch_artifact": plain_fetch},
    }


# -- builds per target type ----------------------------------------------------------------------


def bench_per_type(workdir: Path) -> dict:
    targets, slot = [], 0
    for type_name, count in PER_TYPE:
        for _ in range(count):
            targets.append(device_to_proto(target_device(type_name, slot, f"cpu:{slot}")))
            slot += 1
    with compile_server(workdir) as (stub, compiler, _):
        jax.clear_caches()
        response = stub.Compile(pb.CompileRequest(program="mlp_classifier", targets=targets), timeout=RPC_TIMEOUT_S)
        builds = compiler.cache.builds
    types = len(response.builds)
    return {
        "program": "mlp_classifier",
        "devices": len(targets),
        "devices_by_type": {name: count for name, count in PER_TYPE},
        "batch_sizes": [],
        "cache_builds": builds,
        "target_types": types,
        "builds_per_type": ratio(builds, types),
        "per_build": [{"target_type": b.target_type, "rule": b.rule.name, "devices": len(b.device_ids),
                       "cache_hit": b.portable.cache_hit} for b in response.builds],
        "ok": builds == types == len(PER_TYPE),
    }


# -- main ----------------------------------------------------------------------------------------


def machine() -> dict:
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": len(jax.devices()),
        "grpc": grpc.__version__,
        "platform": platform.platform(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    # Cold means cold: no persistent compilation cache, in-memory caches cleared per repetition.
    jax.config.update("jax_enable_compilation_cache", False)
    machine_info = machine()
    started = time.perf_counter()
    big = bigger_transformer()
    registry = default_registry()
    programs = [(registry.get("mlp_classifier"), plan.small_reps),
                (registry.get("transformer_encoder"), plan.small_reps), (big, plan.big_reps)]
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-compile-") as tmp:
        workdir = Path(tmp)
        progress("warming up (one untimed run of each arm)")
        device = jax.devices("cpu")[0]
        warm = registry.get("mlp_classifier")
        baseline_rep(warm, load_rules().match(target_device()).build, concrete_args(warm, BATCH, device), device)
        service_rep(workdir, warm, ())
        cold = {program.name: bench_cold(workdir, program, reps, (big,)) for program, reps in programs}
        hits = bench_hits(workdir, big, plan)
        cache_hit, fetch_artifact = hits["tls"]
        per_type = bench_per_type(workdir)
    spec = target_device()
    result = {
        "benchmark": "compile",
        "mode": "quick" if args.quick else "full",
        "machine": machine_info,
        "setup": {
            "target": {"type": TARGET_TYPE, "device_id": spec.id, "platform": spec.platform,
                       "execution_platform": spec.execution_platform, "emulated_on": EMULATED_ON},
            "batch_size": BATCH,
            "persistent_compilation_cache": bool(jax.config.jax_enable_compilation_cache),
            "in_memory_caches": "jax.clear_caches() before every cold repetition of either arm",
            "service_arm": "Compile RPC to a fresh in-process server with an empty cache dir per repetition",
            "baseline_arm": "jax.jit(apply_build_options(program, rule.build)).lower(*arrays)"
                            ".compile(rule XLA options)",
            "bigger_program": f"{big.ref}: transformer_encoder layers with {BIG_BLOCKS} blocks, "
                              "registered by the bench",
            "notes": [
                "the service must also build the portable StableHLO export, which the baseline does not; it "
                "overlaps the executable's XLA compile, so it is hidden only when it is shorter than that compile "
                "(compare breakdown portable_export with baseline xla_compile)",
                "XLA's CPU compile keeps more than one core busy, so on a 2-core machine the export still slows it",
            ],
        },
        "cold_compile": cold,
        "cache_hit": cache_hit,
        "fetch_artifact": fetch_artifact,
        "compilations_per_type": per_type,
        "security": security_section(hits),
    }
    security = result["security"]
    result["summary"] = {"security_cost": {name: security[name] for name in (
        "list_rules_floor_p50_ms", "cached_compile_p50_ms", "fetch_artifact_p50_ms", "fetch_artifact_mb_per_s_p50")}}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
