"""High-availability benchmark: what losing a control-plane replica costs.

    .venv/bin/python bench/ha.py [--quick] [--repeats N]

Prints one JSON document on stdout (progress on stderr). The mesh is the replica test's
(tests/replicas.py, reused so the benchmark times exactly what tests/e2e/test_replicas.py
asserts): two inventories, two compile services, two dispatchers and two workers on a
PostgreSQL server this run starts (tests/postgres.py; it says so and exits when no server can be
had), every process real, on loopback.

Each repetition:
- runs a transformer job through one dispatcher undisturbed (the baseline, measured in the same
  run, STYLE rule 12), then the same job with that dispatcher SIGKILLed once a quarter of its
  shards finished. Reported: the faulted job's completion time over the baseline's (a ratio);
  the takeover time (kill to the other replica's TAKEN_OVER event) in dispatch leases; how many
  shards were kept; whether the result equals the baseline's.
- builds the job's artifacts afresh (the shared store emptied) undisturbed, then again with the
  compile replica holding the build's lock SIGKILLed: the completion times as a ratio.
- SIGKILLs an inventory replica while both poll a node each. Reported: the gap between the dead
  one's last poll of its node and the survivor's first, in poll intervals (the bound: two).

Compare the ratios across machines, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test harness: postgres.py and replicas.py

from common import progress, ratio  # noqa: E402

from accelmesh.client import MeshClient  # noqa: E402
from accelmesh.dispatch.v1 import job_pb2 as job_pb  # noqa: E402
from accelmesh.embedded import mesh_credentials  # noqa: E402

import postgres  # noqa: E402
from replicas import LEASE_S, POLL_INTERVAL_S, Replicas, seconds  # noqa: E402

PROGRAM = "transformer_encoder"
TOKENS = np.random.default_rng(20240601).integers(0, 512, size=(1024, 32), dtype=np.int32)  # 32 shards


def faulted_run(mesh: Replicas, owner: int) -> dict:
    other = 1 - owner
    started = time.perf_counter()
    with MeshClient(mesh.dispatchers[owner].address, security=mesh.credentials.client()) as client:
        job_id = client.submit(PROGRAM, {"tokens": TOKENS})
        finished = 0
        for event in client.watch(job_id):
            finished += event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED
            if finished >= 8:
                break
    killed_at = time.time()
    mesh.dispatchers[owner].kill()
    with MeshClient(mesh.dispatchers[other].address, security=mesh.credentials.client()) as client:
        events = list(client.watch(job_id))
        job = client.get(job_id)
        logits = client.fetch_result(job_id)["logits"] if job.state == job_pb.JOB_STATE_SUCCEEDED else None
    wall = time.perf_counter() - started
    taken = next((e for e in events if e.type == job_pb.JOB_EVENT_TYPE_TAKEN_OVER), None)
    mesh.restart("dispatchers", owner)
    return {"succeeded": job.state == job_pb.JOB_STATE_SUCCEEDED, "wall_s": wall, "logits": logits,
            "takeover_s": seconds(taken.time) - killed_at if taken else None,
            "kept": int(taken.message.split(" of ")[0].rsplit(" ", 1)[1]) if taken else 0,
            "left_reserved": len(mesh.reservations_of(job_id))}


def compile_killed(mesh: Replicas, index: int, expected: np.ndarray) -> dict:
    """The job with its artifacts built afresh, undisturbed, then with the building compile replica
    SIGKILLed: completion times as a ratio."""
    with MeshClient(mesh.dispatchers[index].address, security=mesh.credentials.client()) as client:
        mesh.clear_artifacts()
        started = time.perf_counter()
        client.run(PROGRAM, {"tokens": TOKENS})
        fresh_s = time.perf_counter() - started
        mesh.clear_artifacts()
        started = time.perf_counter()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.run, PROGRAM, {"tokens": TOKENS})
            victim = mesh.kill_the_builder()
            job = running.result(timeout=300)
        killed_s = time.perf_counter() - started
    mesh.restart("compiles", victim)
    return {"fresh_build_s": round(fresh_s, 3), "killed_mid_build_s": round(killed_s, 3),
            "completion_ratio": ratio(killed_s, fresh_s), "succeeded": job.job.state == job_pb.JOB_STATE_SUCCEEDED,
            "result_equals_baseline": bool(np.array_equal(job.outputs["logits"], expected))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    binaries = postgres.find_binaries()
    if binaries is None:
        print(json.dumps({"benchmark": "ha", "skipped": postgres.HOW_TO_ENABLE}))
        return
    server = postgres.PostgresServer(binaries)
    data_dir = Path(tempfile.mkdtemp(prefix="accelmesh-bench-ha-"))
    credentials = mesh_credentials(data_dir)
    progress("starting 2 inventories, 2 compile services, 2 workers and 2 dispatchers on one PostgreSQL")
    mesh = Replicas(data_dir, credentials, server.database(), server.database())
    try:
        dispatch, inventory, compiles = [], [], []
        for repeat in range(repeats):
            owner = repeat % 2
            started = time.perf_counter()
            with MeshClient(mesh.dispatchers[owner].address, security=credentials.client()) as client:
                baseline = client.run(PROGRAM, {"tokens": TOKENS}).outputs["logits"]
            baseline_s = time.perf_counter() - started
            run = faulted_run(mesh, owner)
            dispatch.append({"baseline_s": round(baseline_s, 3), "faulted_s": round(run["wall_s"], 3),
                             "completion_ratio": ratio(run["wall_s"], baseline_s),
                             "takeover_s": round(run["takeover_s"], 3) if run["takeover_s"] is not None else None,
                             "takeover_leases": ratio(run["takeover_s"], LEASE_S) if run["takeover_s"] else None,
                             "shards_kept": run["kept"], "succeeded": run["succeeded"],
                             "result_equals_baseline": run["logits"] is not None
                             and bool(np.array_equal(run["logits"], baseline)),
                             "reservations_left": run["left_reserved"]})
            progress(f"dispatch {repeat + 1}/{repeats}: {dispatch[-1]}")
            compile_run = compile_killed(mesh, owner, baseline)
            progress(f"compile {repeat + 1}/{repeats}: {compile_run}")
            compiles.append(compile_run)
            gap = mesh.kill_an_inventory(owner)
            mesh.restart("inventories", owner)
            inventory.append({"gap_s": round(gap, 3), "gap_intervals": ratio(gap, POLL_INTERVAL_S)})
            progress(f"inventory {repeat + 1}/{repeats}: {inventory[-1]}")
    finally:
        mesh.stop()
        server.stop()
    print(json.dumps({
        "benchmark": "ha", "machine": platform.machine(), "python": platform.python_version(),
        "repeats": repeats, "dispatch_lease_s": LEASE_S, "poll_interval_s": POLL_INTERVAL_S,
        "dispatch_replica_killed": {
            "runs": dispatch,
            "succeeded": sum(r["succeeded"] and r["result_equals_baseline"] and not r["reservations_left"]
                             for r in dispatch),
            "worst_takeover_leases": max((r["takeover_leases"] or 0) for r in dispatch),
            "median_completion_ratio": float(np.median([r["completion_ratio"] for r in dispatch])),
        },
        "compile_replica_killed_mid_build": {
            "runs": compiles,
            "succeeded": sum(r["succeeded"] and r["result_equals_baseline"] for r in compiles),
            "median_completion_ratio": float(np.median([r["completion_ratio"] for r in compiles])),
        },
        "inventory_replica_killed": {
            "runs": inventory,
            "worst_gap_intervals": max(r["gap_intervals"] for r in inventory),
            "bound_intervals": 2.0,
        },
    }, indent=2))


if __name__ == "__main__":
    main()
