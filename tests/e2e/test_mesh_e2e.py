"""The embedded mesh as real processes: CLI, health, reflection, a killed worker, restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh, start_inventory, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.security.config import INSECURE
from accelmesh.security.identity import certificate_identity

from conftest import CREDENTIALS, mesh_stub
from fakes import host

POLL_INTERVAL_S = 0.25
LOST_AFTER = 2
POLL_TIMEOUT_S = 2.0  # the inventory's default DescribeNode deadline
# A killed node is lost after LOST_AFTER missed polls; each costs at most an interval plus the deadline.
LOST_WINDOW_S = LOST_AFTER * (POLL_INTERVAL_S + POLL_TIMEOUT_S) + POLL_INTERVAL_S
EMULATE = ("a100-80gb", "v100-32gb")
DEVICES = ["127.0.0.1/cpu:2", "127.0.0.1/cpu:3", "127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(
        tmp_path_factory.mktemp("mesh"), devices=4, emulate=EMULATE,
        poll_interval_s=POLL_INTERVAL_S, lost_after_polls=LOST_AFTER,
    ) as running:
        yield running


def stub_for(address):
    channel = open_channel(address)
    return channel, inventory_service_pb2_grpc.InventoryServiceStub(channel)


def test_cli_prints_the_device_table(mesh):
    out = subprocess.run(
        [sys.executable, "-m", "accelmesh.cli", "devices", "--inventory", mesh.inventory.address],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    for device_id in DEVICES:
        assert device_id in out
    assert "a100-80gb" in out and "(emulated on cpu:0)" in out and "healthy" in out


def test_cli_reports_an_unreachable_inventory_clearly():
    result = subprocess.run(
        [sys.executable, "-m", "accelmesh.cli", "devices", "--inventory", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    assert "nothing answers at that address: start the mesh with `accelmesh up`" in result.stderr


def test_cli_shows_reservations_and_the_jobs_holding_each_device(mesh):
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, mesh.inventory.address)
    stub.ReserveDevices(pb.ReserveDevicesRequest(
        job_id="holder", claims=[pb.DeviceClaim(device_id="127.0.0.1/cuda:1", memory_bytes=2 * 2**30)], ttl_seconds=60))
    try:
        out = cli("devices", "--inventory", mesh.inventory.address)
    finally:
        stub.ReleaseDevices(pb.ReleaseDevicesRequest(job_id="holder"))
    head, *rows = out.splitlines()
    assert head.split()[-5:] == ["UTIL", "TFLOP/s", "fp32|bf16", "HEALTH", "JOBS"] and "RESERVED GiB" in head
    (held,) = [row for row in rows if row.startswith("127.0.0.1/cuda:1 ")]
    assert held.split()[-1] == "holder" and " 2.0 " in held
    assert all(row.split()[-1] == "-" for row in rows if not row.startswith("127.0.0.1/cuda:1 "))


def test_cli_names_a_filter_value_that_no_device_has(mesh):
    result = subprocess.run([sys.executable, "-m", "accelmesh.cli", "devices", "--inventory", mesh.inventory.address,
                             "--filter", 'type = "a100-80g"'], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert 'no device has type "a100-80g"; the types known are: a100-80gb, cpu, v100-32gb' in result.stderr


@pytest.mark.parametrize("service", ["", "accelmesh.inventory.v1.InventoryService"])
def test_inventory_health_answers_per_service(mesh, service):
    with open_channel(mesh.inventory.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("process, service", [("inventory", "accelmesh.inventory.v1.InventoryService"),
                                               ("worker", "accelmesh.worker.v1.WorkerService")])
def test_reflection_lists_every_service(mesh, process, service):
    address = mesh.inventory.address if process == "inventory" else mesh.workers[0].address
    with open_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    names = {s.name for s in answer.list_services_response.service}
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def wait_for(stream, kind, expected_ids):
    seen = set()
    for event in stream:
        if event.type == kind:
            seen.add(event.device.id)
        if seen >= set(expected_ids):
            return seen
    raise AssertionError(f"stream ended before {kind} of {sorted(set(expected_ids) - seen)}")


def test_a_killed_worker_is_lost_within_the_window_and_recovers_when_it_returns(mesh):
    channel, stub = stub_for(mesh.inventory.address)
    with channel:
        assert [d.id for d in stub.ListDevices(pb.ListDevicesRequest()).devices] == DEVICES
        stream = stub.WatchDevices(pb.WatchDevicesRequest(), timeout=60)
        port = mesh.workers[0].address.rsplit(":", 1)[1]
        killed_at = time.monotonic()
        mesh.workers[0].process.send_signal(signal.SIGKILL)
        wait_for(stream, pb.DEVICE_EVENT_TYPE_LOST, DEVICES)
        assert time.monotonic() - killed_at < LOST_WINDOW_S
        assert stub.ListDevices(pb.ListDevicesRequest()).devices == []
        (node,) = stub.ListNodes(pb.ListNodesRequest()).nodes
        assert node.state == pb.NODE_STATE_LOST and node.missed_polls >= LOST_AFTER
        # The CLI shows them, marked, unless asked to hide them.
        shown = cli("devices", "--inventory", mesh.inventory.address)
        assert all(f"{device_id} " in shown for device_id in DEVICES) and shown.count("LOST") == len(DEVICES)
        hidden = cli("devices", "--inventory", mesh.inventory.address, "--hide-lost")
        assert not any(device_id in hidden for device_id in DEVICES)

        mesh.workers[0] = start_worker(mesh.inventory.address, mesh.compile.address, mesh.credentials, devices=4,
                                       emulate=EMULATE, listen=f"127.0.0.1:{port}")
        wait_for(stream, pb.DEVICE_EVENT_TYPE_RECOVERED, DEVICES)
        stream.cancel()
        assert [d.id for d in stub.ListDevices(pb.ListDevicesRequest()).devices] == DEVICES


def test_inventory_stops_gracefully_and_keeps_its_database(mesh):
    # Reserving and releasing are the dispatcher's: a stub entitled to each method.
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, mesh.inventory.address)
    stub.ReserveDevices(pb.ReserveDevicesRequest(
        job_id="persist", claims=[pb.DeviceClaim(device_id="127.0.0.1/cuda:0", memory_bytes=10**9)], ttl_seconds=3600))
    assert mesh.inventory.terminate() == 0  # SIGTERM: drained and exited cleanly
    mesh.inventory = start_inventory(mesh.data_dir, mesh.credentials, poll_interval_s=POLL_INTERVAL_S,
                                     lost_after_polls=LOST_AFTER)
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, mesh.inventory.address)
    assert [d.id for d in stub.ListDevices(pb.ListDevicesRequest()).devices] == DEVICES
    held = stub.ListReservations(pb.ListReservationsRequest(job_id="persist")).reservations
    assert [(r.device_id, r.memory_bytes) for r in held] == [("127.0.0.1/cuda:0", 10**9)]
    stub.ReleaseDevices(pb.ReleaseDevicesRequest(job_id="persist"))


def cli(*args) -> str:
    return subprocess.run([sys.executable, "-m", "accelmesh.cli", *args], capture_output=True, text=True,
                          timeout=120, check=True).stdout


def test_cli_lists_programs_and_rules(mesh):
    programs = cli("programs", "--compile", mesh.compile.address)
    assert "transformer_encoder" in programs and "mlp_train_step" in programs
    rules = cli("rules", "--compile", mesh.compile.address)
    assert "cuda-bf16" in rules and "default-fp32" in rules and "first match wins" in rules


def test_cli_compiles_for_catalog_types_and_for_the_inventory(mesh):
    out = cli("compile", "mlp_classifier", "--target", "a100-80gb", "--target", "tpu-v4", "--target", "v100-32gb",
              "--compile", mesh.compile.address)
    assert "3 target type(s)" in out
    assert "cuda:a100-80gb[bf16]" in out and "tpu:tpu-v4[bf16]" in out and "cuda:v100-32gb[]" in out
    out = cli("compile", "mlp_classifier", "--from-inventory", "--inventory", mesh.inventory.address,
              "--batch-size", "8", "--compile", mesh.compile.address)
    # An emulated A100, an emulated V100 and two plain CPU devices: the CPUs share one build.
    assert "for 4 device(s), 3 target type(s)" in out
    assert "executable b=8" in out and "cpu:2,cpu:3" in out


# The rule the worker's CPU gets: the tests' host is the fixture CPU (fakes/host.py).
HOST_CPU_RULES = {host.FP32_CPU: "cpu-avx2", host.BF16_CPU: "cpu-amx-bf16", host.ARM_CPU: "default-fp32"}


def test_cli_compiles_for_the_cpu_as_its_worker_describes_it(mesh):
    out = cli("compile", "mlp_classifier", "--target", "cpu", "--inventory", mesh.inventory.address,
              "--compile", mesh.compile.address)
    rules = {line.split()[1] for line in out.splitlines() if line.startswith("cpu:cpu[")}  # TARGET TYPE, RULE, ...
    assert rules == {HOST_CPU_RULES[host.chosen_cpu()]}, out


def test_an_insecure_mesh_runs_a_job_in_plaintext(tmp_path):
    """`accelmesh up --insecure`: no certificates, so no roles; every service still calls the next."""
    x = np.zeros((8, 64), np.float32)
    with start_embedded_mesh(tmp_path, devices=1, emulate=("v100-32gb",), insecure=True) as insecure:
        assert insecure.client is INSECURE and not (tmp_path / "credentials").exists()
        with MeshClient(insecure.dispatch.address, security=insecure.client) as client:
            assert client.run("mlp_classifier", {"x": x}).job.state == job_pb.JOB_STATE_SUCCEEDED


def test_each_start_on_one_data_dir_forgets_the_workers_of_earlier_runs(tmp_path):
    """Each `accelmesh up` starts its worker on a new port, so a new node: the last run's, gone with
    it, is removed at the start instead of being polled as lost until the inventory forgets it."""
    with start_embedded_mesh(tmp_path, devices=1, emulate=("v100-32gb",), nvml=False) as first:
        earlier = first.workers[0].address
    with start_embedded_mesh(tmp_path, devices=1, emulate=("v100-32gb",), nvml=False) as second:
        with open_channel(second.inventory.address, security=second.client) as channel:
            nodes = inventory_service_pb2_grpc.InventoryServiceStub(channel).ListNodes(pb.ListNodesRequest()).nodes
        assert [n.address for n in nodes] == [second.workers[0].address]
        assert second.workers[0].address != earlier


@pytest.mark.parametrize("module, args, env, words", [
    # A database that cannot be reached: named, without its password.
    ("inventory_svc", ["--db", "postgresql://u:s3cret@/x?host=/nonexistent"], {}, "postgresql://u:***@/x"),
    ("dispatch_svc", ["--db", "postgresql://u:s3cret@/x?host=/nonexistent"], {}, "postgresql://u:***@/x"),
    ("dispatch_svc", ["--db", "mysql://u@db/x"], {}, "'mysql' is not supported"),
    ("dispatch_svc", [], {"ACCELMESH_INFLIGHT_BYTES": "lots"}, "ACCELMESH_INFLIGHT_BYTES"),
    ("compile_svc", [], {"ACCELMESH_MAX_UPLOAD_BYTES": "1"}, "ACCELMESH_MAX_UPLOAD_BYTES"),
])
def test_a_service_with_bad_configuration_exits_naming_the_setting(module, args, env, words):
    import os

    result = subprocess.run([sys.executable, "-m", module, "--listen", "127.0.0.1:0", *args], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr


def test_an_embedded_worker_on_another_host_registers_and_is_polled_with_its_nodes_own_certificate(tmp_path):
    """Per-node worker certificates in the embedded mesh: a worker started on 127.0.0.2 runs with a
    certificate of its own for that host, which the inventory's dial to it (at registration, and
    each poll) verifies; the loopback worker's certificate would be refused there."""
    inventory = start_inventory(tmp_path, CREDENTIALS)
    try:
        worker = start_worker(inventory.address, "127.0.0.1:1", CREDENTIALS, devices=1, listen="127.0.0.2:0",
                              nvml=False, artifact_dir=tmp_path / "worker-artifacts")
        try:
            channel, stub = stub_for(inventory.address)
            with channel:
                (device,) = stub.ListDevices(pb.ListDevicesRequest()).devices
                refreshed = stub.RefreshDevices(pb.RefreshDevicesRequest(device_ids=[device.id]), timeout=30)
        finally:
            worker.terminate()
    finally:
        inventory.terminate()
    assert worker.address.startswith("127.0.0.2:") and device.node_address == worker.address
    assert [d.id for d in refreshed.devices] == [device.id]
    identity = certificate_identity(CREDENTIALS.worker("127.0.0.2").tls.cert_file.read_bytes())
    assert identity.name == "node-127.0.0.2" and not identity.names_host("127.0.0.1")
