"""Fuzz benchmark: every method of every mesh process, authenticated, ~1,000 mutated requests each.

    .venv/bin/python bench/fuzz.py [--quick] [--per-method N] [--seed S] [--only PROCESS ...]

Prints one JSON document on stdout (progress on stderr) and exits 1 when the fuzz found
something: an INTERNAL or UNKNOWN status from a service, a process that died or does not answer
health SERVING afterwards, a process whose resident memory after the run is more than 10% above
what it was after the warm-up, a method the fuzz could not call (not in its server's access
table) or calls refused by the access check (the fuzz's credential was wrong, so it tested
nothing). The embedded mesh runs as real processes on loopback with mutual TLS: inventory,
compile, dispatch and one worker emulating a V100 (its credentials made under the temporary data
dir unless ACCELMESH_CREDENTIALS_DIR is set). Each method is called by a caller its server's
access table admits (the operator's token where people may call, else the certificate of a
service role that may), with raw bytes, so the requests reach the handlers. How requests are
mutated and what counts is in fuzzing.py. First a warm-up of 50 calls a method (30 with
--quick; --warmup), then each process's VmRSS, then the run itself, VmRSS again, health. Payloads are
reproducible: call k of a method uses Random("<seed>:<process>.<Method>:<k>"). `--only worker`
(repeatable) fuzzes the methods of the processes named alone, e.g. after a change to one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import fuzzing
import grpc
from common import progress

from accelmesh.embedded import start_embedded_mesh

FULL_PER_METHOD, QUICK_PER_METHOD = 1000, 30
WARMUP_PER_METHOD = 50
EMULATE = ("v100-32gb",)


def machine() -> dict:
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "platform": platform.platform(),
    }


def failures(result: dict) -> list[str]:
    out = []
    if result["finding_count"]:
        out.append(f"{result['finding_count']} INTERNAL/UNKNOWN answers from a service")
    if result["status_lost_count"]:
        out.append(f"{result['status_lost_count']} statuses lost on the way "
                   "(trailers over the client's metadata limit)")
    out += [f"{name} is not healthy: {p['health']} (alive: {p['alive']})"
            for name, p in result["processes"].items() if not p["healthy"]]
    if result["rss_within_10_percent"] is False:
        out.append(f"resident memory grew past 10% (largest ratio {result['max_rss_ratio']})")
    if result["uncovered_methods"]:
        out.append(f"methods nobody may call, so not fuzzed: {', '.join(result['uncovered_methods'])}")
    if result["refused_by_access"]:
        out.append(f"calls refused by the access check (wrong credential): {result['refused_by_access']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PER_METHOD} calls a method: a smoke run")
    parser.add_argument("--per-method", type=int, help=f"calls a method (default {FULL_PER_METHOD})")
    parser.add_argument("--warmup", type=int, help=f"warm-up calls a method before the first RSS "
                        f"(default {WARMUP_PER_METHOD}, at most --per-method)")
    parser.add_argument("--seed", type=int, default=20240601, help="makes the payloads reproducible")
    parser.add_argument("--only", action="append", choices=[a.process for a in fuzzing.AREAS], default=[],
                        help="fuzz only this process's methods (repeatable; default: every process)")
    args = parser.parse_args(argv)
    per_method = args.per_method or (QUICK_PER_METHOD if args.quick else FULL_PER_METHOD)
    warmup = args.warmup if args.warmup is not None else min(WARMUP_PER_METHOD, per_method)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, dispatch, one worker (mutual TLS)")
        with start_embedded_mesh(Path(tmp), devices=2, emulate=EMULATE) as mesh:
            progress(f"fuzzing: {warmup} warm-up calls a method, then {per_method} a method")
            found = fuzzing.fuzz(mesh, per_method, warmup=warmup, seed=args.seed, progress=progress,
                                 only=args.only)
    result = {
        "benchmark": "fuzz",
        "mode": ("quick" if args.quick and not args.per_method
                 else "full" if per_method == FULL_PER_METHOD and not args.only else "custom"),
        "only": args.only or [a.process for a in fuzzing.AREAS],
        "machine": machine(),
        "seed": args.seed,
        "per_method": per_method,
        "warmup_per_method": warmup,
        "deadline_s": fuzzing.DEADLINE_S,
        "stream_idle_s": fuzzing.STREAM_IDLE_S,
        **found,
        "failures": failures(found),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
