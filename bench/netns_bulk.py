"""Bulk through a job between network namespaces: a direct job's bytes in and out against a bare transfer.

    sudo .venv/bin/python bench/netns_bulk.py [--mib 256] [--reps 3] [--quick]

Prints one JSON document on stdout (progress on stderr). Needs root: without it, or where network
namespaces cannot be made, the JSON says why under `skipped` and the exit status is 0, as the
other benchmarks do when what they need is absent. The data-plane issue's bar: 256 MiB in and out
through a job between two network namespaces, at least 0.8 of a bare transfer of the same bytes
between the same namespaces (`target`).

Topology, made by deploy/netns/multihost.py (`NetnsHosts(1)`, `start_multihost_mesh`): one
namespace am-<pid>-h1 on a bridge in the root namespace by a veth pair, with its own address
10.231.<s>.2; the bridge 10.231.<s>.1. In the namespace: one worker (one XLA CPU device emulating
a V100, so identity stays bit-exact), mutual TLS from the mesh's throwaway CA. In the root
namespace: inventory and compile on the bridge address, the dispatcher on 127.0.0.1, and the
client, this process. The client's connections to the worker come from the bridge address, not
the worker's own, so the worker refuses shared memory and every byte crosses the veth on the gRPC
PutObjects / FetchObjects raw-frame streams (`job.bytes_moved` says so; a run where anything went
by shared memory is not this measurement, `checks.streamed_only`). Beside the worker, in the same
namespace and on the same address, bench/transfer_spike.py's grpcio server (mutual TLS from its
own EC P-256 CA, as the mesh's, a bearer ticket per call, raw 1 MiB frames into a preallocated
store) and its TCP floor (a plain socket), each a process; their client is this process too.

Arms, in one run: (job) `MeshClient.run("identity", {"x": data}, data_path="direct")` of N bytes
of float32 rows of identity's width (256 MiB: 16 shards of the dispatcher's default 16 MiB), its
wall from the call to the outputs in hand, the output compared with the input in full;
(bare_grpc) transfer_spike's `round_trip`: a put of N bytes then a get of N, its stamped slices
checked every run and the crc32 of all bytes in the first; (tcp) the same over the TCP floor.
One untimed run of every arm first, of the full N (the job's first run compiles identity and
fills the worker's segment pool), then `--reps` rounds of the three, reversed every other round.
`round_trip_mb_per_s` = N / wall seconds for every arm (MB = 10^6 bytes), N being the bytes moved
each way: bench/dispatch.py's MB/s of a job (data.nbytes / seconds) and transfer_spike's round
trip. Medians over the rounds, every run listed; `ratio_job_over_bare_grpc_p50` and
`ratio_job_over_tcp_p50` are ratios of medians. CPU seconds per run from /proc/<pid>/stat: the
client (this process, all its threads), the dispatcher and the worker for the job; the client and
the server process for a bare arm; and `machine_busy_cpu_s`, what the whole machine spent in that
time (/proc/stat: every process, the kernel's network stack included; the job's output check is
outside it, a bare arm's sampled check inside).

Caveats. A veth pair is memory to memory through the kernel: this ranks what each stack costs per
byte on this machine's cores, not what a wire allows, and on 2 cores every arm is CPU-bound, so
`machine.cpu_during_measurement` (what other processes used meanwhile, near 0 on a quiet
machine) says how far to trust a figure. The job does more than move bytes: it plans, runs
identity on each shard (a copy into the store) and returns fresh arrays, whose pages the client
touches for the first time (`host_fresh_memory`: on a VM whose balloon takes free pages back this
costs much), where a bare arm writes into a buffer it touched before. Compare ratios across
machines, not MB/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import transfer_spike as spike
from common import MIB, fresh_memory, progress, ratio
from dispatch import cpu_seconds

PROGRAM = "identity"
ARMS = ("job", "bare_grpc", "tcp")
BARE = {"bare_grpc": ("grpc", MIB), "tcp": ("tcp", 0)}  # transfer_spike kind, frame bytes
JOB_TIMEOUT_S = 300.0
TARGET_RATIO = 0.8  # the data-plane issue: the job at least 0.8 of the bare transfer
EMULATE = ("v100-32gb",)  # fp32: identity's output is its input, bit for bit
POLL_INTERVAL_S = 1.0  # the inventory's polls of the worker: rare, so they take little from the arms
DEFINITION = ("N / wall seconds of one run that moves N bytes in and the same N out (MB = 10^6 bytes): for the "
              "job from MeshClient.run to its outputs in hand, for a bare arm its put then get")


# -- pure parts ------------------------------------------------------------------------------------


def job_rows(nbytes: int, width: int) -> int:
    """Rows of float32 of `width` that make `nbytes` (a whole number of rows)."""
    row_bytes = 4 * width
    if nbytes < row_bytes or nbytes % row_bytes:
        raise ValueError(f"{nbytes} bytes are not a whole number of {row_bytes}-byte rows")
    return nbytes // row_bytes


def arm_order(rep: int) -> tuple[str, ...]:
    """The arms of round `rep` (from 0): reversed every other round, so drift hits them alike."""
    return ARMS if rep % 2 == 0 else ARMS[::-1]


def mb_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e6 / seconds, 1)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(nbytes: int, runs: dict[str, list[dict]]) -> dict:
    """Each arm's medians and runs, the ratios of the job to the bare arms, and the target."""
    arms = {}
    for arm, arm_runs in runs.items():
        figures = {"round_trip_mb_per_s_p50": median_of(arm_runs, "round_trip_mb_per_s"),
                   "seconds_p50": median_of(arm_runs, "seconds"),
                   "machine_busy_cpu_s_p50": median_of(arm_runs, "machine_busy_cpu_s"),
                   "round_trip_mb_per_s_runs": [r["round_trip_mb_per_s"] for r in arm_runs],
                   "cpu_s_p50": {k: round(statistics.median(r["cpu_s"][k] for r in arm_runs), 3)
                                 for k in arm_runs[0]["cpu_s"]}}
        if arm != "job":
            figures.update({f"{f}_p50": median_of(arm_runs, f) for f in ("put_mb_per_s", "get_mb_per_s")})
        arms[arm] = {**figures, "runs": arm_runs}
    job, grpc_, tcp = (arms[a]["round_trip_mb_per_s_p50"] for a in ARMS)
    over_grpc = ratio(job, grpc_)
    return {
        "bytes_each_way": nbytes,
        "definition": {"round_trip_mb_per_s": DEFINITION},
        "arms": arms,
        "ratio_job_over_bare_grpc_p50": over_grpc,
        "ratio_job_over_tcp_p50": ratio(job, tcp),
        "ratio_bare_grpc_over_tcp_p50": ratio(grpc_, tcp),
        "ratio_job_machine_cpu_over_bare_grpc_p50": ratio(arms["job"]["machine_busy_cpu_s_p50"],
                                                          arms["bare_grpc"]["machine_busy_cpu_s_p50"]),
        "target": {"rule": f"ratio_job_over_bare_grpc >= {TARGET_RATIO}", "ratio": over_grpc,
                   "met": over_grpc is not None and over_grpc >= TARGET_RATIO},
    }


