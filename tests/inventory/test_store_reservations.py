"""SqlStore reservations (on both engines): leases, free memory after other jobs' claims, all-or-nothing claims,
and renewals (the job's own live leases only, all or none, never reviving a lapsed one)."""

from __future__ import annotations

import threading

import pytest
from store_records import GB, NODE, one_device_fixture, report, sample, spec, store_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from inventory_svc.store import SqlStore

# -- reservations -----------------------------------------------------------------------------


def test_reserving_again_replaces_the_amounts_and_extends_the_lease(store, one_device):
    first = store.reserve("job-1", one_device.id, 10 * GB, 0.25, ttl_s=30, now=100.0)
    second = store.reserve("job-1", one_device.id, 20 * GB, 0.5, ttl_s=30, now=110.0)
    assert (second.memory_bytes, second.compute_fraction) == (20 * GB, 0.5)
    assert (second.created_at, second.expires_at) == (first.created_at, 140.0)
    record = store.get_device(one_device.id, now=120.0)
    assert (record.reserved_memory_bytes, record.reserved_compute_fraction) == (20 * GB, 0.5)
    assert record.free_memory_bytes == 60 * GB
    assert len(store.reservations(device_id=one_device.id)) == 1


def test_reservation_beyond_free_memory_is_refused_with_the_numbers(store, one_device):
    store.reserve("job-1", one_device.id, 60 * GB, 0.5, ttl_s=30, now=0.0)
    with pytest.raises(ResourceExhausted, match=rf"requested {30 * GB} bytes .* only {20 * GB} bytes are free"):
        store.reserve("job-2", one_device.id, 30 * GB, 0.1, ttl_s=30, now=1.0)
    # A job's own earlier reservation is replaced, not counted against it.
    assert store.reserve("job-1", one_device.id, 80 * GB, 1.0, ttl_s=30, now=2.0).memory_bytes == 80 * GB
    assert [r.job_id for r in store.reservations()] == ["job-1"]


def test_used_memory_in_the_latest_sample_counts_against_reservations(store, one_device):
    store.record_poll_success(NODE, report([one_device], [sample(one_device, 1.0, used=75 * GB)]), now=1.0)
    with pytest.raises(ResourceExhausted, match=rf"only {5 * GB} bytes"):
        store.reserve("job-1", one_device.id, 6 * GB, 0.0, ttl_s=30, now=2.0)


@pytest.mark.parametrize(
    "job, memory, fraction, ttl, field",
    [
        ("", GB, 0.5, 10, "job_id"),
        ("j", -1, 0.5, 10, "memory_bytes"),
        ("j", 1.5, 0.5, 10, "memory_bytes"),
        ("j", GB, 1.01, 10, "compute_fraction"),
        ("j", GB, -0.1, 10, "compute_fraction"),
        ("j", GB, float("nan"), 10, "compute_fraction"),
        ("j", GB, 0.5, 0, "ttl_s"),
    ],
)
def test_bad_reservation_arguments_name_the_field(store, one_device, job, memory, fraction, ttl, field):
    with pytest.raises(InvalidArgument, match=field):
        store.reserve(job, one_device.id, memory, fraction, ttl_s=ttl, now=0.0)


def test_reserving_an_unknown_or_lost_device_fails(store, one_device):
    with pytest.raises(NotFound):
        store.reserve("j", "10.0.0.1/cuda:5", GB, 0.1, ttl_s=10, now=0.0)
    store.record_poll_failure(NODE, "gone", now=1.0, lost_after=1)
    with pytest.raises(FailedPrecondition, match="lost"):
        store.reserve("j", one_device.id, GB, 0.1, ttl_s=10, now=2.0)


def test_unrenewed_leases_expire_and_free_their_memory(store, one_device):
    store.reserve("vanished", one_device.id, 70 * GB, 0.5, ttl_s=10, now=0.0)
    store.reserve("alive", one_device.id, 5 * GB, 0.1, ttl_s=10, now=0.0)
    store.reserve("alive", one_device.id, 5 * GB, 0.1, ttl_s=10, now=8.0)  # renewed
    assert store.get_device(one_device.id, now=9.0).reserved_memory_bytes == 75 * GB
    # Past its lease the reservation stops counting even before the sweep runs...
    assert store.get_device(one_device.id, now=10.0).reserved_memory_bytes == 5 * GB
    assert store.reserve("new", one_device.id, 70 * GB, 0.2, ttl_s=10, now=10.0).memory_bytes == 70 * GB
    # ...and the sweep deletes it.
    assert store.expire_reservations(now=10.0) == 1
    assert sorted(r.job_id for r in store.reservations()) == ["alive", "new"]
    assert [r.job_id for r in store.reservations(now=18.5)] == ["new"]


