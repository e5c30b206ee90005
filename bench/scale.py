"""Scale-out benchmark: 10,000 simulated nodes of 8 devices on loopback polled by 1, 2 and 4
inventory replicas sharing one PostgreSQL; ListDevices, ScoreDevices and a job's planning at
80,000 devices.

    .venv/bin/python bench/scale.py [--quick] [--nodes N]

Prints one JSON document on stdout (progress on stderr); every time is paired with a baseline
from the same run (STYLE rule 12). PostgreSQL is started for the run (tests/postgres.py's
PostgresServer, loaded from its file); without its binaries the run says so and prints a JSON
document whose sections are null.

Simulated nodes. 10,000 worker processes do not fit on a laptop, so a few node-host processes
each serve a share of the node addresses: one grpc.aio server per node, bound to the node's own
loopback address (127.x.y.z, all on one port; Linux answers the whole of 127.0.0.0/8 on lo) with
the mesh's worker certificate and mutual TLS, as a worker serves. Each answers DescribeNode
as a worker emulating 8 catalog devices answers it (the catalog's emulated specs, the worker's
own proto conversion, a new status sample on every call); they run no JAX and no probes, and
answer nothing else. The replicas are real inventory processes (build_inventory, the real
poller's poll_all, node client, store, index and follower) on the run's PostgreSQL; nothing of
the inventory is mocked.

(a) Poll cycle per replica, with 1, 2 and 4 replicas started together and polling at once
    (their leases share the nodes, polls.claim_nodes), after warm-up cycles until the shares are
    settled; baselines: one DescribeNode round trip, and the cycle with one replica.
(b) At 80,000 devices (what the polls stored): ListDevices and ScoreDevices through gRPC on a
    replica of its own, against GetDevice (the gRPC floor) and, for ScoreDevices, the ranking
    ScoreDevices computed before the device index (every candidate read, decoded, scored:
    scoring.score_devices over Inventory.all_devices), timed in the same run; ScoreDevices
    again while two replicas poll.
(c) A job's planning from those devices, the dispatcher's planner steps: a data-parallel split
    (throughput rates per target type, then plan_shards as strategies/data_parallel._split does)
    and a model placement (place_ranked, place_balanced over the scored statuses as
    pipeline_plan builds them); baseline: sorting the device list by peak rate. Goal for
    ScoreDevices and planning: under 100 ms (`goal_met`).
Compare ratios across machines, not milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import sqlalchemy as sa
from common import percentile, progress, ratio, summary_ms, time_calls

from accelmesh.hardware.catalog import load_catalog
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.devices import device_to_proto, timestamp
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from inventory_svc.config import InventoryConfig
from inventory_svc.filtering import parse_filter
from inventory_svc.inventory import POLL_WORKERS
from inventory_svc.node_client import NodeClient
from inventory_svc.scoring import TaskProfile, score_devices
from inventory_svc.server import build_inventory
from inventory_svc.store import SqlStore
from inventory_svc.tables import devices as device_table

ROOT = Path(__file__).resolve().parents[1]
NODES, QUICK_NODES = 10_000, 800
DEVICES_PER_NODE = 8
NODE_PORT = 50070
NODE_HOSTS = 2  # node-host processes; each serves NODES / NODE_HOSTS addresses
REPLICA_COUNTS = (1, 2, 4)
# Leases outlast the cycles measured here (a cycle of 10,000 nodes on 2 cores takes tens of
# seconds), so shares stay put between cycles, as they do when the interval fits the fleet.
POLL_INTERVAL_S = 600.0
POLL_TIMEOUT_S = 60.0  # a loaded 2-core machine answers slowly: a slow answer is not a lost node here
MAX_WARMUP_CYCLES = 4
PAGE_SIZE = 100
LIST_FILTER = "capabilities:bf16 AND free_memory_bytes >= 20000000000"
SCORE_FILTER = 'platform = "cuda" AND capabilities:bf16'
SCORE_LIMIT = 10
GOAL_MS = 100.0
RPC_TIMEOUT_S = 120.0
SEED = 20240601


@dataclass(frozen=True)
class Plan:
    cycles: int  # measured poll cycles per replica count
    score_calls: int
    list_calls: int
    floor_calls: int
    reference_calls: int  # the pre-index ranking: seconds each at 80,000 devices
    planning_calls: int
    warmup: int


FULL = Plan(cycles=3, score_calls=50, list_calls=50, floor_calls=200, reference_calls=3, planning_calls=10, warmup=2)
QUICK = Plan(cycles=2, score_calls=10, list_calls=10, floor_calls=30, reference_calls=2, planning_calls=3, warmup=1)


# -- simulated nodes -----------------------------------------------------------------------------


def node_ip(index: int) -> str:
    """The index-th simulated node's loopback address: 127.1.0.1, 127.1.0.2, ... (no .0 or .255)."""
    return f"127.{1 + index // 64_000}.{index // 250 % 256}.{1 + index % 250}"


