"""Inventory benchmark: what gRPC adds to ListDevices and ScoreDevices, and what a poll cycle costs.

    .venv/bin/python bench/inventory.py [--quick]

Prints one JSON document on stdout (progress on stderr). Every time is paired with a baseline
measured in the same run (STYLE rule 12): query latency through real gRPC on loopback against
the in-process domain call (`Inventory.list_devices` / `Inventory.score`) and the GetDevice
round trip (the gRPC floor); a poll cycle over 100 real worker servers against one DescribeNode
round trip. Compare the ratios across machines, not the milliseconds.

Synthetic inventories are written straight into the store: one node per 8 devices, device types
cycling over the catalog, node IPs synthesised in 10.0.0.0/8. Those IPs are data only: the
poller is never started on them, so nothing dials them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from common import percentile, progress, ratio, summary_ms, synthetic_node_ip, time_calls

from accelmesh.hardware.catalog import CatalogEntry, load_catalog, resolve_type
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance, device_id
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.config import Security
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role
from inventory_svc.config import InventoryConfig
from inventory_svc.filtering import DeviceFilter
from inventory_svc.inventory import POLL_WORKERS, Inventory
from inventory_svc.node_client import NodeClient
from inventory_svc.scoring import TaskProfile
from inventory_svc.server import build_inventory
from worker_svc.agent import NodeAgent
from worker_svc.config import WorkerConfig
from worker_svc.probes.cpu import CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE, DEFAULT_CLOCK_GHZ, FMA_UNITS_PER_CORE
from worker_svc.server import build_worker

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PAI_CSV = DATA_DIR / "pai_machine_spec.csv"

DEVICES_PER_NODE = 8
SIZES = (10, 10_000)
PAGE_SIZE = 100
LIST_FILTER = "capabilities:bf16 AND free_memory_bytes >= 20000000000"
SCORE_PRECISION = "bf16"
SCORE_LIMIT = 10
SEED = 20240601

POLL_NODES = 100
POLL_PROFILES = ("a100-80gb", "v100-32gb", "t4", "l4")  # one emulated device per fake CPU device
RPC_TIMEOUT_S = 30.0
STOP_GRACE_S = 0.5

# PAI names MISC for GPUs it does not identify; a T4 is the assumption (noted in the JSON).
PAI_MISC_TYPE = "t4"
# PAI's CPU machines: AVX2 + FMA cores (8 fp32 lanes, 2 FMA units) at the probe's default clock.
PAI_CPU_FP32_PER_CYCLE = FMA_UNITS_PER_CORE * 8 * 2


@dataclass(frozen=True)
class Plan:
    """How many calls each measurement makes; --quick shrinks everything for a smoke run."""

    small_calls: int  # per query on the 10-device inventory
    large_list_calls: int  # ListDevices on the 10,000-device inventory
    large_score_calls: int  # ScoreDevices on 10,000 devices (each decodes every row)
    pai_score_calls: int
    floor_calls: int  # GetDevice round trips
    describe_calls: int  # DescribeNode round trips (poll baseline)
    poll_cycles: int
    warmup: int


FULL = Plan(small_calls=300, large_list_calls=100, large_score_calls=15, pai_score_calls=15,
            floor_calls=300, describe_calls=200, poll_cycles=10, warmup=3)
QUICK = Plan(small_calls=30, large_list_calls=10, large_score_calls=3, pai_score_calls=3,
             floor_calls=30, describe_calls=30, poll_cycles=3, warmup=1)




# -- timing ------------------------------------------------------------------------------------






def summary(values: list[float]) -> dict:
    return summary_ms(values, digits=4)




def compare(grpc_ms: list[float], inproc_ms: list[float], floor_p50_ms: float) -> dict:
    """gRPC against the in-process call and the gRPC floor, at the median."""
    g, i = percentile(grpc_ms, 50), percentile(inproc_ms, 50)
    return {
        "grpc": summary(grpc_ms),
        "in_process": summary(inproc_ms),
        "ratio_grpc_over_in_process_p50": ratio(g, i),
        "overhead_p50_ms": round(g - i, 4),
        "ratio_grpc_over_floor_p50": ratio(g, floor_p50_ms),
    }


# -- synthetic and PAI inventories ---------------------------------------------------------------




def device_from_entry(entry: CatalogEntry, ip: str, index: int) -> DeviceSpec:
    return entry.device_spec(ip, index)


def sample_for(spec: DeviceSpec, now: float, rng: random.Random) -> DeviceSample:
    total = spec.performance.memory_bytes
    return DeviceSample(spec.id, now, total, int(total * rng.uniform(0.0, 0.9)), utilization=rng.uniform(0.0, 1.0))


def node_description(ip: str, hostname: str, specs: list[DeviceSpec], now: float,
                     rng: random.Random) -> NodeDescription:
    return NodeDescription(ip, hostname, tuple(specs), tuple(sample_for(s, now, rng) for s in specs))


def synthetic_nodes(devices: int, now: float, rng: random.Random) -> Iterator[NodeDescription]:
    """``devices`` devices, DEVICES_PER_NODE a node, types cycling over the catalog in name order."""
    entries = [load_catalog()[name] for name in sorted(load_catalog())]
    for node in range(-(-devices // DEVICES_PER_NODE)):
        ip = synthetic_node_ip(node)
        specs, next_index = [], Counter()
        for k in range(node * DEVICES_PER_NODE, min(devices, (node + 1) * DEVICES_PER_NODE)):
            entry = entries[k % len(entries)]
            specs.append(device_from_entry(entry, ip, next_index[entry.platform]))
            next_index[entry.platform] += 1
        yield node_description(ip, f"synthetic-{node:05d}", specs, now, rng)


def pai_cpu_device(ip: str, cores: int, memory_gb: float) -> DeviceSpec:
    fp32 = cores * DEFAULT_CLOCK_GHZ * PAI_CPU_FP32_PER_CYCLE / 1000
    return DeviceSpec(
        id=device_id(ip, "cpu", 0), node_ip=ip, local_index=0, platform="cpu",
        kind=f"PAI CPU machine ({cores} cores)", type="cpu", capabilities=frozenset({"fp64", "avx", "avx2", "fma"}),
        performance=Performance(
            peak_tflops={"fp32": fp32, "fp64": fp32 / 2}, memory_bytes=int(memory_gb * 2**30),
            memory_bandwidth_gbps=CPU_MEMORY_BANDWIDTH_GBPS_ESTIMATE, estimated=True,
        ),
    )


def pai_nodes(path: Path, now: float, rng: random.Random) -> tuple[list[NodeDescription], dict]:
    """One node per PAI machine: one device per GPU, or one CPU device for a CPU machine."""
    nodes, machines = [], Counter()
    with path.open(newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            gpu_type, gpus = row["gpu_type"].strip(), int(row["cap_gpu"])
            machines[gpu_type] += 1
            ip = synthetic_node_ip(index)
            if gpu_type == "CPU" or gpus == 0:
                specs = [pai_cpu_device(ip, int(row["cap_cpu"]), float(row["cap_mem"]))]
            else:
                entry = resolve_type(PAI_MISC_TYPE if gpu_type == "MISC" else gpu_type)
                specs = [device_from_entry(entry, ip, i) for i in range(gpus)]
            nodes.append(node_description(ip, row["machine"], specs, now, rng))
    return nodes, dict(sorted(machines.items()))


def load_nodes(inventory: Inventory, nodes: list[NodeDescription], now: float) -> int:
    """Write nodes as the poller would after a successful describe; return the device count."""
    for description in nodes:
        node = inventory.store.upsert_node(f"{description.ip}:50070", description.ip, description.hostname, now)
        inventory.store.record_poll_success(node.address, description, now)
    return sum(len(d.devices) for d in nodes)


# -- servers -----------------------------------------------------------------------------------


def credentials(workdir: Path) -> MeshCredentials:
    """The run's throwaway mesh CA (made on first use): every server here speaks mutual TLS, as in production."""
    return MeshCredentials(workdir / "credentials")