# -- one run of each arm ---------------------------------------------------------------------------


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (transfer_spike.cpu_accounts' /proc/stat figure)."""
    return spike.cpu_accounts()["busy"]


def job_run(client, dispatch_pid: int, worker_pid: int, data: np.ndarray) -> dict:
    """One direct identity job of `data`: wall, CPU, bytes by path, the output checked in full."""
    cpu = {"client": time.process_time(), "dispatcher": cpu_seconds(dispatch_pid), "worker": cpu_seconds(worker_pid)}
    busy, start = machine_busy(), time.perf_counter()
    result = client.run(PROGRAM, {"x": data}, timeout=JOB_TIMEOUT_S, data_path="direct")
    seconds, busy = time.perf_counter() - start, machine_busy() - busy
    cpu = {"client": time.process_time() - cpu["client"], "dispatcher": cpu_seconds(dispatch_pid) - cpu["dispatcher"],
           "worker": cpu_seconds(worker_pid) - cpu["worker"]}
    if not np.array_equal(result.outputs["y"], data):
        raise AssertionError("the job's output differs from its input (identity)")
    shards = result.job.shards
    return {"seconds": round(seconds, 4), "round_trip_mb_per_s": mb_per_s(data.nbytes, seconds),
            "cpu_s": {k: round(v, 3) for k, v in cpu.items()}, "machine_busy_cpu_s": round(busy, 2),
            "bytes_moved": dict(result.moved_bytes),
            "shards": len(shards), "shard_rows": sorted({s.rows for s in shards}),
            "execute_s_total": round(sum(s.execute_seconds for s in shards), 4), "output_equal": True}


def bare_run(arm, server_pid: int, sent: np.ndarray, received: np.ndarray, rng: np.random.Generator,
             full_check: bool) -> dict:
    """transfer_spike's round trip (put N, get N, checked), with the server's CPU beside the client's."""
    before, busy = cpu_seconds(server_pid), machine_busy()
    run = spike.round_trip(arm, sent, received, rng, full_check)
    server, busy = cpu_seconds(server_pid) - before, machine_busy() - busy  # with the check: a few ms
    return {"seconds": round(run["put_s"] + run["get_s"], 4), "round_trip_mb_per_s": run["roundtrip_mb_per_s"],
            "put_mb_per_s": run["put_mb_per_s"], "get_mb_per_s": run["get_mb_per_s"],
            "cpu_s": {"client": run["client_cpu_s"], "server": round(server, 3)}, "machine_busy_cpu_s": round(busy, 2),
            "client_minor_faults": run["client_minor_faults"], "crc32_checked": full_check}


# -- the topology ----------------------------------------------------------------------------------


def measure(mesh, host, servers: dict[str, tuple], credentials: Path, nbytes: int, reps: int) -> dict:
    from accelmesh.client import MeshClient
    from accelmesh.object_client import SHARED, STREAMED
    from compile_svc.programs.builtin import IDENTITY_WIDTH

    rng = np.random.default_rng(0)
    data = rng.standard_normal((job_rows(nbytes, IDENTITY_WIDTH), IDENTITY_WIDTH)).astype(np.float32)
    sent = rng.integers(0, 256, nbytes, dtype=np.uint8)  # the bare arms' own: their stamps would spoil `data`
    received = np.ones(nbytes, np.uint8)  # touched once, as the servers' stores are
    creds = spike.read_credentials(credentials)
    bare = {arm: spike.CLIENTS[kind](host.ip, servers[arm][1], creds, frame) for arm, (kind, frame) in BARE.items()}
    dispatch_pid, worker_pid = mesh.dispatch.process.pid, mesh.workers[host.index].process.pid
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        with MeshClient(mesh.dispatch.address, security=mesh.client) as client:
            def once(arm: str, full_check: bool) -> dict:
                if arm == "job":
                    return job_run(client, dispatch_pid, worker_pid, data)
                return bare_run(bare[arm], servers[arm][0].pid, sent, received, rng, full_check)

            progress(f"warm-up: one untimed run of each arm ({nbytes // MIB} MiB; the job compiles identity)")
            warm = {arm: once(arm, full_check=True) for arm in ARMS}
            before, accounts = dict(client._direct.objects.moved_bytes), cpu_accounts(mesh, servers)
            for rep in range(reps):
                for arm in arm_order(rep):
                    runs[arm].append(once(arm, full_check=rep == 0))
                    progress(f"rep {rep + 1}/{reps} {arm}: {runs[arm][-1]['round_trip_mb_per_s']} MB/s round trip")
            load = spike.other_load(accounts, cpu_accounts(mesh, servers))
            moved = {way: client._direct.objects.moved_bytes[way] - before[way] for way in before}
    finally:
        for arm in bare.values():
            arm.close()
    result = summarize(nbytes, runs)
    job = runs["job"][0]
    result["job"] = {"program": PROGRAM, "data_path": "direct", "shape": list(data.shape), "dtype": "float32",
                     "shards": job["shards"], "shard_rows": job["shard_rows"],
                     "bytes_moved_in_timed_runs": moved, "warm_up": warm["job"]}
    result["checks"] = {
        "streamed_only": moved[SHARED] == 0 and moved[STREAMED] == 2 * nbytes * reps,
        "output_equal_every_run": all(r["output_equal"] for r in runs["job"]),
        "bare_arms": "stamped slices and both ends every run, crc32 of all bytes in the first round",
    }
    result["cpu_during_measurement"] = load
    return result


def cpu_accounts(mesh, servers: dict[str, tuple]) -> dict[str, float]:
    """transfer_spike's machine-wide accounts, with `ours` every process of this run (alive now)."""
    accounts = spike.cpu_accounts()
    pids = [p.process.pid for p in (mesh.inventory, mesh.compile, mesh.dispatch, *mesh.workers.values())]
    pids += [process.pid for process, _ in servers.values()]
    accounts["ours"] = time.process_time() + sum(cpu_seconds(pid) for pid in pids)
    return accounts


def run_benchmark(nbytes: int, reps: int, command: str) -> dict:
    multihost = spike.load_multihost()
    try:
        multihost.check_permitted()
    except multihost.NetnsUnavailable as exc:
        return {"benchmark": "netns_bulk", "command": command, "skipped": str(exc)}
    started = time.perf_counter()
    result = {"benchmark": "netns_bulk", "command": command, "date": datetime.date.today().isoformat(),
              "bytes": nbytes, "reps": reps, "machine": spike.machine()}
    hosts = multihost.NetnsHosts(1)
    data_dir = Path(tempfile.mkdtemp(prefix=f"{multihost.DATA_PREFIX}{hosts.tag}-"))  # its --cleanup-stale finds it
    mesh, servers, on_interrupt = None, {}, signal.getsignal(signal.SIGINT)
    try:
        hosts.create()
        host = hosts.host(1)
        progress(f"netns {host.netns} ({host.ip}) on bridge {hosts.bridge} ({hosts.gateway}): starting the mesh")
        mesh = multihost.start_multihost_mesh(hosts, data_dir / "mesh", devices=1, emulate=EMULATE,
                                              poll_interval_s=POLL_INTERVAL_S, lost_after_polls=3)
        credentials = spike.make_credentials(data_dir / "spike", [host.ip])
        for arm, (kind, _) in BARE.items():
            servers[arm] = spike.start_server_process(kind, host.ip, credentials, nbytes,
                                                      ("ip", "netns", "exec", host.netns))
        result["topology"] = {
            "worker": f"netns {host.netns} {mesh.workers[1].address}, 1 device ({EMULATE[0]}, emulated)",
            "bare_servers": {arm: f"netns {host.netns} {host.ip}:{port}, a process" for arm, (_, port) in
                             servers.items()},
            "client": "root namespace, this process (its connections come from the bridge address "
                      f"{hosts.gateway})",
            "dispatcher": f"root namespace {mesh.dispatch.address}",
            "inventory_and_compile": f"root namespace {hosts.gateway}",
            "link": "bridge in the root namespace, veth pair to the namespace, MTU 1500",
            "security": "mutual TLS (EC P-256) everywhere but tcp; the mesh's tickets and tokens, the bare "
                        "grpc arm's bearer ticket per call"}
        progress(f"{nbytes // MIB} MiB each way x {reps} rounds of {', '.join(ARMS)}")
        result.update(measure(mesh, host, servers, credentials, nbytes, reps))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up half way
        for process, _ in servers.values():
            spike.stop_process(process)
        if mesh is not None:
            mesh.stop()
        problems = hosts.destroy()
        shutil.rmtree(data_dir, ignore_errors=True)
        signal.signal(signal.SIGINT, on_interrupt)
        for problem in problems:
            progress(f"could not remove: {problem}")
    result["machine"]["cpu_during_measurement"] = result.pop("cpu_during_measurement")
    progress("how fast this machine hands out fresh memory (common.fresh_memory)")
    result["host_fresh_memory"] = fresh_memory(min(nbytes, 256 * MIB))
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes moved each way per run, in MiB")
    parser.add_argument("--quick", action="store_true", help="32 MiB: a smoke run, not a measurement")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds of every arm (medians over them)")
    args = parser.parse_args(argv)
    nbytes = (32 if args.quick else args.mib) * MIB
    command = spike.command_line("bench/netns_bulk.py", argv)
    result = spike.interruptible(lambda: run_benchmark(nbytes, args.reps, command),
                                 "mesh, servers, namespaces and links")
    if result is None:
        return 130
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
