"""Workers on separate hosts made with Linux network namespaces and veth pairs (root only):
device ids carry each host's IP, a job spans the hosts, and a host whose link is cut mid-job is
survived like a crash. The hosts are built by deploy/netns/multihost.py, the script a user runs,
which gives the mesh a CA of its own (its certificates name the bridge and host addresses)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from compile_svc.programs import default_registry

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns" / "multihost.py"
DEVICES_PER_HOST = 2
POLL_INTERVAL_S = 0.25
LOST_AFTER = 2
POLL_TIMEOUT_S = 2.0  # the inventory's DescribeNode deadline: a cut link makes each poll last this long
LOST_WINDOW_S = LOST_AFTER * (POLL_INTERVAL_S + POLL_TIMEOUT_S) + POLL_INTERVAL_S + 2.0  # + slack for a busy machine
RECOVERY_BOUND_S = 30.0  # from the cut to the job's end; a crashed worker (connection reset) costs well under 1 s
SHARD_BYTES = 256 * 1024  # the dispatcher's ACCELMESH_MAX_SHARD_BYTES: 1,024 rows of 64 floats
# A cut link makes no error: the dispatcher notices through gRPC keepalive (accelmesh/runtime/config.py).
ENVIRONMENT_REFUSALS = ("Operation not permitted", "Permission denied", "not supported", "Unknown device type",
                        "Cannot open network namespace")


class NotRecovered(AssertionError):
    """The job did not end within RECOVERY_BOUND_S of the cut."""


def load_multihost():
    spec = importlib.util.spec_from_file_location("accelmesh_netns_multihost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def multihost():
    module = load_multihost()
    try:
        module.check_permitted()
    except module.NetnsUnavailable as exc:
        pytest.skip(f"needs Linux network namespaces: {exc}")
    return module


@pytest.fixture(scope="module")
def lab(multihost, tmp_path_factory):
    hosts = multihost.NetnsHosts(2)
    try:
        hosts.create()
    except subprocess.CalledProcessError as exc:
        if any(words in (exc.stderr or "") for words in ENVIRONMENT_REFUSALS):
            pytest.skip(f"this machine refuses `{' '.join(exc.cmd)}`: {exc.stderr.strip()}")
        raise
    mesh = None
    try:
        mesh = multihost.start_multihost_mesh(
            hosts, tmp_path_factory.mktemp("multihost"), devices=DEVICES_PER_HOST,
            emulate=("v100-32gb",) * DEVICES_PER_HOST, poll_interval_s=POLL_INTERVAL_S, lost_after_polls=LOST_AFTER,
            dispatch_env={"ACCELMESH_MAX_SHARD_BYTES": str(SHARD_BYTES)})
        yield multihost, hosts, mesh
    finally:
        if mesh is not None:
            mesh.stop()
        problems = hosts.destroy()
        namespaces = multihost.ip("netns", "list", check=False).stdout.split()
        links = re.findall(r"^\d+: ([^:@]+)", multihost.ip("-o", "link", "show", check=False).stdout, re.MULTILINE)
        left = [n for n in namespaces if n.startswith(f"am-{hosts.tag}-")]
        left += [n for n in links if n == hosts.bridge or n.startswith(f"amv{hosts.tag}h")]
        assert not problems and not left, f"clean-up left {problems + left}"


@pytest.fixture
def inventory(lab):
    _, _, mesh = lab
    with open_channel(mesh.inventory.address, security=mesh.client) as channel:  # the mesh's own CA
        yield inventory_service_pb2_grpc.InventoryServiceStub(channel)


def reference(x: np.ndarray) -> np.ndarray:
    program = default_registry().get("mlp_classifier")
    (logits,) = program.fn(*program.init_params(0), x)
    return np.asarray(logits)


def node_ip(device_id: str) -> str:
    return device_id.split("/", 1)[0]


def test_each_hosts_devices_carry_its_own_ip(lab, inventory):
    _, hosts, mesh = lab
    devices = inventory.ListDevices(inv_pb.ListDevicesRequest()).devices
    expected = {f"{h.ip}/cuda:{i}" for h in hosts.hosts for i in range(DEVICES_PER_HOST)}
    assert {d.id for d in devices} == expected
    assert len({h.ip for h in hosts.hosts}) == 2  # two hosts, two addresses
    assert all(d.type == "v100-32gb" and "emulated" in d.kind for d in devices)
    nodes = inventory.ListNodes(inv_pb.ListNodesRequest()).nodes
    assert sorted((n.ip, n.address) for n in nodes) == sorted(
        (h.ip, mesh.workers[h.index].address) for h in hosts.hosts)
    assert all(n.address.startswith(f"{n.ip}:") and n.state == inv_pb.NODE_STATE_ACTIVE for n in nodes)


def test_a_job_spans_both_hosts_and_matches_one_device(lab):
    _, hosts, mesh = lab
    x = np.random.default_rng(11).standard_normal((40_000, 64)).astype(np.float32)
    with MeshClient(mesh.dispatch.address, security=mesh.client) as client:
        result = client.run("mlp_classifier", {"x": x}, timeout=120)
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED
    shards = result.job.shards
    assert len(shards) >= 30 and sum(s.rows for s in shards) == 40_000
    assert {node_ip(s.device_id) for s in shards} == {h.ip for h in hosts.hosts}
    assert all(s.done and s.attempts == 1 for s in shards)
    np.testing.assert_allclose(result.outputs["logits"], reference(x), rtol=1e-5, atol=1e-6)


def watch_for_lost(inventory, address: str, deadline: float, seen: dict) -> None:
    """Record when the inventory reports the node's devices lost (a WatchDevices event, no polling)."""
    stream = inventory.WatchDevices(inv_pb.WatchDevicesRequest(filter=f'node = "{address}"'),
                                    timeout=max(0.1, deadline - time.monotonic()))
    try:
        for event in stream:
            if event.type == inv_pb.DEVICE_EVENT_TYPE_LOST:
                seen["lost"] = time.monotonic()
                return
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        stream.cancel()