def node_address(index: int) -> str:
    return f"{node_ip(index)}:{NODE_PORT}"


class SimulatedNode(worker_service_pb2_grpc.WorkerServiceServicer):
    """DescribeNode as a worker emulating DEVICES_PER_NODE catalog devices answers it; the
    device types cycle over the catalog in name order, node after node."""

    def __init__(self, index: int, rng: random.Random):
        entries = [load_catalog()[name] for name in sorted(load_catalog())]
        ip, counts = node_ip(index), Counter()
        self.specs = []
        for k in range(DEVICES_PER_NODE):
            entry = entries[(index * DEVICES_PER_NODE + k) % len(entries)]
            self.specs.append(entry.device_spec(ip, counts[entry.platform], emulated_on=f"cpu:{k}"))
            counts[entry.platform] += 1
        self._template = worker_service_pb2.DescribeNodeResponse(
            node_ip=ip, hostname=f"simulated-{index:05d}", software_version="simulated",
            devices=[device_to_proto(spec) for spec in self.specs])
        self._used = [rng.uniform(0.0, 0.9) for _ in self.specs]
        self._rng = rng

    async def DescribeNode(self, request, context):
        response = worker_service_pb2.DescribeNodeResponse()
        response.CopyFrom(self._template)
        now = timestamp(time.time())
        for k, (device, spec) in enumerate(zip(response.devices, self.specs)):
            # A slowly drifting load, as a busy node's readings move from poll to poll.
            self._used[k] = min(0.95, max(0.0, self._used[k] + self._rng.uniform(-0.05, 0.05)))
            total = spec.performance.memory_bytes
            status = device.status
            status.sample_time.CopyFrom(now)
            status.memory_total_bytes, status.memory_used_bytes = total, int(total * self._used[k])
            status.memory_free_bytes = total - status.memory_used_bytes
            status.utilization = self._rng.uniform(0.0, 1.0)
        return response


def serve_nodes(first: int, count: int, credentials_dir: str, conn) -> None:
    """A node-host process: nodes first .. first + count - 1 until the parent says stop."""
    asyncio.run(_serve_nodes(first, count, credentials_dir, conn))


async def _serve_nodes(first: int, count: int, credentials_dir: str, conn) -> None:
    # The worker's credentials (tls.server_credentials) without its reload-on-change fetcher,
    # which one aio server after another cannot share: the files do not change during a run.
    ca, chain, key = MeshCredentials(credentials_dir).service(Role.WORKER).tls.read()
    credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=True)
    rng, servers = random.Random(SEED + first), []
    for index in range(first, first + count):
        server = grpc.aio.server()
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(SimulatedNode(index, rng), server)
        if server.add_secure_port(node_address(index), credentials) != NODE_PORT:
            raise RuntimeError(f"could not bind {node_address(index)}")
        await server.start()
        servers.append(server)
    conn.send("ready")
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
    await asyncio.gather(*(server.stop(None) for server in servers))


# -- inventory replicas --------------------------------------------------------------------------


def run_replica(db_url: str, credentials_dir: str, conn) -> None:
    """A replica process: a real inventory server that runs a poll cycle when the parent asks."""
    config = InventoryConfig(listen="127.0.0.1:0", db=db_url, poll_interval_s=POLL_INTERVAL_S,
                             poll_timeout_s=POLL_TIMEOUT_S,
                             security=MeshCredentials(credentials_dir).service(Role.INVENTORY))
    server, inventory = build_inventory(config, start_poller=False)
    server.start()
    conn.send(("ready", server.port))
    while conn.recv() == "cycle":  # anything else: stop
        start = time.perf_counter()
        outcomes = inventory.poll_all()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        conn.send((elapsed_ms, sorted(outcomes), sorted(a for a, ok in outcomes.items() if not ok)))
    server.stop(5.0)  # hands its nodes back (Inventory.close)
    conn.send("stopped")


