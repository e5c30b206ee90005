"""Fault benchmark: what losing a worker half-way through a job costs.

    .venv/bin/python bench/faults.py [--quick]

Prints one JSON document on stdout (progress on stderr). A real mesh on loopback: the inventory
(polling every 0.25 s, a node lost after 2 missed polls), the compile service, the dispatcher and
two workers on their own loopback addresses (127.0.0.2, 127.0.0.3), each emulating two V100s.
Each repetition runs the same transformer job twice: once undisturbed (the baseline, measured in
the same run, STYLE rule 12) and once with one worker SIGKILLed when half of the job's shards have
finished. Reported: the faulted job's completion time over the baseline's (a ratio), and, from the
job's own event timestamps, how long after the kill the dispatcher noticed (the first
SHARD_RETRIED) and the first retried shard started on a surviving device (the first SHARD_STARTED
with attempts > 1). The killed worker is restarted on its address between repetitions.

On this machine every emulated device shares the same CPU cores, so losing half of them costs
less than half the pool's speed; compare the ratios across machines, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import (
    EmbeddedMesh,
    mesh_credentials,
    start_compile,
    start_dispatch,
    start_inventory,
    start_worker,
)
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role

NODE_IPS = ("127.0.0.2", "127.0.0.3")
EMULATE = ("v100-32gb", "v100-32gb")  # fp32: a retried shard's result is the same on any device
POLL_INTERVAL_S = 0.25
LOST_AFTER = 2
SHARD_BYTES = 4096  # 32 token rows a shard: many shards, each ~0.1 s on a laptop core
PROGRAM = "transformer_encoder"
SEED = 20240601
WATCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Plan:
    rows: int  # token sequences a job
    repetitions: int


FULL = Plan(rows=2048, repetitions=5)
QUICK = Plan(rows=512, repetitions=1)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def seconds(stamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was really measured."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summary(values: list[float], unit: str = "s", digits: int = 3) -> dict:
    return {f"p50_{unit}": round(percentile(values, 50), digits), f"max_{unit}": round(max(values), digits),
            f"min_{unit}": round(min(values), digits), "n": len(values)}


def start_node(mesh: EmbeddedMesh, ip: str, port: int | str = 0):
    """A worker on `ip` with a certificate naming it: the inventory registers only a node its
    worker's certificate names."""
    tls = mesh.credentials.issue(Role.WORKER, f"node-{ip}", [ip]).tls
    return start_worker(mesh.inventory.address, mesh.compile.address, mesh.credentials, devices=len(EMULATE),
                        emulate=EMULATE, listen=f"{ip}:{port}", artifact_dir=mesh.data_dir / "worker-artifacts",
                        name=f"worker-{ip}",
                        env={"ACCELMESH_CERT_FILE": str(tls.cert_file), "ACCELMESH_KEY_FILE": str(tls.key_file)})


def start_mesh(data_dir: Path) -> EmbeddedMesh:
    """The mesh with mutual TLS as in production, from a throwaway CA under `data_dir`."""
    credentials = mesh_credentials(data_dir)
    inventory = start_inventory(data_dir, credentials, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=LOST_AFTER)
    mesh = EmbeddedMesh(data_dir, inventory, credentials)
    try:
        mesh.compile = start_compile(data_dir, credentials)
        mesh.workers = [start_node(mesh, ip) for ip in NODE_IPS]
        mesh.dispatch = start_dispatch(data_dir, inventory.address, mesh.compile.address, credentials,
                                       env={"ACCELMESH_MAX_SHARD_BYTES": str(SHARD_BYTES)})
    except BaseException:
        mesh.stop()
        raise
    return mesh


def run_job(client: MeshClient, tokens: np.ndarray, on_event=None) -> tuple[float, job_pb.Job, list]:
    started = time.perf_counter()
    result = client.run(PROGRAM, {"tokens": tokens}, on_event=on_event)
    return time.perf_counter() - started, result.job, result.events


class LossWatch:
    """Records when the inventory reports `ip`'s devices lost, from a WatchDevices stream opened
    before the kill (so a loss that comes before anyone asks is not missed)."""

    def __init__(self, mesh: EmbeddedMesh, ip: str):
        self._channel = open_channel(mesh.inventory.address, security=mesh.client)
        stub = inventory_service_pb2_grpc.InventoryServiceStub(self._channel)
        self._stream = stub.WatchDevices(inv_pb.WatchDevicesRequest(include_existing=True), timeout=WATCH_TIMEOUT_S)
        self._ip = ip
        self._lost: dict[str, float] = {}
        self._subscribed, self._done = threading.Event(), threading.Event()
        threading.Thread(target=self._follow, name="loss-watch", daemon=True).start()
        self._subscribed.wait(WATCH_TIMEOUT_S)

    def _follow(self) -> None:
        try:
            for event in self._stream:
                if event.type == inv_pb.DEVICE_EVENT_TYPE_EXISTING:
                    self._subscribed.set()  # the first EXISTING event comes after the subscription
                elif event.type == inv_pb.DEVICE_EVENT_TYPE_LOST and event.device.id.startswith(f"{self._ip}/"):
                    self._lost[event.device.id] = seconds(event.event_time)
                    if len(self._lost) == len(EMULATE):
                        self._done.set()
                        return
        except grpc.RpcError:
            pass
        finally:
            self._subscribed.set()

    def lost_at(self) -> float:
        """The inventory's time of the last of the node's devices to be reported lost."""
        if not self._done.wait(WATCH_TIMEOUT_S):
            raise RuntimeError(f"the inventory never reported {self._ip} lost")
        self._stream.cancel()
        self._channel.close()
        return max(self._lost.values())