def test_release_by_device_and_by_job(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    a, b = spec(index=0), spec(index=1)
    store.record_poll_success(NODE, report([a, b]), now=0.0)
    for device in (a, b):
        store.reserve("job-1", device.id, GB, 0.1, ttl_s=60, now=0.0)
        store.reserve("job-2", device.id, GB, 0.1, ttl_s=60, now=0.0)
    assert store.release("job-1", [a.id]) == 1
    assert [(r.job_id, r.device_id) for r in store.reservations(job_id="job-1")] == [("job-1", b.id)]
    assert store.release("job-2") == 2
    assert store.release("no-such-job") == 0
    assert store.get_device(a.id, now=1.0).reserved_memory_bytes == 0


def test_reserve_many_is_all_or_nothing(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    a, b = spec(index=0), spec(index=1)
    store.record_poll_success(NODE, report([a, b]), now=0.0)
    store.reserve("other", b.id, 70 * GB, 0.5, ttl_s=60, now=0.0)
    with pytest.raises(ResourceExhausted, match=b.id):
        store.reserve_many("job-1", [(a.id, 10 * GB, 0.5), (b.id, 20 * GB, 0.5)], ttl_s=60, now=1.0)
    assert store.reservations(job_id="job-1") == []  # a's claim rolled back with b's failure
    made = store.reserve_many("job-1", [(a.id, 10 * GB, 0.5), (b.id, 10 * GB, 0.5)], ttl_s=60, now=1.0)
    assert [(r.device_id, r.memory_bytes) for r in made] == [(a.id, 10 * GB), (b.id, 10 * GB)]
    with pytest.raises(InvalidArgument, match="more than once"):
        store.reserve_many("job-2", [(a.id, GB, 0.1), (a.id, GB, 0.1)], ttl_s=60, now=1.0)


@pytest.fixture
def two_devices(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    devices = spec(index=0), spec(index=1)
    store.record_poll_success(NODE, report(devices), now=0.0)
    return devices


def test_renewing_moves_only_the_jobs_own_leases_and_keeps_what_they_hold(store, two_devices):
    a, b = two_devices
    store.reserve_many("job-1", [(a.id, 10 * GB, 0.5), (b.id, 20 * GB, 0.25)], ttl_s=10, now=0.0)
    store.reserve("job-2", a.id, 5 * GB, 0.1, ttl_s=10, now=0.0)
    renewed = store.renew("job-1", None, ttl_s=30, now=8.0)
    assert [(r.device_id, r.memory_bytes, r.compute_fraction, r.created_at, r.expires_at) for r in renewed] == [
        (a.id, 10 * GB, 0.5, 0.0, 38.0), (b.id, 20 * GB, 0.25, 0.0, 38.0)]
    assert [r.expires_at for r in store.reservations(job_id="job-2")] == [10.0]
    # Past the first lease the renewed job still holds its memory; the other job's lease lapsed.
    assert store.get_device(a.id, now=20.0).reserved_memory_bytes == 10 * GB
    assert store.renew("job-1", [b.id], ttl_s=5, now=20.0)[0].expires_at == 25.0  # one device, shorter
    assert {r.device_id: r.expires_at for r in store.reservations(job_id="job-1")} == {a.id: 38.0, b.id: 25.0}


def test_a_lapsed_or_released_lease_is_not_found_and_never_revived(store, one_device):
    a = one_device
    store.reserve("job-1", a.id, 10 * GB, 0.5, ttl_s=10, now=0.0)
    with pytest.raises(NotFound, match=r"job 'job-1' holds no live reservation: it expired or was released"):
        store.renew("job-1", None, ttl_s=10, now=10.0)  # lapsed, though the sweep has not deleted it yet
    assert store.get_device(a.id, now=10.0).reserved_memory_bytes == 0
    store.reserve("job-2", a.id, 10 * GB, 0.5, ttl_s=10, now=11.0)
    store.release("job-2")
    with pytest.raises(NotFound, match="job-2"):
        store.renew("job-2", [a.id], ttl_s=10, now=12.0)
    with pytest.raises(NotFound, match="no-such-job"):
        store.renew("no-such-job", None, ttl_s=10, now=12.0)


def test_renewing_named_devices_is_all_or_none(store, two_devices):
    a, b = two_devices
    store.reserve("job-1", a.id, 10 * GB, 0.5, ttl_s=10, now=0.0)
    with pytest.raises(NotFound, match=rf"no live reservation on \['{b.id}'\] .* nothing was renewed") as info:
        store.renew("job-1", [a.id, b.id], ttl_s=60, now=1.0)
    assert info.value.field == "device_ids"
    assert [r.expires_at for r in store.reservations(job_id="job-1")] == [10.0]


@pytest.mark.parametrize("job, ttl, field", [("", 10, "job_id"), ("j", 0, "ttl_s"), ("j", float("inf"), "ttl_s")])
def test_bad_renewal_arguments_name_the_field(store, one_device, job, ttl, field):
    store.reserve("j", one_device.id, GB, 0.1, ttl_s=10, now=0.0)
    with pytest.raises(InvalidArgument, match=field):
        store.renew(job, None, ttl_s=ttl, now=1.0)
    assert [r.expires_at for r in store.reservations(job_id="j")] == [10.0]


def test_missing_parent_directory_is_created(tmp_path):
    store = SqlStore(tmp_path / "state" / "deep" / "inventory.db")
    assert (tmp_path / "state" / "deep" / "inventory.db").exists()
    store.close()


def test_concurrent_reservations_never_overcommit(store, one_device):
    outcomes: list[str] = []

    def grab(job: str) -> None:
        try:
            store.reserve(job, one_device.id, 20 * GB, 0.1, ttl_s=60, now=1.0)
            outcomes.append("ok")
        except ResourceExhausted:
            outcomes.append("full")

    threads = [threading.Thread(target=grab, args=(f"job-{i}",)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 4 and outcomes.count("full") == 8
    assert store.get_device(one_device.id, now=2.0).reserved_memory_bytes == 80 * GB