class Replicas:
    """Replica processes driven from here: ``cycle`` runs one poll cycle on all of them at once."""

    def __init__(self, context, db_url: str, credentials_dir: str):
        self._context, self._db_url, self._credentials_dir = context, db_url, credentials_dir
        self._procs: list[tuple[multiprocessing.Process, object]] = []

    def grow(self, count: int) -> None:
        started = []
        for _ in range(count - len(self._procs)):
            parent, child = self._context.Pipe()
            proc = self._context.Process(target=run_replica, args=(self._db_url, self._credentials_dir, child))
            proc.start()
            started.append((proc, parent))
        for _, conn in started:
            conn.recv()
        self._procs += started

    def cycle(self) -> list[tuple[float, list[str], list[str]]]:
        for _, conn in self._procs:
            conn.send("cycle")
        return [conn.recv() for _, conn in self._procs]

    def stop(self) -> None:
        for _, conn in self._procs:
            conn.send("stop")
        for proc, conn in self._procs:
            conn.recv()
            proc.join(30)
        self._procs = []


# -- measurements --------------------------------------------------------------------------------


def bench_polls(replicas: Replicas, addresses: list[str], describe_p50_ms: float, plan: Plan) -> dict:
    out, single_p50 = {}, None
    for count in REPLICA_COUNTS:
        replicas.grow(count)
        for warmup in range(1, MAX_WARMUP_CYCLES + 1):  # first polls add devices and open TLS channels
            results = replicas.cycle()
            sizes = [len(polled) for _, polled, _ in results]
            progress(f"poll: {count} replica(s), warm-up cycle {warmup}: "
                     f"{[round(ms / 1e3, 1) for ms, _, _ in results]} s, nodes {sizes}")
            if max(sizes) - min(sizes) <= 1 and sum(sizes) == len(addresses) and warmup > 1:
                break
        cycles: list[list[float]] = [[] for _ in range(count)]
        polled_once, failures = True, 0
        for _ in range(plan.cycles):
            results = replicas.cycle()
            everyone = [a for _, polled, _ in results for a in polled]
            polled_once &= sorted(everyone) == addresses
            for k, (ms, _, failed) in enumerate(results):
                cycles[k].append(ms)
                failures += len(failed)
        per_replica = [{"nodes": size, "cycle": summary_ms(ms),
                        "per_node_ms": round(percentile(ms, 50) / max(1, size), 3)}
                       for size, ms in zip(sizes, cycles)]
        slowest = max(percentile(ms, 50) for ms in cycles)
        single_p50 = single_p50 or slowest
        out[f"{count}_replicas"] = {
            "per_replica": per_replica,
            "slowest_replica_cycle_p50_ms": round(slowest, 1),
            "every_node_polled_exactly_once_per_cycle": polled_once,
            "failed_node_polls": failures,
            "ratio_cycle_over_one_replica_p50": ratio(slowest, single_p50),
            # Below 1: the replica's polls overlap (POLL_WORKERS threads each) better than one after another.
            "ratio_cycle_over_serial_describes_p50": ratio(slowest, max(sizes) * describe_p50_ms),
        }
        progress(f"poll: {count} replica(s): slowest cycle p50 {slowest / 1e3:.1f} s")
    replicas.stop()
    return out


def score_request(filter_text: str) -> pb.ScoreDevicesRequest:
    return pb.ScoreDevicesRequest(task=pb.TaskProfile(kind=pb.TASK_KIND_TRAINING, precision="bf16"),
                                  filter=filter_text, limit=SCORE_LIMIT)


def profile() -> TaskProfile:
    return TaskProfile(kind="training", precision="bf16")


