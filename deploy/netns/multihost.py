#!/usr/bin/env python3
"""Several accelmesh hosts on one machine: workers in Linux network namespaces (root only).

    sudo .venv/bin/python deploy/netns/multihost.py              # 2 hosts, one job across them
    sudo .venv/bin/python deploy/netns/multihost.py --cut 1      # ... and cut host 1's link mid-job
    sudo .venv/bin/python deploy/netns/multihost.py --keep       # leave the mesh up until Ctrl-C
    sudo .venv/bin/python deploy/netns/multihost.py --cleanup-stale   # remove what a killed run left

Layout (one run; <tag> is this process's pid, <s> a free 10.231.<s>.0/24):

    root namespace: bridge ambr<tag> 10.231.<s>.1/24   inventory, compile (on that address),
                                                        dispatch (on 127.0.0.1)
      |-- veth amv<tag>h1 ==== eth0 in netns am-<tag>-h1  10.231.<s>.2  worker
      |-- veth amv<tag>h2 ==== eth0 in netns am-<tag>-h2  10.231.<s>.3  worker
      ...

Every worker serves on its namespace's address, so its device ids carry that IP. The namespaces
have no default route: they reach the bridge's subnet and nothing else. The root namespace gets
an `unreachable` route for the subnet at a low priority, so that whatever happens to the bridge,
packets for these addresses never follow the default route off the machine. A host's link is
cut by setting the root-side end of its veth down (`cut`): like a pulled cable, packets to and
from that host are dropped, nobody is told. Everything made is removed again by `destroy`
(namespaces, links, the route), also after Ctrl-C; `cleanup_stale` removes what a run killed
with SIGKILL left behind.

The test tests/e2e/test_multihost.py imports this file; it uses only the standard library and the
accelmesh packages.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from accelmesh.embedded import start_compile, start_dispatch, start_inventory
from accelmesh.runtime.launcher import ServiceProcess, start_service
from accelmesh.security.config import Security
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role

SUBNET_PREFIX = "10.231"  # private; only ever configured on the links made here
GUARD_METRIC = 65000  # the `unreachable` route's priority: the bridge's own route (metric 0) wins while it exists
LOCK_FILE = "/run/lock/accelmesh-netns.lock"  # serialises subnet choice between parallel runs
IP_TIMEOUT_S = 15.0
NETNS_PATTERN = re.compile(r"^am-(?P<tag>\d+)-h\d+$")
LINK_PATTERN = re.compile(r"^am(?:br|v)(?P<tag>\d+)(?:h\d+)?$")
DEFAULT_EMULATE = ("v100-32gb", "v100-32gb")
DATA_PREFIX = "accelmesh-multihost-"  # the script's data folder: <tmp>/accelmesh-multihost-<tag>-<random>


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot make network namespaces (not root, no `ip`, not permitted)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, ["ip", *args], result.stdout, result.stderr)
    return result


def check_permitted() -> None:
    """Raise NetnsUnavailable with the reason unless `ip netns add` works here."""
    if sys.platform != "linux":
        raise NetnsUnavailable(f"network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces and veth pairs need root (run as root or with sudo)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"am-{os.getpid()}-probe"
    result = ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` is not permitted here: {result.stderr.strip()}")
    ip("netns", "del", probe, check=False)


@dataclass(frozen=True)
class Host:
    index: int  # from 1
    netns: str
    veth: str  # the root-side end, a port of the bridge; down = this host is cut off
    ip: str


@dataclass
class NetnsHosts:
    """A bridge in the root namespace and `count` namespaces, each on it by a veth pair."""

    count: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: list[Host] = field(default_factory=list)
    gateway: str = ""  # the bridge's address: where the hosts reach the root namespace's services
    subnet: str = ""
    bridge: str = ""
    _made: list[tuple[str, ...]] = field(default_factory=list)  # undo commands, newest last

    def create(self) -> NetnsHosts:
        if not 1 <= self.count <= 250:
            raise ValueError(f"between 1 and 250 hosts, not {self.count}")
        self.bridge = f"ambr{self.tag}"
        try:
            with _lock():
                third = _free_subnet(int(self.tag))
                self.subnet = f"{SUBNET_PREFIX}.{third}.0/24"
                self.gateway = f"{SUBNET_PREFIX}.{third}.1"
                # The guard first: from here on nothing for this subnet can leave by the default route.
                self._do(("route", "add", "unreachable", self.subnet, "metric", str(GUARD_METRIC)),
                         ("route", "del", "unreachable", self.subnet, "metric", str(GUARD_METRIC)))
                self._do(("link", "add", self.bridge, "type", "bridge"), ("link", "del", self.bridge))
                ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(1, self.count + 1):
                host = Host(i, f"am-{self.tag}-h{i}", f"amv{self.tag}h{i}", f"{SUBNET_PREFIX}.{third}.{i + 1}")
                self._do(("netns", "add", host.netns), ("netns", "del", host.netns))
                self._do(("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns),
                         ("link", "del", host.veth))
                ip("link", "set", host.veth, "master", self.bridge)
                ip("link", "set", host.veth, "up")
                ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
                ip("-n", host.netns, "link", "set", "eth0", "up")
                ip("-n", host.netns, "link", "set", "lo", "up")
                self.hosts.append(host)
        except BaseException:
            self.destroy()
            raise
        return self

    def _do(self, args: tuple[str, ...], undo: tuple[str, ...]) -> None:
        ip(*args)
        self._made.append(undo)

    def host(self, index: int) -> Host:
        return self.hosts[index - 1]

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its bridge port goes down, packets either way are dropped."""
        ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        ip("link", "set", host.veth, "up")

    def destroy(self) -> list[str]:
        """Undo everything `create` made, newest first; kill anything still in a namespace.
        Returns what could not be removed (empty when all is gone)."""
        problems = []
        for undo in reversed(self._made):
            if undo[0] == "netns":
                _kill_all(ip("netns", "pids", undo[2], check=False).stdout.split())
            result = ip(*undo, check=False)
            if result.returncode != 0 and "Cannot find" not in result.stderr and "No such" not in result.stderr:
                problems.append(f"ip {' '.join(undo)}: {result.stderr.strip()}")
        self._made.clear()
        return problems

    def __enter__(self) -> NetnsHosts:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()


