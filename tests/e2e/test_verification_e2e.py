"""Spot checks on a real mesh: inventory, compile and three workers as processes on 127.0.0.1,
127.0.0.2 and 127.0.0.3 (one emulated V100 each, so every shard has the same fp32 rule), the last
of which forges its outputs (tests/fakes/forging_worker.py: valid certificate, right shapes, 1000
added to half the rows); the dispatcher in this process. With verify_fraction 1 the job succeeds
with the right outputs, the forger is marked suspect (ListNodes and `accelmesh nodes list`) and
the record lists every shard verified; with 0 nothing runs twice and the forgery goes through."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from accelmesh.cli import main
from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_compile, start_inventory, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.launcher import start_service
from accelmesh.security.identity import Role
from compile_svc.programs import default_registry
from dispatch_svc.config import DispatchConfig
from dispatch_svc.server import build_dispatch

from conftest import CREDENTIALS, mesh_stub

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 120.0
MLP = "mlp_classifier"
SAME_RULE = 'type = "v100-32gb"'
FORGER_IP = "127.0.0.3"
TESTS = Path(__file__).resolve().parents[1]


def _worker_env(ip: str) -> dict[str, str]:
    """A certificate naming the node's address: the inventory registers no other."""
    tls = CREDENTIALS.issue(Role.WORKER, f"node-{ip}", [ip]).tls
    return {"ACCELMESH_CERT_FILE": str(tls.cert_file), "ACCELMESH_KEY_FILE": str(tls.key_file)}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    processes = [start_inventory(root, CREDENTIALS)]
    try:
        inventory = processes[0].address
        processes.append(compile_ := start_compile(root, CREDENTIALS))
        for ip in ("127.0.0.1", "127.0.0.2"):
            processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=1, emulate=("v100-32gb",),
                                          listen=f"{ip}:0", artifact_dir=root / f"artifacts-{ip}", name=f"worker-{ip}",
                                          nvml=False, env=_worker_env(ip)))
        processes.append(start_service("forger", "fakes.forging_worker", [
            "--listen", f"{FORGER_IP}:0", "--devices", "1", "--emulate", "v100-32gb", "--no-nvml",
            "--inventory", inventory, "--compile", compile_.address, "--artifact-dir", str(root / "artifacts-forger")],
            env={**CREDENTIALS.env(Role.WORKER), **_worker_env(FORGER_IP),
                 "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}))
        server, _ = build_dispatch(DispatchConfig(
            listen="127.0.0.1:0", inventory=inventory, compile=compile_.address, data_dir=str(root / "dispatch"),
            max_shard_bytes=32 * 1024))
        server.start()
        try:
            yield f"127.0.0.1:{server.port}", inventory
        finally:
            server.stop(0)
    finally:
        for process in reversed(processes):
            process.terminate()


def _nodes(inventory: str):
    return mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory).ListNodes(
        inv_pb.ListNodesRequest()).nodes


def _trust_every_node(inventory: str) -> None:
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory)
    for node in _nodes(inventory):
        if node.suspect:
            stub.TrustNode(inv_pb.TrustNodeRequest(address=node.address))


def reference(x: np.ndarray) -> np.ndarray:
    program = default_registry().get(MLP)
    return np.asarray(program.fn(*program.init_params(0), x)[0])


X = np.random.default_rng(7).standard_normal((1024, 64)).astype(np.float32)  # shards of at most 32 KiB


def test_with_fraction_one_the_forged_shards_run_elsewhere_and_the_forger_is_marked_suspect(mesh, capsys):
    address, inventory = mesh
    _trust_every_node(inventory)
    with MeshClient(address, security=CREDENTIALS.client()) as client:
        result = client.run(MLP, {"x": X}, filter=SAME_RULE, verify_fraction=1.0, timeout=CALL_TIMEOUT_S)
    job = result.job
    assert job.state == job_pb.JOB_STATE_SUCCEEDED, job.error
    np.testing.assert_allclose(result.outputs["logits"], reference(X), rtol=1e-4, atol=1e-4)
    assert job.verify_fraction == 1.0
    outcomes = [(s.verification.outcome, s.device_id.split("/")[0]) for s in job.shards]
    assert all(outcome == job_pb.VERIFICATION_OUTCOME_MATCHED and ip != FORGER_IP for outcome, ip in outcomes)
    assert all(not s.verification.verifier_node_address.startswith(FORGER_IP) for s in job.shards)
    forged_attempts = [f for s in job.shards for f in s.failures if FORGER_IP in f]
    assert forged_attempts  # the planner gave the forger shards, and each was found out and moved
    suspects = [n.address for n in _nodes(inventory) if n.suspect]
    assert len(suspects) == 1 and suspects[0].startswith(f"{FORGER_IP}:")
    capsys.readouterr()
    assert main(["nodes", "list", "--inventory", inventory]) == 0
    listing = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[5] for line in listing[1:4]}
    assert rows[suspects[0]] == "SUSPECT" and sorted(rows.values()) == ["SUSPECT", "no", "no"]
    assert any(line.startswith(f"{suspects[0]} is suspect since ") for line in listing[4:])
    capsys.readouterr()
    assert main(["jobs", "get", job.job_id, "--dispatch", address]) == 0
    shown = capsys.readouterr().out
    assert f"verify     fraction 1: {len(job.shards)} shard(s) sampled" in shown
    assert shown.count("matched on 127.0.0.") == len(job.shards)


def test_a_suspect_node_gets_no_shard_of_later_jobs_until_trusted(mesh):
    address, inventory = mesh
    forger = next(n.address for n in _nodes(inventory) if n.address.startswith(FORGER_IP))
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory)
    stub.MarkNodeSuspect(inv_pb.MarkNodeSuspectRequest(address=forger, reason="the test marks it"))
    with MeshClient(address, security=CREDENTIALS.client()) as client:
        job = client.run(MLP, {"x": X}, filter=SAME_RULE, timeout=CALL_TIMEOUT_S).job
    assert job.state == job_pb.JOB_STATE_SUCCEEDED, job.error
    assert all(not s.device_id.startswith(f"{FORGER_IP}/") for s in job.shards)
    _trust_every_node(inventory)


def test_with_fraction_zero_nothing_runs_twice_and_the_forgery_goes_through(mesh):
    address, inventory = mesh
    _trust_every_node(inventory)
    with MeshClient(address, security=CREDENTIALS.client()) as client:
        result = client.run(MLP, {"x": X}, filter=SAME_RULE, timeout=CALL_TIMEOUT_S)
    job = result.job
    assert job.state == job_pb.JOB_STATE_SUCCEEDED and job.verify_fraction == 0.0
    assert all(s.attempts == 1 and not s.HasField("verification") for s in job.shards)
    forged = [s for s in job.shards if s.device_id.startswith(f"{FORGER_IP}/")]
    assert forged  # what the spot checks exist for: without them the forged rows are the result
    first = forged[0]
    assert np.all(result.outputs["logits"][first.first_row: first.first_row + first.rows // 2] > 500)
    assert not any(n.suspect for n in _nodes(inventory))
