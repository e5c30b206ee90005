"""The InventoryService reservation RPCs through a real in-process server on port 0: ReserveDevices
(idempotent per job and device, all or none, malformed claims refused), ReleaseDevices,
RenewReservations (the job's own leases only, and only the dispatcher may) and ListReservations;
payloads and status codes."""

from __future__ import annotations

import grpc
import pytest
from _inventory_helpers import GB, claim, register

from accelmesh.inventory.v1 import inventory_service_pb2 as pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel

from conftest import CREDENTIALS, rpc_error

pytestmark = pytest.mark.fixture_cpu


def test_reservations_are_idempotent_per_job_and_device(inventory_stub, worker):
    register(inventory_stub, worker)
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="job-1", claims=[claim()]))
    again = inventory_stub.ReserveDevices(
        pb.ReserveDevicesRequest(job_id="job-1", claims=[claim(memory=20 * GB)], ttl_seconds=60))
    assert [(r.device_id, r.memory_bytes) for r in again.reservations] == [("127.0.0.1/cuda:0", 20 * GB)]
    held = inventory_stub.ListReservations(pb.ListReservationsRequest(job_id="job-1")).reservations
    assert [(r.job_id, r.memory_bytes) for r in held] == [("job-1", 20 * GB)]
    device = inventory_stub.GetDevice(pb.GetDeviceRequest(device_id="127.0.0.1/cuda:0")).device
    assert device.status.memory_reserved_bytes == 20 * GB


def test_reserve_is_all_or_none(inventory_stub, worker):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.ReserveDevices, pb.ReserveDevicesRequest(
        job_id="job-2", claims=[claim(), claim(device="127.0.0.1/cuda:1", memory=40 * GB)]
    ))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "127.0.0.1/cuda:1" in error.details()
    assert inventory_stub.ListReservations(pb.ListReservationsRequest()).reservations == []


@pytest.mark.parametrize(
    "job_id, claims, code, words",
    [
        ("", [claim()], grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        ("job", [], grpc.StatusCode.INVALID_ARGUMENT, "claims"),
        ("job", [claim(memory=-1)], grpc.StatusCode.INVALID_ARGUMENT, "memory_bytes"),
        ("job", [claim(compute=1.5)], grpc.StatusCode.INVALID_ARGUMENT, "compute_fraction"),
        ("job", [claim(device="127.0.0.1/cuda:5")], grpc.StatusCode.NOT_FOUND, "127.0.0.1/cuda:5"),
    ],
)
def test_reserve_rejects_bad_claims(inventory_stub, worker, job_id, claims, code, words):
    register(inventory_stub, worker)
    error = rpc_error(inventory_stub.ReserveDevices, pb.ReserveDevicesRequest(job_id=job_id, claims=claims))
    assert error.code() == code and words in error.details()
    assert inventory_stub.ListReservations(pb.ListReservationsRequest()).reservations == []


def test_release_of_some_devices_keeps_the_rest(inventory_stub, worker):
    register(inventory_stub, worker)
    inventory_stub.ReserveDevices(
        pb.ReserveDevicesRequest(job_id="j", claims=[claim(), claim(device="127.0.0.1/cuda:1")]))
    released = inventory_stub.ReleaseDevices(pb.ReleaseDevicesRequest(job_id="j", device_ids=["127.0.0.1/cuda:0"]))
    assert released.released_count == 1
    left = inventory_stub.ListReservations(pb.ListReservationsRequest(job_id="j")).reservations
    assert [r.device_id for r in left] == ["127.0.0.1/cuda:1"]
    error = rpc_error(inventory_stub.ReleaseDevices, pb.ReleaseDevicesRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in error.details()


def test_renew_extends_the_jobs_own_leases_and_says_until_when(inventory_stub, worker):
    register(inventory_stub, worker)
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(
        job_id="j", claims=[claim(), claim(device="127.0.0.1/cuda:1")], ttl_seconds=60))
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="other", claims=[claim(memory=GB)], ttl_seconds=60))
    before = {r.job_id: r.expire_time.seconds for r in inventory_stub.ListReservations(pb.ListReservationsRequest(
        device_id="127.0.0.1/cuda:0")).reservations}
    renewed = inventory_stub.RenewReservations(pb.RenewReservationsRequest(job_id="j", ttl_seconds=3600))
    assert renewed.renewed_count == 2 and renewed.expire_time.seconds >= before["j"] + 3600 - 60
    held = inventory_stub.ListReservations(pb.ListReservationsRequest(job_id="j")).reservations
    assert [(r.device_id, r.memory_bytes, r.expire_time) for r in held] == [
        ("127.0.0.1/cuda:0", 10 * GB, renewed.expire_time), ("127.0.0.1/cuda:1", 10 * GB, renewed.expire_time)]
    other = inventory_stub.ListReservations(pb.ListReservationsRequest(job_id="other")).reservations
    assert [r.expire_time.seconds for r in other] == [before["other"]]
    one = inventory_stub.RenewReservations(pb.RenewReservationsRequest(
        job_id="j", device_ids=["127.0.0.1/cuda:1"], ttl_seconds=0))  # 0: the default lease, 300 s
    assert one.renewed_count == 1 and one.expire_time.seconds < renewed.expire_time.seconds


@pytest.mark.parametrize(
    "request_fields, code, words",
    [
        ({"job_id": "gone"}, grpc.StatusCode.NOT_FOUND,
         "job 'gone' holds no live reservation: it expired or was released"),
        ({"job_id": "j", "device_ids": ["127.0.0.1/cuda:1"]}, grpc.StatusCode.NOT_FOUND,
         "no live reservation on ['127.0.0.1/cuda:1']"),
        ({"job_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        ({"job_id": "j", "ttl_seconds": -1}, grpc.StatusCode.INVALID_ARGUMENT, "ttl_seconds must be within 1..86400"),
        ({"job_id": "j", "ttl_seconds": 86401}, grpc.StatusCode.INVALID_ARGUMENT, "within 1..86400, got 86401"),
        ({"job_id": "j", "device_ids": ["x"] * 10_001}, grpc.StatusCode.INVALID_ARGUMENT, "at most 10000"),
    ],
)
def test_renew_refuses_unknown_jobs_and_bad_leases_and_renews_nothing(inventory_stub, worker, request_fields, code,
                                                                     words):
    register(inventory_stub, worker)
    inventory_stub.ReserveDevices(pb.ReserveDevicesRequest(job_id="j", claims=[claim()], ttl_seconds=60))
    before = inventory_stub.ListReservations(pb.ListReservationsRequest()).reservations
    error = rpc_error(inventory_stub.RenewReservations, pb.RenewReservationsRequest(**request_fields))
    assert error.code() == code and words in error.details()
    assert inventory_stub.ListReservations(pb.ListReservationsRequest()).reservations == before


def test_only_the_dispatcher_may_renew(inventory, worker):
    server, _ = inventory
    with open_channel(f"127.0.0.1:{server.port}", security=CREDENTIALS.client()) as channel:
        error = rpc_error(inventory_service_pb2_grpc.InventoryServiceStub(channel).RenewReservations,
                          pb.RenewReservationsRequest(job_id="j"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "dispatch" in error.details()
