"""The InventoryService RPCs through a real in-process server on port 0: payloads and status codes.
The reservation RPCs (ReserveDevices, ReleaseDevices, RenewReservations, ListReservations) are
tested in test_inventory_reservations.py."""

from __future__ import annotations

import base64
import json

import grpc
import pytest
from _inventory_helpers import GB, claim, device_ids, register

from accelmesh.common.v1 import common_pb2
from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc

from conftest import make_worker, mesh_stub, rpc_error
from fakes import host

pytestmark = pytest.mark.fixture_cpu


def test_register_node_stores_devices_identified_by_ip_platform_and_index(inventory_stub, worker):
    response = register(inventory_stub, worker)
    assert response.node.address == f"127.0.0.1:{worker.port}"
    assert response.node.state == pb.NODE_STATE_ACTIVE
    ids = sorted(d.id for d in response.devices)
    assert ids == ["127.0.0.1/cpu:2", "127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]
    a100 = next(d for d in response.devices if d.type == "a100-80gb")
    assert a100.emulated and a100.execution_device == "cpu:0" and "emulated" in a100.kind
    assert "bf16" in a100.capabilities and a100.performance.peak_tflops["bf16"] == pytest.approx(312)
    assert a100.health == common_pb2.DEVICE_HEALTH_HEALTHY
    assert a100.node_address == response.node.address
    nodes = inventory_stub.ListNodes(pb.ListNodesRequest()).nodes
    assert [(n.address, n.device_count, n.hostname) for n in nodes] == [(response.node.address, 3, "node-a")]


@pytest.mark.parametrize(
    "address, code, words",
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "address"),
        ("no-port", grpc.StatusCode.INVALID_ARGUMENT, "host:port"),
        ("127.0.0.1:1", grpc.StatusCode.UNAVAILABLE, "did not answer"),
    ],
)
def test_register_node_rejects_bad_or_unreachable_addresses(inventory_stub, address, code, words):
    error = rpc_error(inventory_stub.RegisterNode, pb.RegisterNodeRequest(address=address))
    assert error.code() == code
    assert words in error.details()
    assert inventory_stub.ListNodes(pb.ListNodesRequest()).nodes == []


# The worker's CPU device (cpu:2) has bf16 exactly when the fixture CPU the test gives it has.
CPU_FILTER_CASES = [(host.FP32_CPU, ["127.0.0.1/cuda:0"]), (host.BF16_CPU, ["127.0.0.1/cpu:2", "127.0.0.1/cuda:0"])]


@pytest.fixture(params=CPU_FILTER_CASES, ids=[cpu for cpu, _ in CPU_FILTER_CASES])
def worker_on_cpu(request):
    """A worker on a fixture CPU chosen by the test, and which of its devices have bf16."""
    cpu, bf16_devices = request.param
    server = make_worker(cpu=cpu)
    yield server, bf16_devices
    server.stop(0)


def test_list_devices_pages_and_filters(inventory_stub, worker_on_cpu):
    worker, bf16_devices = worker_on_cpu
    register(inventory_stub, worker)
    first = inventory_stub.ListDevices(pb.ListDevicesRequest(page_size=2))
    assert len(first.devices) == 2 and first.next_page_token
    second = inventory_stub.ListDevices(pb.ListDevicesRequest(page_size=2, page_token=first.next_page_token))
    assert len(second.devices) == 1 and not second.next_page_token
    assert [d.id for d in [*first.devices, *second.devices]] == sorted(device_ids(inventory_stub))
    assert device_ids(inventory_stub, "capabilities:bf16") == bf16_devices
    assert device_ids(inventory_stub, 'platform = "cuda" AND free_memory_bytes >= 50000000000') == ["127.0.0.1/cuda:0"]
    assert device_ids(inventory_stub, "emulated = false") == ["127.0.0.1/cpu:2"]


