"""A client in another language: clients/node/run_job.js (@grpc/grpc-js + @grpc/proto-loader on the
repo's own .proto files, no generated code) runs mlp_classifier through a real mesh, and its
logits equal a single-device run of the same program in Python; clients/node/plan_layers.js plans
a layer table of its own with PlanJob and reports the server's errors by status name. Both connect
with mutual TLS and the caller's token (clients/node/credentials.js), given by the ACCELMESH_*_FILE
variables or an ACCELMESH_CREDENTIALS_DIR folder.

The test installs the Node client's locked dependencies (`npm ci`) when they are missing or
older than package-lock.json; it is skipped only when `node` or `npm` is not on PATH."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.security.identity import Role
from compile_svc.programs import default_registry

from fakes import host

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
DEVICE_ID = re.compile(r"^\d+\.\d+\.\d+\.\d+/(cuda|cpu|rocm|tpu):\d+$")
ROWS = 600
FEATURES = 64
NPM_TIMEOUT_S = 300
RUN_TIMEOUT_S = 120
GB = 10**9
DECODER_LAYERS = ["embed", *(f"block_{i}" for i in range(12)), "head"]  # plan_layers.js's built-in table


@pytest.fixture(scope="module")
def node_client() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        missing = " and ".join(name for name, path in (("node", node), ("npm", npm)) if path is None)
        pytest.skip(f"{missing} not on PATH: install Node.js (>= 18, with npm) to test clients/node")
    installed = NODE_CLIENT / "node_modules" / ".package-lock.json"  # written by every npm install/ci
    lock = NODE_CLIENT / "package-lock.json"
    # Two test runs at once must not both rewrite node_modules: install under an exclusive lock.
    with open(Path(tempfile.gettempdir()) / "accelmesh-node-client-npm.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
            result = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True,
                                    text=True, timeout=NPM_TIMEOUT_S, env={**os.environ, **host.registry_env()})
            assert result.returncode == 0, f"npm ci failed in {NODE_CLIENT}:\n{result.stdout}\n{result.stderr}"
    return NODE_CLIENT


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # One emulated V100 (the cuda-fp32 rule) and one CPU device: fp32 rules reproduce the reference.
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb",)) as running:
        yield running


def bare_env() -> dict[str, str]:
    """This process's environment without its ACCELMESH_* settings (the session's credentials folder)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ACCELMESH_")}, "NO_COLOR": "1"}


def node_env(mesh, **overrides: str) -> dict[str, str]:
    """The environment the Node scripts run in: the mesh's client credentials, each file named by its variable."""
    return {**bare_env(), **mesh.credentials.env(Role.CLIENT), **overrides}


def node_inputs(rows: int) -> np.ndarray:
    """The batch run_job.js builds: x[i][j] = ((i*64 + j) % 17) / 17, rounded to float32."""
    return ((np.arange(rows * FEATURES) % 17) / 17).astype(np.float32).reshape(rows, FEATURES)


def test_node_client_runs_a_job_and_matches_the_single_device_reference(node_client, mesh):
    result = subprocess.run(
        ["node", "run_job.js", mesh.dispatch.address, "--rows", str(ROWS)],
        cwd=node_client, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=node_env(mesh),
    )
    assert result.returncode == 0, f"run_job.js failed ({result.returncode}):\n{result.stderr}"
    (line,) = result.stdout.splitlines()
    out = json.loads(line)

    assert out["state"] == "JOB_STATE_SUCCEEDED"
    assert out["device_ids"] and all(DEVICE_ID.match(d) for d in out["device_ids"]), out["device_ids"]
    assert sum(s["rows"] for s in out["shards"]) == ROWS
    planned = {d for t in out["targets"] for d in t["device_ids"]}
    assert set(out["device_ids"]) <= planned

    # The job the Node client reports is the dispatcher's job, as Python sees it.
    with MeshClient(mesh.dispatch.address) as client:
        job = client.get(out["job_id"])
    assert job.state == job_pb.JOB_STATE_SUCCEEDED and job.spec.program == "mlp_classifier"
    assert [s.device_id for s in job.shards] == out["device_ids"]

    program = default_registry().get("mlp_classifier")
    (expected,) = program.fn(*program.init_params(0), node_inputs(ROWS))  # the mesh's parameter_seed is 0
    expected = np.asarray(expected)
    logits = np.asarray(out["logits"], dtype=np.float32)
    assert out["logits_shape"] == [ROWS, 10] and logits.shape == expected.shape
    dtypes = {t["compute_dtype"] for t in out["targets"]}
    if dtypes == {"fp32"}:
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
    else:  # a host CPU with bf16 units gets a bf16 rule: hold it to that rule's tolerance instead
        assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 5e-2, out["targets"]


