"""Metrics for Prometheus through a real mesh: the inventory and the dispatcher (in this process,
each serving /metrics over TLS on a port of its own), a compile service and a one-device worker
as processes. Scraped as Prometheus would, with a client certificate of the mesh CA: the device,
reservation, queue and job series are there and move as a job waits in the queue and then runs;
a scrape without a certificate is refused; fifty idle TCP connections to each endpoint keep no
scrape from being answered; and every series the Grafana dashboard in deploy/ plots is one the
services export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_compile, start_worker
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.security.identity import Role
from compile_svc.programs.builtin import IDENTITY_WIDTH
from dispatch_svc.config import DispatchConfig
from dispatch_svc.server import build_dispatch
from inventory_svc.config import InventoryConfig
from inventory_svc.server import build_inventory

from conftest import CREDENTIALS, mesh_stub, scrape, scraper_context, value

pytestmark = pytest.mark.slow

WAIT_S = 60.0
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "accelmesh.json"
# PromQL words that are not series names.
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "max", "min", "avg", "count", "le", "without", "irate",
                "increase", "or", "and", "on", "ignoring", "clamp_min", "time"}


@dataclasses.dataclass
class Mesh:
    dispatch: str
    inventory: object  # stub with the dispatch role
    scrape: dict  # service -> URL of its /metrics


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    inventory_server, _ = build_inventory(InventoryConfig(
        listen="127.0.0.1:0", db=str(root / "inventory.db"), poll_interval_s=0.5, metrics_listen="127.0.0.1:0"))
    inventory_server.start()
    inventory = f"127.0.0.1:{inventory_server.port}"
    processes = []
    try:
        processes.append(compile_ := start_compile(root, CREDENTIALS))
        processes.append(start_worker(inventory, compile_.address, CREDENTIALS, devices=1, emulate=("v100-32gb",),
                                      nvml=False, artifact_dir=root / "worker-artifacts"))
        dispatch_server, _ = build_dispatch(DispatchConfig(
            listen="127.0.0.1:0", inventory=inventory, compile=compile_.address, data_dir=str(root / "dispatch"),
            queue_poll_s=0.1, metrics_listen="127.0.0.1:0"))
        dispatch_server.start()
        try:
            yield Mesh(f"127.0.0.1:{dispatch_server.port}",
                       mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, inventory),
                       {"inventory": f"https://localhost:{inventory_server.metrics.port}/metrics",
                        "dispatch": f"https://localhost:{dispatch_server.metrics.port}/metrics"})
        finally:
            dispatch_server.stop(0)
    finally:
        for process in reversed(processes):
            process.terminate()
        inventory_server.stop(0)


@dataclasses.dataclass
class Activity:
    """Scrapes of every service before a job, while it waits in the queue, and after it ran."""

    device: object
    free: int
    before: dict
    waiting: dict
    after: dict
    job: object


@pytest.fixture(scope="module")
def activity(mesh) -> Activity:
    """A job that finds the device full (a reservation of the test's), waits, and runs once it is freed."""
    device = mesh.inventory.ListDevices(inv_pb.ListDevicesRequest()).devices[0]
    before = {service: scrape(url) for service, url in mesh.scrape.items()}
    free = device.status.memory_free_bytes
    mesh.inventory.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id="occupier", ttl_seconds=300, claims=[
        inv_pb.DeviceClaim(device_id=device.id, memory_bytes=free, compute_fraction=1.0)]))
    waiting = {}

    def on_event(event):
        if event.type == job_pb.JOB_EVENT_TYPE_QUEUED and not waiting:
            waiting.update({service: scrape(url) for service, url in mesh.scrape.items()})
            mesh.inventory.ReleaseDevices(inv_pb.ReleaseDevicesRequest(job_id="occupier"))

    with MeshClient(mesh.dispatch) as client:
        result = client.run("identity", {"x": np.ones((8, IDENTITY_WIDTH), np.float32)}, on_event=on_event,
                            timeout=WAIT_S)
    after = {service: scrape(url) for service, url in mesh.scrape.items()}
    return Activity(device, free, before, waiting, after, result.job)


def test_the_device_queue_and_job_series_move_as_a_job_waits_and_runs(activity):
    device, before, waiting, after = activity.device, activity.before, activity.waiting, activity.after
    inventory = before["inventory"]
    assert value(inventory, "accelmesh_device_up", device=device.id, modelName=device.kind) == 1
    assert value(inventory, "DCGM_FI_DEV_FB_FREE", device=device.id, gpu="0") > 0
    assert value(inventory, "accelmesh_device_memory_reserved_bytes", device=device.id) == 0
    assert value(inventory, "accelmesh_inventory_poll_cycle_seconds_count") >= 1
    assert value(before["dispatch"], "accelmesh_queue_jobs") == 0

    assert activity.job.state == job_pb.JOB_STATE_SUCCEEDED
    assert value(waiting["dispatch"], "accelmesh_queue_jobs", priority="0") == 1
    assert value(waiting["inventory"], "accelmesh_device_memory_reserved_bytes", device=device.id) == activity.free
    assert value(waiting["inventory"], "accelmesh_reservations") == 1

    dispatch = after["dispatch"]
    assert value(dispatch, "accelmesh_queue_jobs") == 0
    assert value(dispatch, "accelmesh_queue_wait_seconds_count") == 1
    assert value(dispatch, "accelmesh_job_seconds_count", state="succeeded") == 1
    assert value(dispatch, "accelmesh_jobs_ended_total", state="succeeded") == 1
    target = activity.job.plan.targets[0].target_type
    assert value(dispatch, "accelmesh_shard_seconds_count", target_type=target) >= 1


def test_a_scrape_without_a_mesh_certificate_is_refused(mesh):
    anonymous = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.OPERATOR).tls.ca_file))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(mesh.scrape["dispatch"], context=anonymous, timeout=WAIT_S).read()


def test_idle_sockets_on_every_endpoint_keep_no_scrape_from_being_answered(mesh):
    """Fifty connections that never handshake, to each service's /metrics, used to hold its one accepting thread."""
    with contextlib.ExitStack() as idle:
        for url in mesh.scrape.values():
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            for _ in range(50):
                idle.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        for service, url in mesh.scrape.items():
            # A loaded CI machine answers within 5 s; an endpoint held by an idle socket never does.
            with urllib.request.urlopen(url, context=scraper_context(), timeout=5) as response:
                text = response.read().decode()
            assert f'service_name="accelmesh-{service}"' in text


def test_every_series_the_dashboard_plots_is_exported(activity):
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    assert len(expressions) >= 10
    exported = {key.partition("{")[0] for samples in activity.after.values() for key in samples}
    for expr in expressions:
        # Label matchers, ranges, strings and grouping label lists are not series names.
        cleaned = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without|on|ignoring)\s*\([^)]*\)', " ", expr)
        names = {word for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", cleaned) if word not in PROMQL_WORDS}
        assert names, expr
        missing = sorted(names - exported)
        assert not missing, f"the dashboard plots {missing} ({expr}), which no service exports"