def bench_queries(inventory, stub, replicas: Replicas, plan: Plan) -> dict:
    first = inventory.list_devices("", 1, "")[0][0].id
    floor = time_calls(lambda: stub.GetDevice(pb.GetDeviceRequest(device_id=first), timeout=RPC_TIMEOUT_S),
                       plan.floor_calls, plan.warmup)
    floor_p50 = percentile(floor, 50)
    listing = {}
    for name, text in (("first_page", ""), ("filtered", LIST_FILTER)):
        request = pb.ListDevicesRequest(filter=text, page_size=PAGE_SIZE)
        ms = time_calls(lambda r=request: stub.ListDevices(r, timeout=RPC_TIMEOUT_S), plan.list_calls, plan.warmup)
        listing[name] = {"filter": text, "grpc": summary_ms(ms),
                         "ratio_over_get_device_p50": ratio(percentile(ms, 50), floor_p50)}
    progress("queries: ListDevices done")
    scoring = {}
    for name, text in (("all", ""), ("filtered", SCORE_FILTER)):
        request = score_request(text)
        response = stub.ScoreDevices(request, timeout=RPC_TIMEOUT_S)
        flt = parse_filter(text)
        reference = score_devices(inventory.all_devices(flt), profile(), SCORE_LIMIT)
        ms = time_calls(lambda r=request: stub.ScoreDevices(r, timeout=RPC_TIMEOUT_S), plan.score_calls, plan.warmup)
        before = time_calls(lambda f=flt: score_devices(inventory.all_devices(f), profile(), SCORE_LIMIT),
                            plan.reference_calls, 0)
        p50 = percentile(ms, 50)
        scoring[name] = {
            "filter": text, "limit": SCORE_LIMIT, "top_types": [s.device.type for s in response.devices[:3]],
            # The reference ranks a moment later: a device's sample may have moved on in between.
            "same_ranking_as_reference": [s.device.id for s in response.devices] == [s.record.id for s in reference],
            "grpc": summary_ms(ms), "goal_met": p50 < GOAL_MS,
            "ratio_over_get_device_p50": ratio(p50, floor_p50),
            "reference_decode_every_row_in_process": summary_ms(before),
            "ratio_reference_over_grpc_p50": ratio(percentile(before, 50), p50),
        }
        progress(f"queries: ScoreDevices {name}: p50 {p50:.1f} ms, the old path {percentile(before, 50):.0f} ms")
    # While two replicas poll: the index follows their writes, which this replica's rankings pay for.
    replicas.grow(2)
    replicas.cycle()  # shares settle (and the replicas' channels open) before the measurement
    worker = threading.Thread(target=replicas.cycle)
    worker.start()
    request = score_request("")
    during = []
    while worker.is_alive() and len(during) < 10 * plan.score_calls:
        during += time_calls(lambda: stub.ScoreDevices(request, timeout=RPC_TIMEOUT_S), 1, 0)
    worker.join()
    replicas.stop()
    scoring["all_while_two_replicas_poll"] = {
        "grpc": summary_ms(during), "goal_met": percentile(during, 50) < GOAL_MS,
        "ratio_over_idle_p50": ratio(percentile(during, 50), scoring["all"]["grpc"]["p50_ms"]),
    }
    return {"get_device_floor": summary_ms(floor), "list_devices": listing, "score_devices": scoring}