@contextlib.contextmanager
def inventory_server(workdir: Path, name: str, caller: Security | None = None,
                     ) -> Iterator[tuple[Inventory, inventory_service_pb2_grpc.InventoryServiceStub]]:
    """A real inventory server on loopback port 0 with its own database; stopped on exit. The stub
    calls as `caller` (default: the local operator)."""
    config = InventoryConfig(listen="127.0.0.1:0", db=str(workdir / f"{name}.db"),
                             security=credentials(workdir).service(Role.INVENTORY))
    server, inventory = build_inventory(config, start_poller=False)
    server.start()
    channel = open_channel(f"127.0.0.1:{server.port}", security=caller or credentials(workdir).client())
    try:
        yield inventory, inventory_service_pb2_grpc.InventoryServiceStub(channel)
    finally:
        channel.close()
        server.stop(STOP_GRACE_S)


@dataclass(frozen=True)
class FakeJaxDevice:
    """What the JAX probe reads from a device; memory_stats None as on XLA's CPU backend."""

    id: int
    platform: str = "cpu"
    device_kind: str = "cpu"

    def memory_stats(self):
        return None


# -- measurements ------------------------------------------------------------------------------


def score_request(filter_text: str = "") -> pb.ScoreDevicesRequest:
    task = pb.TaskProfile(kind=pb.TASK_KIND_TRAINING, precision=SCORE_PRECISION)
    return pb.ScoreDevicesRequest(task=task, filter=filter_text, limit=SCORE_LIMIT)


