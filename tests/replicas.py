"""A mesh with two replicas of every control-plane service on one PostgreSQL and one shared data
dir, every process real: two inventories, two compile services, two dispatchers and two workers
(on 127.0.0.2 and 127.0.0.3, emulating fp32 devices, so a shard may move between them and the
result stays the same). Dispatchers and workers name both replicas of each service
(`ipv4:a:p,b:p`). Linux (/proc/locks tells which compile replica builds). Used by
tests/e2e/test_replicas.py and bench/ha.py, so the benchmark times exactly what the test asserts.
A replica killed is started again on its address.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import sqlalchemy as sa

from accelmesh.embedded import start_compile, start_dispatch, start_inventory, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role

NODE_IPS = ("127.0.0.2", "127.0.0.3")
EMULATE = ("v100-32gb", "v100-32gb")  # no bf16: the fp32 rule everywhere
POLL_INTERVAL_S = 0.5
LEASE_S = 2.0  # the dispatchers' job leases: a killed one's jobs move on within 1.25 of them
DISPATCH_ENV = {"ACCELMESH_MAX_SHARD_BYTES": str(4096), "ACCELMESH_DISPATCH_LEASE_S": str(LEASE_S)}


def both(processes) -> str:
    return "ipv4:" + ",".join(p.address for p in processes)


class Replicas:
    def __init__(self, data_dir: Path, credentials: MeshCredentials, inventory_db: str, dispatch_db: str):
        self.data_dir, self.credentials = data_dir, credentials
        self.inventory_db, self.dispatch_db = inventory_db, dispatch_db
        self.inventories, self.compiles, self.workers, self.dispatchers = [], [], [], []
        # The inventory's book, read by the test as the replicas write it (one pool for every look).
        self._inventory_engine = sa.create_engine(inventory_db.replace("postgresql://", "postgresql+psycopg://"))
        try:
            self.inventories = [self.start_inventory(i) for i in range(2)]
            self.compiles = [self.start_compile(i) for i in range(2)]
            self.workers = [self.start_worker(ip) for ip in NODE_IPS]
            self.dispatchers = [self.start_dispatch(i) for i in range(2)]
        except BaseException:
            self.stop()
            raise

    def start_inventory(self, index: int, listen: str = "127.0.0.1:0"):
        return start_inventory(self.data_dir, self.credentials, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=3,
                               db=self.inventory_db, name=f"inventory-{index}", listen=listen)

    def start_compile(self, index: int, listen: str = "127.0.0.1:0"):
        return start_compile(self.data_dir, self.credentials, name=f"compile-{index}", listen=listen)

    def start_worker(self, ip: str):
        tls = self.credentials.issue(Role.WORKER, f"node-{ip}", [ip]).tls  # a certificate naming its node
        return start_worker(both(self.inventories), both(self.compiles), self.credentials, devices=len(EMULATE),
                            emulate=EMULATE, listen=f"{ip}:0", artifact_dir=self.data_dir / f"artifacts-{ip}",
                            name=f"worker-{ip}",
                            env={"ACCELMESH_CERT_FILE": str(tls.cert_file), "ACCELMESH_KEY_FILE": str(tls.key_file)})

    def start_dispatch(self, index: int, listen: str = "127.0.0.1:0"):
        return start_dispatch(self.data_dir, both(self.inventories), both(self.compiles), self.credentials,
                              env={**DISPATCH_ENV, "ACCELMESH_DISPATCH_DB": self.dispatch_db}, name=f"dispatch-{index}",
                              listen=listen)

    def restart(self, kind: str, index: int) -> None:
        """Start replica `index` of `kind` ("inventories", "compiles", "dispatchers") again on its address."""
        replicas = getattr(self, kind)
        start = {"inventories": self.start_inventory, "compiles": self.start_compile,
                 "dispatchers": self.start_dispatch}[kind]
        replicas[index] = start(index, replicas[index].address)

    def reservations_of(self, job_id: str) -> list:
        with open_channel(self.inventories[0].address, security=self.credentials.client()) as channel:
            stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
            return list(stub.ListReservations(inv_pb.ListReservationsRequest(job_id=job_id)).reservations)

    def node_polls(self) -> dict[str, tuple[str, float]]:
        """Each node's poller (an inventory replica's id) and when it was last seen, as the book says."""
        with self._inventory_engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT address, poller, last_seen_at FROM nodes")).all()
        return {address: (poller, seen) for address, poller, seen in rows}

    def kill_an_inventory(self, index: int) -> float:
        """SIGKILL inventory replica `index` while both poll a node each; returns the gap from its last
        poll of its node to the other's first, in seconds, as the book records them."""
        wait_for(lambda: len({poller for poller, _ in self.node_polls().values()}) == 2,
                 10 * POLL_INTERVAL_S, "both inventory replicas to poll a node each")
        self.inventories[index].kill()
        killed_at = time.time()
        polls = self.node_polls()  # the dead replica's last poll of its node is in it
        after = wait_for(lambda: (p := self.node_polls()) and len({v[0] for v in p.values()}) == 1
                         and all(seen > killed_at for _, seen in p.values()) and p,
                         10 * POLL_INTERVAL_S, "one replica to poll both nodes")
        survivor = next(iter(after.values()))[0]
        orphan = next(address for address, (poller, _) in polls.items() if poller != survivor)
        return after[orphan][1] - polls[orphan][1]

    def clear_artifacts(self) -> None:
        """Empty the shared artifact store (its folder stays): the next job's artifacts are built afresh."""
        cache = self.data_dir / "artifacts"
        for entry in cache.iterdir() if cache.exists() else ():
            if entry.is_dir():
                shutil.rmtree(entry)

    def kill_the_builder(self, timeout_s: float = 60.0) -> int:
        """SIGKILL the compile replica that is building an artifact (it holds `<key>.building`'s
        lock, compile_svc/cache.py), as soon as one is; returns its index."""
        cache = self.data_dir / "artifacts"
        pids = {p.process.pid: i for i, p in enumerate(self.compiles)}
        index = wait_for(lambda: next(iter(_lock_holders(cache) & pids.keys()), None), timeout_s,
                         "a compile replica to start building")
        self.compiles[pids[index]].kill()
        return pids[index]

    def stop(self):
        for process in [*self.dispatchers, *self.workers, *self.compiles, *self.inventories]:
            process.terminate()
        self._inventory_engine.dispose()


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # looking at the database again: the book is what is measured, not a signal
    raise AssertionError(f"timed out waiting for {what}")


def _lock_holders(cache: Path) -> set[int]:
    """The processes holding a lock on a `*.building` file under `cache`, as /proc/locks lists them."""
    if not cache.exists():
        return set()
    inodes = {os.stat(p).st_ino for p in cache.rglob("*.building")}
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
        if len(fields) > 5 and fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) in inodes:
            holders.add(int(fields[4]))
    return holders


def seconds(stamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9