def bench_planning(inventory, plan: Plan) -> dict:
    """The planner steps of a data-parallel job and of a model placement, over every device."""
    # Imported here, not at the top: the node-host and replica processes import this module too
    # (spawn), and need neither the compile service's programs nor the planner.
    from placement import layer_table  # bench/placement.py: the shipped models' layer tables

    from accelmesh.scoring import free_status
    from compile_svc.programs.registry import default_registry
    from compile_svc.rules import load_rules
    from dispatch_svc.execution.strategies.data_parallel import _split as data_parallel_split
    from dispatch_svc.jobs import records as m
    from dispatch_svc.jobs.limits import Limits
    from dispatch_svc.planner import BUCKET_RUNGS, PlannedDevice, Target, ThroughputModel, plan_shards
    from dispatch_svc.planner.placement import INFERENCE, Device, Model, NoRoom, Task, place_balanced, place_ranked
    from dispatch_svc.ports import ArtifactRef, Build, JobDevice

    ranking = inventory.score(profile(), "", 0).devices  # every healthy device with its status
    rules, per_type = load_rules(), {}
    for scored in ranking:
        spec = scored.record.spec
        if spec.type not in per_type:
            per_type[spec.type] = (rules.target_type(spec).key, rules.match(spec).build.compute_dtype)
    records = [s.record for s in ranking]
    throughput = ThroughputModel()
    rows, max_rows, program = 1_000_000, 4096, "resnet50-infer@1"

    targets = {}
    for r in records:
        key, dtype = per_type[r.spec.type]
        targets.setdefault(key, Target(key, r.spec.performance, dtype))
    rates = throughput.rates(program, list(targets.values()), flops_per_row=4.1e9)
    pool = [PlannedDevice(r.id, per_type[r.spec.type][0], rates[per_type[r.spec.type][0]].rows_per_second)
            for r in records]

    def data_parallel():  # the planner's part: the rates of the job's target types, the split
        throughput.rates(program, list(targets.values()), flops_per_row=4.1e9)
        return plan_shards(rows, pool, max_shard_rows=max_rows, exact=True, bucket_rungs=BUCKET_RUNGS)

    # The whole of a data-parallel job's planning step, strategies/data_parallel._split, as the
    # dispatcher runs it on the devices the inventory ranked (a build per target type).
    job_program = default_registry().get("mlp_classifier")
    job_spec = m.JobSpec(program=job_program.name, inputs=(m.InputDecl("x", "float32", (rows, 64)),))
    job_devices = [JobDevice(r.spec, r.node_address, per_type[r.spec.type][0]) for r in records]
    builds = {key: Build(key, "bench", dtype, None, (), ArtifactRef(key, "", "stablehlo", 0), {})
              for key, dtype in per_type.values()}
    limits = Limits(max_rows * 64 * 4, 64 << 20)

    def data_parallel_with_inputs():
        return data_parallel_split(throughput, limits, job_program, job_spec, job_devices, builds, rows)

    candidates = []  # as pipeline_plan._candidate builds them: compute at the dtype of the device's rule
    for scored in ranking:
        r, (key, dtype) = scored.record, per_type[scored.record.spec.type]
        perf = r.spec.performance
        status = free_status(perf.rate_tflops(dtype), perf.memory_bandwidth_gbps, r.free_memory_bytes,
                             r.utilization, r.reserved_compute_fraction)
        candidates.append(Device(r.id, key, status.compute_tflops, status.memory_free_bytes, status.bandwidth_gbps,
                                 perf.interconnect_bandwidth_gbps))
    model = Model(layer_table(default_registry(), "gpt2_xl"), Task(kind=INFERENCE, micro_batch_rows=8))

    def attempt(place):
        try:
            return place(model, candidates)
        except NoRoom as exc:
            return exc

    baseline = time_calls(lambda: sorted(records, key=lambda r: r.spec.performance.rate_tflops("bf16")),
                          plan.planning_calls, 1)
    out = {"devices": len(records), "baseline_sort_by_peak": summary_ms(baseline)}
    sharding = data_parallel()
    for name, call in (("data_parallel_split", data_parallel),
                       ("data_parallel_job_planning", data_parallel_with_inputs),
                       ("place_ranked", lambda: attempt(place_ranked)),
                       ("place_balanced", lambda: attempt(place_balanced))):
        ms = time_calls(call, plan.planning_calls, 1)
        out[name] = {"wall": summary_ms(ms), "goal_met": percentile(ms, 50) < GOAL_MS,
                     "ratio_over_baseline_p50": ratio(percentile(ms, 50), percentile(baseline, 50))}
        progress(f"planning: {name} p50 {percentile(ms, 50):.1f} ms")
    out["data_parallel_split"].update(rows=rows, max_shard_rows=max_rows, shards=len(sharding.shards),
                                      devices_used=len(sharding.rows_by_device()))
    # Outside dispatch_svc/planner: data_parallel._split's own per-device objects (and the
    # collector's pauses over a heap this large) come on top of the planner's split.
    out["data_parallel_job_planning"]["note"] = (
        "strategies/data_parallel._split itself: the planner's split plus what the dispatcher builds around it "
        "(mlp_classifier, 1,000,000 rows)")
    for name, place in (("place_ranked", place_ranked), ("place_balanced", place_balanced)):
        result = attempt(place)
        out[name]["model"] = "gpt2_xl inference, micro-batches of 8"
        out[name]["outcome"] = (f"{len(result.devices)} device(s), step {result.evaluation.step_seconds * 1e3:.3f} ms"
                                if not isinstance(result, NoRoom) else f"no room: {result}")
    return out


# -- the run -------------------------------------------------------------------------------------


