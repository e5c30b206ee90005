"""Shared fixtures: real in-process servers on port 0, fake hardware where this machine has none.

Before anything else, the environment becomes the tests' host (fakes/host.py): a fixture CPU
chosen by ACCELMESH_TEST_CPU, no GPU, none of the real host's settings. Security is on as in
production: one throwaway mesh CA for the session (ACCELMESH_CREDENTIALS_DIR), so every process a
test starts presents its role's certificate and the tests call as the local operator.
"""

from __future__ import annotations

from fakes import host

TEST_CPU = host.isolate()

import atexit
import contextlib
import dataclasses
import itertools
import os
import shutil
import ssl
import tempfile
import urllib.request

import grpc
import pytest

from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role
from inventory_svc.config import InventoryConfig
from inventory_svc.server import build_inventory
from worker_svc.agent import NodeAgent
from worker_svc.config import WorkerConfig
from worker_svc.server import build_worker

from fakes.nvml import FakeNvml

CREDENTIALS = MeshCredentials(tempfile.mkdtemp(prefix="accelmesh-test-credentials-"))
os.environ["ACCELMESH_CREDENTIALS_DIR"] = str(CREDENTIALS.folder)
atexit.register(shutil.rmtree, CREDENTIALS.folder, ignore_errors=True)


def as_role(role: Role):
    """Open-channel keywords for calling as one of the mesh's own services (the worker's Execute is
    the dispatcher's to call, RegisterNode a worker's)."""
    return {"security": CREDENTIALS.service(role)}


def _access_tables():
    from compile_svc.server import ACCESS as compile_access
    from dispatch_svc.server import ACCESS as dispatch_access
    from inventory_svc.server import ACCESS as inventory_access
    from worker_svc.server import ACCESS as worker_access

    return {"InventoryServiceStub": inventory_access, "CompileServiceStub": compile_access,
            "DispatchServiceStub": dispatch_access, "WorkerServiceStub": worker_access}


_CALLER_CHANNELS: dict[tuple[str, Role], grpc.Channel] = {}


def _caller_security(role: Role):
    return CREDENTIALS.client() if role in (Role.OPERATOR, Role.USER) else CREDENTIALS.service(role)


class EntitledStub:
    """A stub that calls each method with a credential the server's own access table allows it:
    the local operator's token where people may call, else the certificate of a service that may
    (RegisterNode as a worker, DescribeNode as the inventory, Execute as the dispatcher). For tests of
    what a service does; tests of who may call it pick their credentials themselves."""

    def __init__(self, stub_class, address: str):
        self._stub_class, self._address = stub_class, address
        self._access = _access_tables()[stub_class.__name__]

    def __getattr__(self, method: str):
        allowed = self._access[method]
        role = Role.OPERATOR if Role.OPERATOR in allowed else sorted(allowed, key=lambda r: r.value)[0]
        key = (self._address, role)
        if key not in _CALLER_CHANNELS:
            _CALLER_CHANNELS[key] = open_channel(self._address, security=_caller_security(role))
        return getattr(self._stub_class(_CALLER_CHANNELS[key]), method)


def mesh_stub(stub_class, address: str) -> EntitledStub:
    return EntitledStub(stub_class, address)


def pytest_report_header(config):
    return f"fixture CPU: {TEST_CPU} ({host.TEST_CPU_ENV}; one of {', '.join(host.FIXTURE_CPUS)}), no GPU"


class FakeJaxDevice:
    """Stands in for a jax CPU device: these tests describe nodes, they run nothing."""

    def __init__(self, id: int, platform: str = "cpu", device_kind: str = "cpu"):
        self.id, self.platform, self.device_kind = id, platform, device_kind

    def memory_stats(self):
        return None