def faulted_run(mesh: EmbeddedMesh, client: MeshClient, tokens: np.ndarray, victim: int) -> dict:
    ip, process = NODE_IPS[victim], mesh.workers[victim]
    state = {"shards": 0, "finished": 0, "killed_at": None}

    def on_event(event):
        if event.type == job_pb.JOB_EVENT_TYPE_PLANNED:
            state["shards"] = len(event.plan.shards)
        elif event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED:
            state["finished"] += 1
            if state["killed_at"] is None and 2 * state["finished"] >= state["shards"]:
                state["killed_at"] = time.time()
                process.kill()

    watch = LossWatch(mesh, ip)
    wall_s, job, events = run_job(client, tokens, on_event)
    killed_at = state["killed_at"]
    if killed_at is None or job.state != job_pb.JOB_STATE_SUCCEEDED:
        raise RuntimeError(f"the faulted job did not run as planned: state {job.state}, killed {killed_at}")
    retried = [seconds(e.time) for e in events if e.type == job_pb.JOB_EVENT_TYPE_SHARD_RETRIED]
    restarted = [seconds(e.time) for e in events
                 if e.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED and e.shard.attempts > 1]
    lost_at = watch.lost_at()
    mesh.workers[victim] = start_node(mesh, ip, process.address.rsplit(":", 1)[1])
    return {
        "wall_s": wall_s,
        "kill_to_first_retry_event_s": min(retried) - killed_at,
        "kill_to_retried_shard_start_s": min(restarted) - killed_at,
        "kill_to_lost_s": lost_at - killed_at,
        "retried_shards": sum(s.attempts > 1 for s in job.shards),
        "shards": len(job.shards),
        "after_kill_s": seconds(job.end_time) - killed_at,
    }


def machine() -> dict:
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small repetition: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    tokens = np.random.default_rng(SEED).integers(0, 512, size=(plan.rows, 32), dtype=np.int32)
    baseline, faulted = [], []
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, dispatch, workers on " + ", ".join(NODE_IPS))
        with start_mesh(Path(tmp)) as mesh, MeshClient(mesh.dispatch.address, security=mesh.client) as client:
            run_job(client, tokens)  # warm: artifacts built, executables loaded, rates measured
            reference = client.run(PROGRAM, {"tokens": tokens}).outputs["logits"]
            for rep in range(plan.repetitions):
                baseline.append(run_job(client, tokens)[0])
                faulted.append(faulted_run(mesh, client, tokens, victim=rep % 2))
                progress(f"repetition {rep + 1}/{plan.repetitions}: no fault {baseline[-1]:.2f} s, "
                         f"worker killed at 50% {faulted[-1]['wall_s']:.2f} s, retried shard started "
                         f"{faulted[-1]['kill_to_retried_shard_start_s'] * 1000:.0f} ms after the kill")
            check = client.run(PROGRAM, {"tokens": tokens}).outputs["logits"]
            if not np.array_equal(check, reference):
                raise RuntimeError("a job after the faults gave a different result")
    base_p50 = percentile(baseline, 50)
    fault_p50 = percentile([f["wall_s"] for f in faulted], 50)
    result = {
        "benchmark": "faults",
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
        "job": {"program": PROGRAM, "rows": plan.rows, "shard_rows": SHARD_BYTES // (32 * 4),
                "shards": faulted[0]["shards"], "devices": len(NODE_IPS) * len(EMULATE),
                "poll_interval_s": POLL_INTERVAL_S, "lost_after_polls": LOST_AFTER},
        "no_fault": summary(baseline),
        "worker_killed_at_50_percent": summary([f["wall_s"] for f in faulted]),
        "ratio_killed_over_no_fault_p50": round(fault_p50 / base_p50, 3),
        "kill_to_first_retry_event": summary([f["kill_to_first_retry_event_s"] * 1000 for f in faulted], "ms", 1),
        "kill_to_retried_shard_start": summary([f["kill_to_retried_shard_start_s"] * 1000 for f in faulted], "ms", 1),
        "kill_to_inventory_lost": summary([f["kill_to_lost_s"] for f in faulted]),
        "retried_shards_per_job": summary([float(f["retried_shards"]) for f in faulted], "shards", 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