def score_profile() -> TaskProfile:
    return TaskProfile(kind="training", precision=SCORE_PRECISION)


def measure_floor(inventory: Inventory, stub, device: str, plan: Plan) -> dict:
    request = pb.GetDeviceRequest(device_id=device)
    grpc_ms = time_calls(lambda: stub.GetDevice(request, timeout=RPC_TIMEOUT_S), plan.floor_calls, plan.warmup)
    inproc_ms = time_calls(lambda: inventory.get_device(device), plan.floor_calls, plan.warmup)
    return {"grpc": summary(grpc_ms), "in_process": summary(inproc_ms)}


def measure_list(inventory: Inventory, stub, filter_text: str, calls: int, plan: Plan, floor_ms: float) -> dict:
    request = pb.ListDevicesRequest(filter=filter_text, page_size=PAGE_SIZE)
    response = stub.ListDevices(request, timeout=RPC_TIMEOUT_S)
    records, _ = inventory.list_devices(filter_text, PAGE_SIZE, "")
    if [d.id for d in response.devices] != [r.id for r in records]:
        raise AssertionError(f"ListDevices over gRPC and in process disagree for filter {filter_text!r}")
    grpc_ms = time_calls(lambda: stub.ListDevices(request, timeout=RPC_TIMEOUT_S), calls, plan.warmup)
    inproc_ms = time_calls(lambda: inventory.list_devices(filter_text, PAGE_SIZE, ""), calls, plan.warmup)
    return {
        "filter": filter_text, "page_size": PAGE_SIZE, "devices_returned": len(response.devices),
        "more_pages": bool(response.next_page_token), "response_bytes": response.ByteSize(),
        **compare(grpc_ms, inproc_ms, floor_ms),
    }


def measure_score(inventory: Inventory, stub, calls: int, plan: Plan, floor_ms: float) -> dict:
    request = score_request()
    response = stub.ScoreDevices(request, timeout=RPC_TIMEOUT_S)
    ranking = inventory.score(score_profile(), "", SCORE_LIMIT)
    if [s.device.id for s in response.devices] != [s.record.id for s in ranking.devices]:
        raise AssertionError("ScoreDevices over gRPC and in process rank differently")
    grpc_ms = time_calls(lambda: stub.ScoreDevices(request, timeout=RPC_TIMEOUT_S), calls, plan.warmup)
    inproc_ms = time_calls(lambda: inventory.score(score_profile(), "", SCORE_LIMIT), calls, plan.warmup)
    # Part of the in-process cost: reading and decoding every candidate before any scoring.
    candidates_ms = time_calls(lambda: inventory.all_devices(DeviceFilter()), calls, plan.warmup)
    return {
        "task": {"kind": "training", "precision": SCORE_PRECISION}, "limit": SCORE_LIMIT,
        "top_types": [s.device.type for s in response.devices[:3]],
        **compare(grpc_ms, inproc_ms, floor_ms),
        "in_process_candidate_read": summary(candidates_ms),
        "ratio_candidate_read_over_in_process_p50": ratio(percentile(candidates_ms, 50), percentile(inproc_ms, 50)),
    }