class TickClock:
    """A clock that advances one second per reading, so every sample is newer than the last."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._ticks = itertools.count(start)

    def __call__(self) -> float:
        return next(self._ticks)


def make_worker(emulate=("a100-80gb", "v100-32gb"), cpu_devices=3, *, hostname="node-a", tracer_provider=None,
                listen="127.0.0.1:0", clock=None, cpu: str | None = None):
    """An in-process worker whose CPU is fixture `cpu` (default: the one ACCELMESH_TEST_CPU chose)."""
    agent = NodeAgent(
        "127.0.0.1",
        emulate=emulate,
        jax_devices=[FakeJaxDevice(i) for i in range(cpu_devices)],
        nvml=FakeNvml([]),
        proc_root=str(host.proc_root(cpu)),
        env={},
        hostname=hostname,
        clock=clock or TickClock(),
    )
    return build_worker(WorkerConfig(listen=listen), agent=agent, tracer_provider=tracer_provider).start()


@pytest.fixture
def worker():
    server = make_worker()
    yield server
    server.stop(0)


@pytest.fixture
def inventory_factory(tmp_path):
    """Build inventories on one database file; each is stopped at the end."""
    started = []

    def build(tracer_provider=None, **overrides):
        config = InventoryConfig(listen="127.0.0.1:0", db=str(tmp_path / "inventory.db"), **overrides)
        server, inventory = build_inventory(config, tracer_provider=tracer_provider, start_poller=False)
        started.append(server.start())
        return server, inventory

    yield build
    for server in started:
        server.stop(0)


@pytest.fixture
def inventory(inventory_factory):
    return inventory_factory()


@pytest.fixture
def inventory_stub(inventory):
    server, _ = inventory
    return mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, f"127.0.0.1:{server.port}")


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def reservations(mesh) -> list:
    """Every live reservation in a running mesh's inventory."""
    from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb

    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, mesh.inventory.address)
    return list(stub.ListReservations(inv_pb.ListReservationsRequest()).reservations)


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory (VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def reset_peak_rss(pid: int) -> int:
    """Start a new peak for a process of this user (proc(5): writing 5 to clear_refs sets VmHWM
    to VmRSS); returns that resident memory, the new peak's baseline."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")
    return peak_rss_bytes(pid)


# -- databases: the store and job-book suites run on SQLite and on a real PostgreSQL server ----------

_POSTGRES: list = []  # the session's server, started by the first test that asks


def _postgres_server():
    import postgres

    if not _POSTGRES:
        binaries = postgres.find_binaries()
        if binaries is None:
            if os.environ.get(postgres.REQUIRE_ENV) == "1":
                pytest.fail(f"{postgres.REQUIRE_ENV}=1 but no PostgreSQL server binaries were found "
                            "(apt-get install postgresql)")
            pytest.skip(postgres.HOW_TO_ENABLE)
        server = postgres.PostgresServer(binaries)
        atexit.register(server.stop)
        _POSTGRES.append(server)
    return _POSTGRES[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A fresh, empty database of each engine: a SQLite file, then a database on the test server."""
    if request.param == "sqlite":
        return str(tmp_path / "db.sqlite")
    return _postgres_server().database()


@pytest.fixture
def postgres_url():
    """A fresh database on the test PostgreSQL server (for tests of what only it does)."""
    return _postgres_server().database()


@dataclasses.dataclass
class DispatchClients:
    """The dispatcher's compiler and workers clients, with its certificate: what sends a shard
    without a dispatcher (no inventory needed)."""

    compiler: object
    workers: object

    @classmethod
    def open(cls, compile_address: str, *, max_message_bytes: int = 16 << 20, chunk_bytes: int = 1 << 20):
        from dispatch_svc.clients.compiler import GrpcCompiler
        from dispatch_svc.dataplane.workers import GrpcWorkers

        security = CREDENTIALS.service(Role.DISPATCH)
        return cls(GrpcCompiler(compile_address, security, max_message_bytes=max_message_bytes),
                   GrpcWorkers(security, max_message_bytes=max_message_bytes, chunk_bytes=chunk_bytes))

    def close(self) -> None:
        self.compiler.close()
        self.workers.close()


@contextlib.contextmanager
def small_mesh(root, *, emulate=("v100-32gb",), worker_env=None, **dispatch_options):
    """An inventory, a compile service and a worker with one CPU device per `emulate` profile, as
    processes (`worker_env`: added to the worker's environment), and a dispatcher in this process
    (`dispatch_options`: DispatchConfig fields), so a test may reach its runner, status page and
    metrics. Yields (the dispatch MeshServer, the inventory's address, an InventoryService stub
    entitled to every method)."""
    from accelmesh.embedded import start_compile, start_inventory, start_worker
    from dispatch_svc.config import DispatchConfig
    from dispatch_svc.server import build_dispatch

    processes = [start_inventory(root, CREDENTIALS)]
    try:
        inventory = processes[0].address
        processes.append(compile_ := start_compile(root, CREDENTIALS))
        processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=len(emulate), emulate=emulate,
                                      nvml=False, artifact_dir=root / "worker-artifacts", env=worker_env))
        server, _ = build_dispatch(DispatchConfig(listen="127.0.0.1:0", inventory=inventory, compile=compile_.address,
                                                  data_dir=str(root / "dispatch"), **dispatch_options))
        server.start()
        try:
            yield server, inventory, mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory)
        finally:
            server.stop(0)
    finally:
        for process in reversed(processes):
            process.terminate()


# -- metrics, read as Prometheus reads them ------------------------------------------------------

SCRAPE_TIMEOUT_S = 60.0


def scraper_context() -> ssl.SSLContext:
    """What Prometheus is given: the mesh CA and a certificate of its own from it."""
    tls = CREDENTIALS.issue(Role.OPERATOR, "prometheus").tls
    context = ssl.create_default_context(cafile=str(tls.ca_file))
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return context


def scrape(url: str) -> dict[str, float]:
    """Every sample as "name{labels}" -> value (labels as Prometheus prints them)."""
    with urllib.request.urlopen(url, context=scraper_context(), timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


_NO_DEFAULT = object()


def value(samples: dict[str, float], name: str, default=_NO_DEFAULT, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`; `default` when there is none (a
    counter not counted yet), else an assertion error."""
    total, found = 0.0, False
    for key, sample in samples.items():
        series, _, rest = key.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total, found = total + sample, True
    if not found and default is not _NO_DEFAULT:
        return default
    assert found, f"no {name} {labels} in the scrape"
    return total