def load_postgres():
    """tests/postgres.py's PostgresServer, loaded from its file (bench/ and tests/ are not packages)."""
    spec = importlib.util.spec_from_file_location("accelmesh_test_postgres", ROOT / "tests" / "postgres.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def node_hosts(context, nodes: int, credentials_dir: str) -> Iterator[None]:
    per_host, hosts = -(-nodes // NODE_HOSTS), []
    for first in range(0, nodes, per_host):
        parent, child = context.Pipe()
        proc = context.Process(target=serve_nodes, args=(first, min(per_host, nodes - first), credentials_dir, child))
        proc.start()
        hosts.append((proc, parent))
    try:
        for _, conn in hosts:
            if conn.recv() != "ready":
                raise RuntimeError("a node host did not start")
        yield
    finally:
        for _, conn in hosts:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc, _ in hosts:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def machine(postgres_version: str | None) -> dict:
    return {"cores": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
            "postgres": postgres_version, "platform": platform.platform(),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def run(nodes: int, plan: Plan, postgres) -> dict:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="accelmesh-scale-") as tmp:
        credentials_dir = str(Path(tmp) / "credentials")
        mesh = MeshCredentials(credentials_dir)
        db_url = postgres.database()
        started = time.perf_counter()
        with node_hosts(context, nodes, credentials_dir):
            progress(f"nodes: {nodes} simulated nodes up in {time.perf_counter() - started:.1f} s")
            addresses = sorted(node_address(i) for i in range(nodes))
            store = SqlStore(db_url)
            for i in range(nodes):  # the node rows RegisterNode writes; the first polls add the devices
                store.upsert_node(node_address(i), node_ip(i), f"simulated-{i:05d}", time.time())
            store.close()
            progress(f"nodes: {nodes} registered")
            client = NodeClient(mesh.service(Role.INVENTORY), timeout_s=POLL_TIMEOUT_S)
            describe = time_calls(lambda: client.describe(addresses[0]), plan.floor_calls, plan.warmup)
            client.close()
            replicas = Replicas(context, db_url, credentials_dir)
            try:
                polls = bench_polls(replicas, addresses, percentile(describe, 50), plan)
                config = InventoryConfig(listen="127.0.0.1:0", db=db_url, poll_interval_s=POLL_INTERVAL_S,
                                         security=mesh.service(Role.INVENTORY))
                start = time.perf_counter()
                server, inventory = build_inventory(config, start_poller=False)  # loads its device index
                with inventory.store.engine.connect() as conn:
                    devices = conn.execute(sa.select(sa.func.count()).select_from(device_table)).scalar_one()
                progress(f"queries: a replica of {devices} devices started in {time.perf_counter() - start:.1f} s")
                server.start()
                channel = open_channel(f"127.0.0.1:{server.port}", security=mesh.client())
                try:
                    stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
                    queries = bench_queries(inventory, stub, replicas, plan)
                    planning = bench_planning(inventory, plan)
                finally:
                    channel.close()
                    server.stop(1.0)
            finally:
                replicas.stop()
    return {
        "simulated_nodes": {
            "nodes": nodes, "devices_per_node": DEVICES_PER_NODE, "devices": devices, "node_host_processes": NODE_HOSTS,
            "how": "one grpc.aio server per node on its own 127.x.y.z:50070 in a few host processes, mutual TLS with "
                   "the mesh's worker certificate; DescribeNode answered as a worker emulating catalog devices "
                   "(simulated: no JAX, no probes, nothing else answered)",
        },
        "describe_node_grpc": summary_ms(describe),
        "poll_cycle": {"poll_workers_per_replica": POLL_WORKERS, "poll_timeout_s": POLL_TIMEOUT_S,
                       "lease_interval_s": POLL_INTERVAL_S, **polls},
        **queries,
        "planning": planning,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_NODES} nodes, few repetitions: a smoke run")
    parser.add_argument("--nodes", type=int, default=None,
                        help=f"simulated nodes (default {NODES}, --quick {QUICK_NODES})")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    nodes = args.nodes or (QUICK_NODES if args.quick else NODES)
    started = time.perf_counter()
    postgres_module = load_postgres()
    binaries = postgres_module.find_binaries()
    result = {"benchmark": "scale", "mode": "quick" if args.quick else "full"}
    if binaries is None:
        reason = "PostgreSQL is absent: " + postgres_module.HOW_TO_ENABLE
        progress(f"NOTE: {reason}; nothing measured")
        result.update(machine=machine(None), skipped_reason=reason, simulated_nodes=None, poll_cycle=None,
                      score_devices=None, list_devices=None, planning=None)
    else:
        server = postgres_module.PostgresServer(binaries)
        try:
            result.update(machine=machine(binaries.parent.name), skipped_reason=None, **run(nodes, plan, server))
        finally:
            server.stop()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