def bench_sizes(workdir: Path, plan: Plan) -> tuple[dict, dict, dict]:
    listing, scoring, floors = {}, {}, {}
    for size in SIZES:
        label = f"{size}_devices"
        rng, now = random.Random(SEED), time.time()
        with inventory_server(workdir, label) as (inventory, stub):
            start = time.perf_counter()
            count = load_nodes(inventory, list(synthetic_nodes(size, now, rng)), now)
            progress(f"{label}: loaded {count} devices in {time.perf_counter() - start:.1f} s")
            first = inventory.list_devices("", 1, "")[0][0].id
            floor = measure_floor(inventory, stub, first, plan)
            floor_ms = floor["grpc"]["p50_ms"]
            list_calls = plan.small_calls if size <= 100 else plan.large_list_calls
            score_calls = plan.small_calls if size <= 100 else plan.large_score_calls
            listing[label] = {
                "first_page": measure_list(inventory, stub, "", list_calls, plan, floor_ms),
                "filtered": measure_list(inventory, stub, LIST_FILTER, list_calls, plan, floor_ms),
            }
            progress(f"{label}: ListDevices done")
            scoring[label] = {"devices": count, **measure_score(inventory, stub, score_calls, plan, floor_ms)}
            progress(f"{label}: ScoreDevices done")
            floors[label] = floor
    return listing, scoring, floors


def bench_pai(workdir: Path, plan: Plan) -> dict | None:
    if not PAI_CSV.exists():
        progress(f"NOTE: {PAI_CSV} not found; skipping the PAI inventory (\"pai\": null in the JSON)")
        return None
    rng, now = random.Random(SEED), time.time()
    nodes, machines = pai_nodes(PAI_CSV, now, rng)
    with inventory_server(workdir, "pai") as (inventory, stub):
        start = time.perf_counter()
        count = load_nodes(inventory, nodes, now)
        progress(f"pai: loaded {count} devices on {len(nodes)} machines in {time.perf_counter() - start:.1f} s")
        types = Counter(d.type for n in nodes for d in n.devices)
        floor = measure_floor(inventory, stub, nodes[0].devices[0].id, plan)
        score = measure_score(inventory, stub, plan.pai_score_calls, plan, floor["grpc"]["p50_ms"])
    return {
        "source": str(PAI_CSV), "machines": sum(machines.values()), "machines_by_gpu_type": machines,
        "devices": count, "gpu_devices": count - types.get("cpu", 0), "cpu_devices": types.get("cpu", 0),
        "devices_by_type": dict(sorted(types.items())),
        "assumptions": [
            f"MISC GPUs are modelled as {PAI_MISC_TYPE} (PAI does not name them)",
            "P100, T4, V100 and V100M32 map through catalog aliases (V100 -> v100-16gb, V100M32 -> v100-32gb)",
            "a CPU machine is one 'cpu' device: cap_cpu cores at the CPU probe's default clock with AVX2+FMA, "
            "cap_mem read as GiB, the probe's memory bandwidth estimate",
            "GPU machines' host CPUs are not listed as devices",
            "samples are synthetic: used memory 0-90% and utilisation 0-100%, seeded",
        ],
        "get_device_floor": floor,
        "score_devices": score,
    }