@contextlib.contextmanager
def _lock():
    path = LOCK_FILE if os.path.isdir(os.path.dirname(LOCK_FILE)) else os.path.join(tempfile.gettempdir(),
                                                                                    "accelmesh-netns.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _free_subnet(seed: int) -> int:
    """A third octet whose 10.231.<n>.0/24 no address or route of the root namespace uses."""
    seen = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show", "table", "all").stdout
    used = {int(n) for n in re.findall(rf"\b{re.escape(SUBNET_PREFIX)}\.(\d+)\.", seen)}
    for step in range(254):
        third = (seed + step) % 254 + 1
        if third not in used:
            return third
    raise NetnsUnavailable(f"every {SUBNET_PREFIX}.<n>.0/24 is in use on this machine")


def _kill_all(pids: Sequence[str]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes_using(address: str) -> list[int]:
    """Pids of the processes whose command line names `address:<port>` (the services of one run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if any(a.decode(errors="replace").startswith(f"{address}:") for a in args):
                pids.append(int(entry.name))
    return pids


def cleanup_stale() -> list[str]:
    """Remove what runs whose process is gone (e.g. SIGKILLed) left: the services they started,
    their namespaces, links, guard routes and data folders."""
    removed = []
    for line in ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        fields = line.split()
        match = LINK_PATTERN.match(fields[1]) if len(fields) > 3 else None
        if match and fields[1].startswith("ambr") and not _alive(int(match["tag"])):
            gateway = fields[3].split("/")[0]
            pids = _processes_using(gateway)
            _kill_all([str(p) for p in pids])
            removed += [f"process {p} (serving on {gateway})" for p in pids]
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NETNS_PATTERN.match(name)
        if match and not _alive(int(match["tag"])):
            _kill_all(ip("netns", "pids", name, check=False).stdout.split())
            ip("netns", "del", name, check=False)
            removed.append(f"netns {name}")
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        match = LINK_PATTERN.match(name)
        if match and not _alive(int(match["tag"])):
            ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    with _lock():
        routes = ip("-4", "route", "show", "type", "unreachable", check=False).stdout.splitlines()
        bridged = ip("-4", "route", "show", "proto", "kernel", check=False).stdout
        for line in routes:
            match = re.match(rf"unreachable ({re.escape(SUBNET_PREFIX)}\.\d+\.0/24) .*metric {GUARD_METRIC}\b", line)
            if match and match[1] not in bridged:
                ip("route", "del", "unreachable", match[1], "metric", str(GUARD_METRIC), check=False)
                removed.append(f"route unreachable {match[1]}")
    for folder in Path(tempfile.gettempdir()).glob(f"{DATA_PREFIX}*"):
        tag = folder.name[len(DATA_PREFIX):].split("-", 1)[0]
        if tag.isdigit() and not _alive(int(tag)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(f"folder {folder}")
    return removed


# -- processes -----------------------------------------------------------------------------------


def start_in_netns(netns: str, name: str, module: str, args: Sequence[str], *, env: dict[str, str] | None = None,
                   echo: bool = False) -> ServiceProcess:
    """`ip netns exec <netns> python -m module args`, once it printed its ready line. `ip netns exec`
    execs the command, so the process is the service itself and SIGTERM reaches it."""
    return start_service(name, module, args, env=env, echo=echo, prefix=("ip", "netns", "exec", netns))


@dataclass
class MultiHostMesh:
    hosts: NetnsHosts
    data_dir: Path
    credentials: MeshCredentials
    inventory: ServiceProcess | None = None
    compile: ServiceProcess | None = None
    dispatch: ServiceProcess | None = None
    workers: dict[int, ServiceProcess] = field(default_factory=dict)  # by host index

    def stop(self) -> None:
        """SIGTERM to every process at once, then wait for each (SIGKILL after its grace)."""
        processes = [p for p in [self.dispatch, *self.workers.values(), self.compile, self.inventory] if p is not None]
        for process in processes:
            if process.process.poll() is None:
                process.process.send_signal(signal.SIGTERM)
        for process in processes:
            process.terminate()

    @property
    def client(self) -> Security:
        """What a program on this machine calls the mesh with: the client certificate, the operator's token."""
        return self.credentials.client()

    def __enter__(self) -> MultiHostMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def worker_certificate(credentials: MeshCredentials, host: Host) -> dict[str, str]:
    """The environment giving host `host`'s worker its own certificate, for the host's IP: the
    inventory registers, and it and dispatch answer, only a node whose worker's certificate names it."""
    return credentials.env(Role.WORKER, credentials.worker(host.ip))


def start_multihost_mesh(
    hosts: NetnsHosts, data_dir: str | Path, *, devices: int = 2, emulate: Sequence[str] = DEFAULT_EMULATE,
    poll_interval_s: float = 0.25, lost_after_polls: int = 2, dispatch_env: dict[str, str] | None = None,
    worker_env: dict[str, str] | None = None, echo: bool = False,
) -> MultiHostMesh:
    """Inventory and compile service on the bridge address (the hosts reach them there), the
    dispatcher on loopback (only clients on this machine call it), one worker in every host.

    Mutual TLS as in production, from a throwaway CA of this mesh's own under `data_dir`: the
    inventory's and compile service's certificates also name the bridge address, which clients
    on this machine dial, and each worker's names its host's IP."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    credentials = MeshCredentials(data_dir / "credentials", hosts=[hosts.gateway])
    mesh = MultiHostMesh(hosts, data_dir, credentials)
    try:
        mesh.inventory = start_inventory(data_dir, credentials, listen=f"{hosts.gateway}:0",
                                         poll_interval_s=poll_interval_s, lost_after_polls=lost_after_polls, echo=echo)
        mesh.compile = start_compile(data_dir, credentials, listen=f"{hosts.gateway}:0", echo=echo)

        def worker(host: Host) -> ServiceProcess:
            # Workers fetch artifacts from --compile only: the bridge address, which they reach.
            args = ["--listen", f"{host.ip}:0", "--devices", str(devices), "--inventory", mesh.inventory.address,
                    "--compile", mesh.compile.address, "--artifact-dir", str(data_dir / f"worker-h{host.index}")]
            if emulate:
                args += ["--emulate", ",".join(emulate)]
            return start_in_netns(host.netns, f"worker-h{host.index}", "worker_svc", args,
                                  env={**worker_certificate(credentials, host), **(worker_env or {})}, echo=echo)

        with ThreadPoolExecutor(max_workers=len(hosts.hosts)) as pool:
            futures = {host.index: pool.submit(worker, host) for host in hosts.hosts}
            failures = []
            for index, future in futures.items():
                try:
                    mesh.workers[index] = future.result()
                except Exception as exc:  # noqa: BLE001 - the others are kept so stop() ends them
                    failures.append(exc)
            if failures:
                raise failures[0]
        mesh.dispatch = start_dispatch(data_dir, mesh.inventory.address, mesh.compile.address, credentials,
                                       echo=echo, env=dispatch_env)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def node_ip(device_id: str) -> str:
    return device_id.split("/", 1)[0]


# -- the interactive run -------------------------------------------------------------------------


def _print(*args) -> None:
    print(*args, flush=True)


def run_job(mesh: MultiHostMesh, rows: int, *, cut: Host | None, seed: int = 0,
            log: Callable[[str], None] = _print) -> int:
    import numpy as np

    from accelmesh.cli.demo import print_shards
    from accelmesh.cli.tables import table
    from accelmesh.client import MeshClient
    from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
    from accelmesh.dispatch.v1 import job_pb2 as job_pb
    from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
    from accelmesh.inventory.v1 import inventory_service_pb2_grpc
    from accelmesh.runtime.channels import open_channel
    from compile_svc.programs import default_registry

    x = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    started = time.monotonic()
    marks: dict[str, float] = {}
    with (MeshClient(mesh.dispatch.address, security=mesh.client) as client,
          open_channel(mesh.inventory.address, security=mesh.client) as channel):
        inventory = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        job_id = client.submit("mlp_classifier", {"x": x}, name="multihost")
        log(f"job {job_id}: mlp_classifier over {rows} rows ({x.nbytes / 2**20:.0f} MiB)")
        final = None
        for response in client.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=900):
            event = response.event
            now = time.monotonic()
            if event.type == job_pb.JOB_EVENT_TYPE_PLANNED:
                log(f"  planned: {event.message}")
            if (cut is not None and "cut" not in marks and event.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED
                    and node_ip(event.shard.device_id) == cut.ip):
                mesh.hosts.cut(cut)
                marks["cut"] = now
                log(f"  {now - started:6.2f} s  CUT host {cut.index} ({cut.ip}): {cut.veth} down, "
                    f"while shard {event.shard.index} runs there")
                log("           (a dispatcher without gRPC keepalive notices a silent host only at the shard "
                    "deadline, dispatch_svc/dataplane/workers.py SHARD_TIMEOUT_S; Ctrl-C stops and cleans up)")
            if event.type == job_pb.JOB_EVENT_TYPE_SHARD_RETRIED:
                marks.setdefault("retry", now)
                log(f"  {now - started:6.2f} s  {event.message}")
            if event.type in (job_pb.JOB_EVENT_TYPE_SUCCEEDED, job_pb.JOB_EVENT_TYPE_FAILED,
                              job_pb.JOB_EVENT_TYPE_CANCELLED):
                final = event
                outcome = job_pb.JobEventType.Name(event.type)[15:].lower()
                log(f"  {now - started:6.2f} s  job {outcome}: {event.message}")
                break
        total = time.monotonic() - started
        job = client.get(job_id)
        by_ip: dict[str, list[int]] = {}
        for shard in job.shards:
            by_ip.setdefault(node_ip(shard.device_id), []).append(shard.rows)
        log("\nshard placement (by the host that ran each shard last):")
        names = {h.ip: f"host {h.index} ({h.netns})" for h in mesh.hosts.hosts}
        log(table([("HOST", "IP", "SHARDS", "ROWS")]
                  + [(names.get(k, "?"), k, str(len(v)), str(sum(v))) for k, v in sorted(by_ip.items())]))
        retried = [s for s in job.shards if s.attempts > 1]
        log("")
        print_shards(job, limit=8)
        for shard in retried[:8]:
            log(f"shard {shard.index}: {shard.attempts} attempts, ran on {shard.device_id}; "
                f"failed: {'; '.join(shard.failures)}")
        if len(retried) > 8:
            log(f"... {len(retried)} shards were retried in all")
        status = 1
        if final is not None and final.type == job_pb.JOB_EVENT_TYPE_SUCCEEDED:
            program = default_registry().get("mlp_classifier")
            (expected,) = [np.asarray(o) for o in program.fn(*program.init_params(0), x)]
            logits = client.fetch_result(job_id)["logits"]
            error = float(np.max(np.abs(logits - expected)))
            log(f"\nlargest difference to a single-device run: {error:.2e}")
            status = 0 if np.allclose(logits, expected, rtol=1e-4, atol=1e-5) else 1
        log(f"job total {total:.2f} s")
        if "cut" in marks:
            if "retry" in marks:
                log(f"cut -> first shard retried elsewhere: {marks['retry'] - marks['cut']:.2f} s")
            nodes = inventory.ListNodes(inv_pb.ListNodesRequest()).nodes
            for node in nodes:
                log(f"inventory: node {node.address} {inv_pb.NodeState.Name(node.state)[11:].lower()}")
    return status


def print_mesh(mesh: MultiHostMesh, log: Callable[[str], None] = _print) -> None:
    from accelmesh.cli.inventory import list_all_devices
    from accelmesh.cli.tables import format_devices, table
    from accelmesh.inventory.v1 import inventory_service_pb2_grpc
    from accelmesh.runtime.channels import open_channel

    log(table([("HOST", "NETNS", "LINK (root side)", "IP", "WORKER")]
              + [(str(h.index), h.netns, h.veth, h.ip, mesh.workers[h.index].address) for h in mesh.hosts.hosts]))
    log(f"\ninventory {mesh.inventory.address}   compile {mesh.compile.address}   dispatch {mesh.dispatch.address}\n")
    with open_channel(mesh.inventory.address, security=mesh.client) as channel:
        log(format_devices(list_all_devices(inventory_service_pb2_grpc.InventoryServiceStub(channel))))
    log("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2, help="namespaces, one worker each (default 2)")
    parser.add_argument("--devices", type=int, default=2, help="XLA CPU devices per worker (default 2)")
    parser.add_argument("--emulate", default=",".join(DEFAULT_EMULATE), help="catalog types per worker")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the mlp_classifier job (256 B each)")
    parser.add_argument("--max-shard-bytes", type=int, default=256 * 1024,
                        help="the dispatcher's ACCELMESH_MAX_SHARD_BYTES: small gives many shards")
    parser.add_argument("--cut", type=int, nargs="?", const=1, default=None, metavar="HOST",
                        help="cut this host's link (default 1) once a shard of the job starts there")
    parser.add_argument("--poll-interval", type=float, default=0.25, help="inventory poll interval, s")
    parser.add_argument("--lost-after", type=int, default=2, help="missed polls before a node is lost")
    parser.add_argument("--keep", action="store_true", help="after the job, keep the mesh up until Ctrl-C")
    parser.add_argument("--no-job", action="store_true", help="only set up (with --keep: a mesh to play with)")
    parser.add_argument("--echo", action="store_true", help="show the services' output")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="remove namespaces, links and routes of earlier runs that were killed, then exit")
    args = parser.parse_args(argv)

    try:
        check_permitted()
    except NetnsUnavailable as exc:
        print(f"multihost: {exc}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        for item in cleanup_stale():
            print(f"removed {item}")
        return 0
    if args.cut is not None and not 1 <= args.cut <= args.hosts:
        parser.error(f"--cut names host {args.cut}; hosts are 1..{args.hosts}")

    def stop_on_signal(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGINT too: a shell starts background jobs with it ignored, and they must still clean up.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    emulate = tuple(p.strip() for p in args.emulate.split(",") if p.strip())
    hosts = NetnsHosts(args.hosts)
    mesh = None
    data_dir = tempfile.mkdtemp(prefix=f"{DATA_PREFIX}{hosts.tag}-")
    status = 0
    try:
        hosts.create()
        _print(f"{args.hosts} host(s) on bridge {hosts.bridge} {hosts.gateway}/24; starting the mesh ...")
        mesh = start_multihost_mesh(hosts, data_dir, devices=args.devices, emulate=emulate,
                                    poll_interval_s=args.poll_interval, lost_after_polls=args.lost_after,
                                    dispatch_env={"ACCELMESH_MAX_SHARD_BYTES": str(args.max_shard_bytes)},
                                    echo=args.echo)
        print_mesh(mesh)
        if not args.no_job:
            status = run_job(mesh, args.rows, cut=hosts.host(args.cut) if args.cut else None)
        if args.keep:
            _print("the mesh is up; Ctrl-C tears it down")
            signal.pause()
    except KeyboardInterrupt:
        _print("\ninterrupted")
        status = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up half way
        if mesh is not None:
            mesh.stop()
        problems = hosts.destroy()
        shutil.rmtree(data_dir, ignore_errors=True)
        for problem in problems:
            print(f"multihost: could not remove: {problem}", file=sys.stderr)
        _print("namespaces, links and processes removed" if not problems else "clean-up incomplete (see above)")
    return status


if __name__ == "__main__":
    sys.exit(main())