def test_a_host_cut_off_mid_job_is_survived_like_a_crash(lab, inventory):
    """One scenario from the cut to the job's end (watchers, the cut, the retries, the restore),
    kept in one function so its timeline reads in order."""
    _, hosts, mesh = lab
    cut = hosts.host(1)
    cut_address = mesh.workers[cut.index].address
    # 391 shards, 98 a device: enough that the cut host still has shards to run when the test, reading
    # the job's events, cuts it (with 98 shards in all, a fast machine had finished that host's share).
    x = np.random.default_rng(12).standard_normal((400_000, 64)).astype(np.float32)
    marks: dict[str, float] = {}
    events = []
    watcher = None
    try:
        with MeshClient(mesh.dispatch.address, security=mesh.client) as client:
            started = time.monotonic()
            job_id = client.submit("mlp_classifier", {"x": x}, timeout=120)
            stream = client.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=60)
            for response in stream:  # until a shard starts on the host to cut
                events.append(response.event)
                if (response.event.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED
                        and node_ip(response.event.shard.device_id) == cut.ip):
                    break
            hosts.cut(cut)
            marks["cut"] = time.monotonic()
            stream.cancel()
            watcher = threading.Thread(target=watch_for_lost,
                                       args=(inventory, cut_address, marks["cut"] + LOST_WINDOW_S, marks),
                                       daemon=True)
            watcher.start()
            final = None
            try:
                remaining = marks["cut"] + RECOVERY_BOUND_S - time.monotonic()
                for response in client.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, from_index=len(events)),
                                                      timeout=remaining):
                    events.append(response.event)
                    if response.event.type == job_pb.JOB_EVENT_TYPE_SHARD_RETRIED:
                        marks.setdefault("retried", time.monotonic())
                    if response.event.type in (job_pb.JOB_EVENT_TYPE_SUCCEEDED, job_pb.JOB_EVENT_TYPE_FAILED,
                                               job_pb.JOB_EVENT_TYPE_CANCELLED):
                        final = response.event
                        marks["end"] = time.monotonic()
                        break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            watcher.join()
            # The inventory's part works whatever the dispatcher does: the node is lost in its window.
            assert "lost" in marks, f"the inventory did not mark {cut_address} lost within {LOST_WINDOW_S:.1f} s"
            assert [d.id for d in inventory.ListDevices(inv_pb.ListDevicesRequest()).devices] == [
                f"{hosts.host(2).ip}/cuda:{i}" for i in range(DEVICES_PER_HOST)]
            if final is None:
                job = client.cancel(job_id)  # frees the calls stuck on the cut host
                stuck = [s.index for s in job.shards if not s.done and node_ip(s.device_id) == cut.ip]
                raise NotRecovered(f"the job had not ended {RECOVERY_BOUND_S:.0f} s after host {cut.index}'s link was "
                                   f"cut; shards {stuck} still wait on {cut.ip}")
            assert final.type == job_pb.JOB_EVENT_TYPE_SUCCEEDED, final.message
            job = client.get(job_id)
            logits = client.fetch_result(job_id)["logits"]
        # fp32 sums round differently at different shard sizes (XLA on the CPU): among 4,000,000
        # logits of magnitude ~3, a few differ by 1e-6 or so from the one-device run.
        np.testing.assert_allclose(logits, reference(x), rtol=1e-5, atol=1e-5)
        retried = [s for s in job.shards if s.attempts > 1]
        assert retried, "no shard was in flight on the cut host"
        for shard in retried:
            assert node_ip(shard.device_id) != cut.ip and shard.done
            assert shard.failures and all(node_ip(f.split(": ", 1)[0]) == cut.ip for f in shard.failures)
        assert len(job.shards) == len(job.plan.shards) and all(s.done for s in job.shards)
        print(f"cut after {marks['cut'] - started:.2f} s; node lost after {marks['lost'] - marks['cut']:.2f} s; "
              f"first retry after {marks['retried'] - marks['cut']:.2f} s; "
              f"job ended {marks['end'] - marks['cut']:.2f} s "
              f"after the cut ({marks['end'] - started:.2f} s in all); {len(retried)} shard(s) retried")

        hosts.restore(cut)  # the cable is back: the inventory finds the node again
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            nodes = {n.address: n.state for n in inventory.ListNodes(inv_pb.ListNodesRequest()).nodes}
            if nodes[cut_address] == inv_pb.NODE_STATE_ACTIVE:
                break
            time.sleep(0.1)
        assert nodes[cut_address] == inv_pb.NODE_STATE_ACTIVE
    finally:
        hosts.restore(cut)
        if watcher is not None:
            watcher.join()