def bench_poll(workdir: Path, plan: Plan) -> dict:
    mesh = credentials(workdir)
    with contextlib.ExitStack() as stack:
        # RegisterNode is a worker's, for a node its certificate names (every worker here is on loopback).
        inventory, stub = stack.enter_context(inventory_server(workdir, "poll", mesh.service(Role.WORKER)))
        start = time.perf_counter()
        addresses, agents = [], []
        for i in range(POLL_NODES):
            # Distinct node IPs: device ids embed the IP, so workers sharing one would collide.
            agent = NodeAgent(
                synthetic_node_ip(i), emulate=POLL_PROFILES, hostname=f"bench-worker-{i:03d}",
                jax_devices=[FakeJaxDevice(id=d) for d in range(len(POLL_PROFILES))],
            )
            server = build_worker(WorkerConfig(listen="127.0.0.1:0", security=mesh.service(Role.WORKER)), agent=agent)
            server.start()
            stack.callback(server.stop, STOP_GRACE_S)
            addresses.append(f"127.0.0.1:{server.port}")
            agents.append(agent)
        progress(f"poll: {POLL_NODES} workers up in {time.perf_counter() - start:.1f} s")

        register_ms = []
        for address in addresses:
            t0 = time.perf_counter_ns()
            stub.RegisterNode(pb.RegisterNodeRequest(address=address), timeout=RPC_TIMEOUT_S)
            register_ms.append((time.perf_counter_ns() - t0) / 1e6)
        devices = len(inventory.all_devices(DeviceFilter(include_lost=True)))
        progress(f"poll: registered {POLL_NODES} workers holding {devices} devices")

        client = NodeClient(mesh.service(Role.INVENTORY))  # DescribeNode is the inventory's
        stack.callback(client.close)
        describe_ms = time_calls(lambda: client.describe(addresses[0]), plan.describe_calls, plan.warmup)
        agent_ms = time_calls(agents[0].describe, plan.describe_calls, plan.warmup)
        description = agents[0].describe()
        record_ms = time_calls(
            lambda: inventory.store.record_poll_success(addresses[0], description, time.time()),
            plan.describe_calls, plan.warmup,
        )

        failures = []

        def cycle() -> None:
            outcomes = inventory.poll_all()
            failures.extend(node for node, ok in outcomes.items() if not ok)

        cycle_ms = time_calls(cycle, plan.poll_cycles, 1)
        progress(f"poll: {plan.poll_cycles} cycles done")
        if failures:
            progress(f"WARNING: {len(failures)} node polls failed, e.g. {failures[0]}")
        cycle_p50, describe_p50 = percentile(cycle_ms, 50), percentile(describe_ms, 50)
        return {
            "nodes": POLL_NODES, "devices_per_node": len(POLL_PROFILES), "devices": devices,
            "poll_workers": POLL_WORKERS, "failed_node_polls": len(failures),
            "cycle": summary(cycle_ms),
            "per_node_p50_ms": round(cycle_p50 / POLL_NODES, 4),
            "describe_node_grpc": summary(describe_ms),
            "describe_node_in_process": summary(agent_ms),
            "record_poll_success_in_process": summary(record_ms),
            "register_node_grpc": summary(register_ms),
            "ratio_cycle_over_describe_p50": ratio(cycle_p50, describe_p50),
            # Below 1 means the parallel poll beats calling the nodes one after another; workers
            # and inventory share one process (and its GIL) here, so expect little below 1.
            "ratio_cycle_over_serial_describes_p50": ratio(cycle_p50, POLL_NODES * describe_p50),
        }


def machine() -> dict:
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "otel_env": sorted(k for k in os.environ if k.startswith("OTEL_")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few iterations: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        workdir = Path(tmp)
        listing, scoring, floors = bench_sizes(workdir, plan)
        pai = bench_pai(workdir, plan)
        poll = bench_poll(workdir, plan)
    result = {
        "benchmark": "inventory",
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
        "get_device_floor": floors,
        "list_devices": listing,
        "score_devices": scoring,
        "pai": pai,
        "pai_skipped_reason": None if pai is not None else f"{PAI_CSV} not found",
        "poll_cycle": poll,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