@pytest.mark.parametrize(
    "request_fields, words",
    [
        ({"page_size": -1}, "page_size"),
        ({"filter": "platform ="}, "filter"),
        ({"filter": 'platform = "quantum"'}, "platform"),
        ({"filter": "capabilities:warp_drive"}, "warp_drive"),
        ({"filter": "colour = red"}, "colour"),
        ({"page_token": "not-a-token"}, "page_token"),
    ],
)
def test_list_devices_rejects_malformed_requests_naming_the_field(inventory_stub, worker, request_fields, words):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.ListDevices, pb.ListDevicesRequest(**request_fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in error.details()


def test_page_token_is_bound_to_its_filter(inventory_stub, worker):
    register(inventory_stub, worker)
    token = inventory_stub.ListDevices(pb.ListDevicesRequest(page_size=1)).next_page_token
    error = rpc_error(inventory_stub.ListDevices,
                      pb.ListDevicesRequest(page_size=1, page_token=token, filter="capabilities:bf16"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "different filter" in error.details()


@pytest.mark.parametrize("after", [{"x": 1}, 7, ["a"], None])
def test_a_crafted_page_token_is_refused_naming_the_field(inventory_stub, worker, after):
    """A token that decodes and names the right filter, but whose page end is not an id."""
    register(inventory_stub, worker)
    token = inventory_stub.ListDevices(pb.ListDevicesRequest(page_size=1)).next_page_token
    payload = json.loads(base64.urlsafe_b64decode(token))
    crafted = base64.urlsafe_b64encode(json.dumps({**payload, "after": after}).encode()).decode()
    error = rpc_error(inventory_stub.ListDevices, pb.ListDevicesRequest(page_size=1, page_token=crafted))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in error.details()


def test_get_device_returns_status_history_newest_first(inventory, inventory_stub, worker):
    register(inventory_stub, worker)
    _, domain = inventory
    domain.poll_all()
    domain.poll_all()
    response = inventory_stub.GetDevice(pb.GetDeviceRequest(device_id="127.0.0.1/cuda:1", history_limit=10))
    assert response.device.type == "v100-32gb"
    times = [h.sample_time.ToNanoseconds() for h in response.history]
    assert len(times) == 3 and times == sorted(times, reverse=True)
    assert response.device.status.sample_time.ToNanoseconds() == times[0]


@pytest.mark.parametrize(
    "device_id, code",
    [
        ("127.0.0.1/cuda:9", grpc.StatusCode.NOT_FOUND),
        ("10.9.9.9/tpu:0", grpc.StatusCode.NOT_FOUND),
        ("cuda:0", grpc.StatusCode.INVALID_ARGUMENT),
        ("127.0.0.1/gpu:0", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_get_device_unknown_or_malformed(inventory_stub, worker, device_id, code):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.GetDevice, pb.GetDeviceRequest(device_id=device_id))
    assert error.code() == code and device_id in error.details()


def test_refresh_devices_returns_fresh_samples(inventory_stub, worker):
    registered = {d.id: d for d in register(inventory_stub, worker).devices}
    fresh = inventory_stub.RefreshDevices(pb.RefreshDevicesRequest(device_ids=["127.0.0.1/cuda:1", "127.0.0.1/cuda:0"]))
    assert [d.id for d in fresh.devices] == ["127.0.0.1/cuda:1", "127.0.0.1/cuda:0"]
    for device in fresh.devices:
        before = registered[device.id].status.sample_time.ToNanoseconds()
        assert device.status.sample_time.ToNanoseconds() > before


def test_refresh_devices_errors(inventory_stub, worker):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.RefreshDevices, pb.RefreshDevicesRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = rpc_error(inventory_stub.RefreshDevices, pb.RefreshDevicesRequest(device_ids=["127.0.0.1/cuda:7"]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    worker.stop(0)
    error = rpc_error(inventory_stub.RefreshDevices, pb.RefreshDevicesRequest(device_ids=["127.0.0.1/cuda:0"]))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "127.0.0.1/cuda:0" in error.details()


def ranking(stub, kind=pb.TASK_KIND_INFERENCE, precision="bf16", **task):
    request = pb.ScoreDevicesRequest(task=pb.TaskProfile(kind=kind, precision=precision, **task),
                                     filter='platform = "cuda"')
    return [d.device.id for d in stub.ScoreDevices(request).devices]


def test_score_ranking_changes_after_reserve_and_again_after_release(inventory_stub, worker):
    register(inventory_stub, worker)
    memory_only = {"weights": pb.TaskWeights(memory=1.0)}
    assert ranking(inventory_stub, **memory_only) == ["127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(
        job_id="job-1",
        claims=[pb.DeviceClaim(device_id="127.0.0.1/cuda:0", memory_bytes=70 * GB, compute_fraction=0.5)],
    ))
    assert ranking(inventory_stub, **memory_only) == ["127.0.0.1/cuda:1", "127.0.0.1/cuda:0"]
    device = inventory_stub.GetDevice(pb.GetDeviceRequest(device_id="127.0.0.1/cuda:0")).device
    assert device.status.memory_reserved_bytes == 70 * GB and device.status.reserved_compute_fraction == 0.5
    released = inventory_stub.ReleaseDevices(pb.ReleaseDevicesRequest(job_id="job-1"))
    assert released.released_count == 1
    assert ranking(inventory_stub, **memory_only) == ["127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]


def test_score_weights_follow_the_task_kind(inventory_stub, worker):
    register(inventory_stub, worker)
    request = lambda kind: pb.ScoreDevicesRequest(task=pb.TaskProfile(kind=kind))  # noqa: E731
    training = inventory_stub.ScoreDevices(request(pb.TASK_KIND_TRAINING))
    inference = inventory_stub.ScoreDevices(request(pb.TASK_KIND_INFERENCE))
    assert training.weights.compute > inference.weights.compute
    for response in (training, inference):
        w = response.weights
        assert w.compute + w.memory + w.bandwidth == pytest.approx(1.0)
        assert "I/(I+B)" in response.weights_rule
        scores = [d.score for d in response.devices]
        assert scores == sorted(scores, reverse=True) and len(scores) == 3


def test_score_devices_scores_exactly_the_ids_named_and_still_applies_the_filter(inventory_stub, worker):
    register(inventory_stub, worker)
    task = pb.TaskProfile(kind=pb.TASK_KIND_INFERENCE)
    named = ["127.0.0.1/cuda:1", "127.0.0.1/cpu:2"]
    scored = inventory_stub.ScoreDevices(pb.ScoreDevicesRequest(task=task, device_ids=named)).devices
    assert sorted(d.device.id for d in scored) == sorted(named)
    narrowed = inventory_stub.ScoreDevices(
        pb.ScoreDevicesRequest(task=task, device_ids=named, filter='platform = "cuda"'))
    assert [d.device.id for d in narrowed.devices] == ["127.0.0.1/cuda:1"]
    error = rpc_error(inventory_stub.ScoreDevices, pb.ScoreDevicesRequest(task=task, device_ids=["127.0.0.1/cuda:9"]))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "cuda:9" in error.details()
    error = rpc_error(inventory_stub.ScoreDevices, pb.ScoreDevicesRequest(task=task, device_ids=["x"] * 10_001))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 10000" in error.details()


@pytest.mark.parametrize(
    "task, words",
    [
        (None, "task"),
        (pb.TaskProfile(precision="fp7"), "task.precision"),
        (pb.TaskProfile(weights=pb.TaskWeights(compute=-1, memory=1)), "task.weights.compute"),
        (pb.TaskProfile(weights=pb.TaskWeights()), "task.weights"),
        (pb.TaskProfile(arithmetic_intensity=-3), "arithmetic_intensity"),
    ],
)
def test_score_devices_rejects_bad_task_profiles(inventory_stub, worker, task, words):
    register(inventory_stub, worker)
    request = pb.ScoreDevicesRequest() if task is None else pb.ScoreDevicesRequest(task=task)
    error = rpc_error(inventory_stub.ScoreDevices, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details()


def test_watch_devices_reports_existing_then_lost_then_recovered(inventory, inventory_stub):
    _, domain = inventory
    worker = make_worker(cpu=host.FP32_CPU)  # the bf16 filter then matches the emulated A100 alone
    port = worker.port
    register(inventory_stub, worker)
    stream = inventory_stub.WatchDevices(
        pb.WatchDevicesRequest(include_existing=True, filter="capabilities:bf16"), timeout=30)
    first = next(stream)
    assert (first.type, first.device.id) == (pb.DEVICE_EVENT_TYPE_EXISTING, "127.0.0.1/cuda:0")
    worker.stop(0)
    for _ in range(3):  # lost_after_polls defaults to 3
        domain.poll_all()
    lost = next(stream)
    assert (lost.type, lost.device.id) == (pb.DEVICE_EVENT_TYPE_LOST, "127.0.0.1/cuda:0")
    assert lost.device.health == common_pb2.DEVICE_HEALTH_LOST
    assert device_ids(inventory_stub, "capabilities:bf16") == []
    assert device_ids(inventory_stub, 'health = "lost"') == ["127.0.0.1/cpu:2", "127.0.0.1/cuda:0", "127.0.0.1/cuda:1"]
    revived = make_worker(listen=f"127.0.0.1:{port}", cpu=host.FP32_CPU)
    try:
        domain.poll_all()
        recovered = next(stream)
        assert (recovered.type, recovered.device.id) == (pb.DEVICE_EVENT_TYPE_RECOVERED, "127.0.0.1/cuda:0")
        assert device_ids(inventory_stub, "capabilities:bf16") == ["127.0.0.1/cuda:0"]
    finally:
        stream.cancel()
        revived.stop(0)


def test_watch_rejects_a_malformed_filter(inventory_stub):
    error = rpc_error(lambda: next(inventory_stub.WatchDevices(pb.WatchDevicesRequest(filter="AND AND"))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "filter" in error.details()


def test_inventory_keeps_its_data_across_a_restart(inventory_factory, worker):
    server, _ = inventory_factory()
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, f"127.0.0.1:{server.port}")
    register(stub, worker)
    stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="job-9", claims=[claim()], ttl_seconds=3600))
    before = device_ids(stub)
    server.stop(0)
    again, _ = inventory_factory()
    stub = mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, f"127.0.0.1:{again.port}")
    assert device_ids(stub) == before
    assert [r.job_id for r in stub.ListReservations(pb.ListReservationsRequest()).reservations] == ["job-9"]
    assert [n.address for n in stub.ListNodes(pb.ListNodesRequest()).nodes] == [f"127.0.0.1:{worker.port}"]


def test_a_worker_restarted_on_a_new_port_takes_over_from_its_silent_former_self(inventory_stub):
    first = make_worker()
    register(inventory_stub, first)
    first.stop(0)  # gone before any poll noticed
    second = make_worker()
    try:
        register(inventory_stub, second)
        nodes = {n.address: n.state for n in inventory_stub.ListNodes(pb.ListNodesRequest()).nodes}
        assert nodes == {f"127.0.0.1:{first.port}": pb.NODE_STATE_LOST,
                         f"127.0.0.1:{second.port}": pb.NODE_STATE_ACTIVE}
        devices = inventory_stub.ListDevices(pb.ListDevicesRequest()).devices
        assert devices and {d.node_address for d in devices} == {f"127.0.0.1:{second.port}"}
    finally:
        second.stop(0)


def test_a_second_live_worker_claiming_the_same_device_ids_is_refused(inventory_stub, worker):
    register(inventory_stub, worker)
    twin = make_worker(hostname="node-b")
    try:
        error = rpc_error(inventory_stub.RegisterNode, pb.RegisterNodeRequest(address=f"127.0.0.1:{twin.port}"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already reported by node" in error.details() and "--advertise-ip" in error.details()
        nodes = inventory_stub.ListNodes(pb.ListNodesRequest()).nodes
        assert [n.hostname for n in nodes] == ["node-a"]
    finally:
        twin.stop(0)