def test_node_client_exits_non_zero_when_the_job_cannot_run(node_client, mesh):
    result = subprocess.run(
        ["node", "run_job.js", mesh.dispatch.address, "--rows", "4", "--filter", 'type = "no-such-type"'],
        cwd=node_client, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=node_env(mesh),
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "FAILED_PRECONDITION" in result.stderr and "no-such-type" in result.stderr


def plan_layers(node_client: Path, mesh, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["node", "plan_layers.js", mesh.dispatch.address, *args], cwd=node_client,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,  # tests check the exit
                          env=env or node_env(mesh))


def test_node_client_plans_its_built_in_decoder_with_every_layer_placed(node_client, mesh):
    # The files from the folder alone, as after `accelmesh up` with ACCELMESH_CREDENTIALS_DIR set.
    folder_only = {**bare_env(), "ACCELMESH_CREDENTIALS_DIR": str(mesh.credentials.folder)}
    result = plan_layers(node_client, mesh, "--strategy", "auto", "--explain", env=folder_only)
    assert result.returncode == 0, f"plan_layers.js failed ({result.returncode}):\n{result.stderr}"
    (line,) = result.stdout.splitlines()
    out = json.loads(line)

    assert 100e6 < out["parameter_count"] < 130e6, "the header documents a ~110 M parameter decoder"
    assert [x["layer"] for x in out["layers"]] == DECODER_LAYERS
    assert [x["order"] for x in out["layers"]] == list(range(len(DECODER_LAYERS)))
    devices = {d["device_id"]: d for d in out["devices"]}
    assert all(x["device_id"] in devices and DEVICE_ID.match(x["device_id"]) for x in out["layers"]), out["layers"]
    assert len(devices) == out["device_count"] >= 1
    runs_on = {}  # a replicated stage's devices each hold its layers
    for stage in out["stages"]:
        for device_id in [stage["device_id"], *stage["replica_device_ids"]]:
            runs_on.setdefault(device_id, set()).add(stage["device_id"])
    assert set(runs_on) == set(devices)
    for device_id, device in devices.items():
        on_it = [x for x in out["layers"] if x["device_id"] in runs_on[device_id]]
        assert device["layers"] == [x["layer"] for x in on_it]
        assert sum(x["memory_bytes"] for x in on_it) <= device["memory_bytes"] <= device["memory_capacity_bytes"]

    candidates = {c["strategy"]: c for c in out["candidates"]}
    assert set(candidates) == {"PLACEMENT_STRATEGY_RANKED", "PLACEMENT_STRATEGY_BALANCED"}
    assert all(c["feasible"] for c in candidates.values()), out["candidates"]
    assert out["strategy"] in candidates, "auto reports the strategy it took, never AUTO"
    assert out["predicted_step_seconds"] == min(c["predicted_step_seconds"] for c in candidates.values())
    assert out["predicted_step_seconds"] >= out["lower_bound_step_seconds"] > 0
    taken = out["strategy"].removeprefix("PLACEMENT_STRATEGY_").lower()
    assert f"auto: took {taken}" in result.stderr, result.stderr  # --explain: the planner's steps on stderr


@pytest.mark.parametrize("rows, code, message", [
    ([{"name": "a", "order": 0, "parameter_count": 10, "parameter_bytes": 40},
      {"name": "a", "order": 1, "parameter_count": 10, "parameter_bytes": 40}],
     "INVALID_ARGUMENT", "spec.placement.layers[1].name 'a' is also spec.placement.layers[0].name"),
    ([{"name": f"l{i}", "order": i, "parameter_count": 250 * GB, "parameter_bytes": 1000 * GB,
       "flops_per_sample": 500 * GB, "activation_bytes_per_sample": 4096} for i in range(3)],
     "RESOURCE_EXHAUSTED", "short by"),
], ids=["duplicate-name", "too-large"])
def test_node_client_reports_a_refused_table_by_status_name(node_client, mesh, tmp_path, rows, code, message):
    table = tmp_path / "layers.json"
    table.write_text(json.dumps(rows))
    result = plan_layers(node_client, mesh, "--layers", str(table), "--strategy", "auto")
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert f"plan_layers.js: {code}: " in result.stderr and message in result.stderr, result.stderr


@pytest.mark.parametrize("script", ["run_job.js", "plan_layers.js"])
@pytest.mark.parametrize("variable", ["ACCELMESH_CA_FILE", "ACCELMESH_CERT_FILE", "ACCELMESH_KEY_FILE",
                                      "ACCELMESH_TOKEN_FILE"])
def test_node_client_names_the_variable_of_a_missing_credentials_file(node_client, mesh, tmp_path, script, variable):
    env = node_env(mesh, **{variable: str(tmp_path / "gone")})
    result = subprocess.run(["node", script, mesh.dispatch.address], cwd=node_client, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, check=False, env=env)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{script}: {variable} names {tmp_path / 'gone'}") and "ENOENT" in line, line


def test_node_client_refuses_a_token_the_mesh_does_not_accept(node_client, mesh, tmp_path):
    token = tmp_path / "token"
    token.write_text("not-a-token-of-this-mesh\n")
    result = plan_layers(node_client, mesh, env=node_env(mesh, ACCELMESH_TOKEN_FILE=str(token)))
    assert result.returncode == 1 and result.stdout == ""
    assert "plan_layers.js: UNAUTHENTICATED: " in result.stderr, result.stderr
    assert "ACCELMESH_TOKEN_FILE" in result.stderr  # the server's details say what to check
