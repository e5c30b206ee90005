"""Shared by the fault tests on a real mesh: an inventory, a compile service, a dispatcher and
two worker processes on their own loopback addresses (127.0.0.2 and 127.0.0.3: device ids carry
the node IP, so two workers on one machine need two IPs). Both emulate the same fp32 device
type, so a shard may move between them and the result still equals a one-device run. A module
of its own, not a conftest.py: a second conftest.py would shadow the top-level one that tests
import as `conftest`. Each fixture is defined as `<name>_fixture` with name="<name>", so a test
module that imports it can take `<name>` as a parameter without shadowing the import."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import (
    EmbeddedMesh,
    start_compile,
    start_dispatch,
    start_inventory,
    start_worker,
)
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role
from compile_svc.programs import default_registry

from conftest import CREDENTIALS, scrape, value

NODE_IPS = ("127.0.0.2", "127.0.0.3")
EMULATE = ("v100-32gb", "v100-32gb")  # no bf16: the fp32 rule, so a moved shard changes nothing
POLL_INTERVAL_S = 0.25
LOST_AFTER = 2
POLL_TIMEOUT_S = 2.0  # the inventory's default DescribeNode deadline
# A killed node is lost after LOST_AFTER missed polls; each costs at most an interval plus the deadline.
LOST_WINDOW_S = LOST_AFTER * (POLL_INTERVAL_S + POLL_TIMEOUT_S) + POLL_INTERVAL_S
# 32 token rows (4 KiB) a shard: a 512-row job is 16 shards, 4 a device, so there is always a shard
# in flight to cancel.
DISPATCH_ENV = {"ACCELMESH_MAX_SHARD_BYTES": str(4096)}
TOKENS = np.random.default_rng(7).integers(0, 512, size=(4096, 32), dtype=np.int32)
JOB_ROWS = 512
# Each worker serves /metrics on its own loopback address, this port (the tests read its shard count).
METRICS_PORT = 9464


@functools.cache
def node_certificate(ip: str) -> dict[str, str]:
    """A worker certificate naming `ip`: the inventory registers only a node its worker's certificate names."""
    tls = CREDENTIALS.issue(Role.WORKER, f"node-{ip}", [ip]).tls
    return {"ACCELMESH_CERT_FILE": str(tls.cert_file), "ACCELMESH_KEY_FILE": str(tls.key_file)}


def start_node(mesh: EmbeddedMesh, ip: str, port: int | str = 0):
    return start_worker(mesh.inventory.address, mesh.compile.address, mesh.credentials, devices=len(EMULATE),
                        emulate=EMULATE, listen=f"{ip}:{port}", artifact_dir=mesh.data_dir / "worker-artifacts",
                        name=f"worker-{ip}",
                        env={**node_certificate(ip), "ACCELMESH_METRICS_LISTEN": f"{ip}:{METRICS_PORT}"})


def shards_run(mesh: EmbeddedMesh) -> float:
    """The shards both workers have run so far, as their /metrics count them."""
    return sum(value(scrape(f"https://{ip}:{METRICS_PORT}/metrics"), "accelmesh_worker_shards_total",
                     default=0.0) for ip in NODE_IPS)


def port_of(process) -> str:
    return process.address.rsplit(":", 1)[1]


@pytest.fixture(scope="module", name="mesh")
def mesh_fixture(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("faults")
    inventory = start_inventory(data_dir, CREDENTIALS, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=LOST_AFTER)
    with EmbeddedMesh(data_dir, inventory, CREDENTIALS) as running:
        running.compile = start_compile(data_dir, CREDENTIALS)
        running.workers = [start_node(running, ip) for ip in NODE_IPS]
        running.dispatch = start_dispatch(data_dir, inventory.address, running.compile.address, CREDENTIALS,
                                          env=DISPATCH_ENV)
        with MeshClient(running.dispatch.address) as client:  # builds and loads the 32-row executable everywhere
            client.run("transformer_encoder", {"tokens": TOKENS[:128]})
        yield running


@pytest.fixture(name="pool")
def pool_fixture(mesh):
    """The mesh with both workers up (a test that failed half-way may have left one dead)."""
    for index, ip in enumerate(NODE_IPS):
        if mesh.workers[index].process.poll() is not None:
            mesh.workers[index] = start_node(mesh, ip, port_of(mesh.workers[index]))
    return mesh


@pytest.fixture(name="client")
def client_fixture(pool):
    with MeshClient(pool.dispatch.address) as c:
        yield c


@pytest.fixture(scope="module", name="expected")
def expected_fixture():
    """The encoder's logits for TOKENS[:JOB_ROWS] computed on one device in this process."""
    import jax

    program = default_registry().get("transformer_encoder")
    (logits,) = jax.jit(program.fn)(*program.init_params(0), TOKENS[:JOB_ROWS])
    return np.asarray(logits)


def inventory_stub(mesh):
    channel = open_channel(mesh.inventory.address)
    return channel, inventory_service_pb2_grpc.InventoryServiceStub(channel)


def node_state(mesh, address: str) -> int:
    channel, stub = inventory_stub(mesh)
    with channel:
        return next(n.state for n in stub.ListNodes(inv_pb.ListNodesRequest()).nodes if n.address == address)


def seconds(stamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def await_shards_running(client: MeshClient, job_id: str, finished: int) -> None:
    """Until `finished` of the job's shards have finished (so others are running)."""
    for event in client.watch(job_id):
        finished -= event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED
        if finished <= 0:
            return
    raise AssertionError(f"job {job_id} ended before {finished} more shards finished")
