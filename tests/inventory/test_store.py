"""SqliteStore: migrations, polling bookkeeping, sample retention, reservations and paging."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from accelmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from accelmesh.hardware.model import DeviceSample, DeviceSpec, NodeDescription, Performance, device_id
from inventory_svc.filtering import parse_filter
from inventory_svc.migrations import LATEST_VERSION, MIGRATIONS, apply_migrations
from inventory_svc.records import DeviceChange
from inventory_svc.store import SqliteStore

GB = 10**9
NODE = "10.0.0.1:50051"


def spec(ip: str = "10.0.0.1", index: int = 0, platform: str = "cuda", memory: int = 80 * GB, **extra) -> DeviceSpec:
    return DeviceSpec(
        id=device_id(ip, platform, index), node_ip=ip, local_index=index, platform=platform,
        kind=extra.pop("kind", "NVIDIA A100-SXM4-80GB"), type=extra.pop("type", "a100-80gb"),
        capabilities=frozenset(extra.pop("capabilities", {"bf16", "tf32"})),
        performance=Performance({"fp32": 19.5, "bf16": 312.0}, memory, 2039.0), **extra,
    )


def sample(device: DeviceSpec, ts: float, used: int = 0, utilization: float = 0.0) -> DeviceSample:
    return DeviceSample(device.id, ts, device.performance.memory_bytes, used, utilization, 40.0, 100.0)


def report(devices, samples=(), ip: str = "10.0.0.1") -> NodeDescription:
    return NodeDescription(ip, "host-" + ip, tuple(devices), tuple(samples))


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(tmp_path / "inventory.db")
    yield s
    s.close()


@pytest.fixture
def one_device(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu = spec()
    store.record_poll_success(NODE, report([gpu], [sample(gpu, 0.0)]), now=0.0)
    return gpu


# -- migrations -------------------------------------------------------------------------------


def test_fresh_file_gets_every_migration_and_reopen_applies_none(tmp_path):
    path = tmp_path / "inv.db"
    first = SqliteStore(path)
    assert first.schema_version == LATEST_VERSION
    assert first._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    first.close()
    applied = sqlite3.connect(path).execute("SELECT version, applied_at FROM schema_migrations").fetchall()
    assert [v for v, _ in applied] == [v for v, _ in MIGRATIONS]

    SqliteStore(path).close()
    assert sqlite3.connect(path).execute("SELECT version, applied_at FROM schema_migrations").fetchall() == applied


def test_only_missing_migrations_run_and_a_failing_one_rolls_back(tmp_path):
    conn = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    v1 = (1, ("CREATE TABLE a (x)",))
    assert apply_migrations(conn, "m.db", (v1,)) == 1
    # Re-running v1 would fail (table a exists), so success proves only v2 ran.
    assert apply_migrations(conn, "m.db", (v1, (2, ("CREATE TABLE b (x)",)))) == 2
    broken = (3, ("CREATE TABLE c (x)", "THIS IS NOT SQL"))
    with pytest.raises(sqlite3.OperationalError):
        apply_migrations(conn, "m.db", (v1, (2, ()), broken))
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "c" not in tables and {"a", "b"} <= tables
    assert conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] == 2


def test_database_from_a_newer_build_is_refused(tmp_path):
    path = tmp_path / "inv.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (LATEST_VERSION + 7,))
    with pytest.raises(FailedPrecondition, match=rf"version {LATEST_VERSION + 7}.*up to {LATEST_VERSION}"):
        SqliteStore(path)


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"definitely not sqlite" * 100)
    with pytest.raises(FailedPrecondition, match="cannot be opened"):
        SqliteStore(path)


def test_data_survives_close_and_reopen(tmp_path, one_device):
    path = tmp_path / "inventory.db"
    store = SqliteStore(path)  # the fixture's store wrote here too; this is a second connection
    store.reserve("job-1", one_device.id, 5 * GB, 0.5, ttl_s=60, now=1.0)
    store.close()
    reopened = SqliteStore(path)
    record = reopened.get_device(one_device.id, now=2.0)
    assert record.spec == one_device
    assert record.latest == sample(one_device, 0.0)
    assert record.reserved_memory_bytes == 5 * GB
    assert [n.node_id for n in reopened.list_nodes()] == [NODE]
    reopened.close()


# -- polling ----------------------------------------------------------------------------------


def test_poll_success_reports_added_updated_and_nothing_when_unchanged(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    a, b = spec(index=0), spec(index=1)
    assert store.record_poll_success(NODE, report([a, b]), now=1.0) == [
        DeviceChange("added", a.id), DeviceChange("added", b.id)
    ]
    assert store.record_poll_success(NODE, report([a, b]), now=2.0) == []
    newer = b.replace(compute_capability="8.0")
    assert store.record_poll_success(NODE, report([a, newer]), now=3.0) == [DeviceChange("updated", b.id)]
    record = store.get_device(b.id)
    assert record.spec == newer and record.first_seen_at == 1.0 and record.updated_at == 3.0


def test_device_missing_from_a_report_becomes_lost(store):
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    a, b = spec(index=0), spec(index=1)
    store.record_poll_success(NODE, report([a, b]), now=1.0)
    assert store.record_poll_success(NODE, report([a]), now=2.0) == [DeviceChange("lost", b.id)]
    assert store.get_device(b.id).health == "lost"


def test_node_is_lost_after_n_failures_and_recovers_on_success(store, one_device):
    assert store.record_poll_failure(NODE, "deadline exceeded", now=5.0, lost_after=3) == []
    assert store.record_poll_failure(NODE, "deadline exceeded", now=10.0, lost_after=3) == []
    node = store.get_node(NODE)
    assert (node.state, node.missed_polls, node.last_error) == ("active", 2, "deadline exceeded")
    assert store.get_device(one_device.id).health == "healthy"

    assert store.record_poll_failure(NODE, "connection refused", now=15.0, lost_after=3) == [one_device.id]
    assert store.get_node(NODE).state == "lost"
    assert store.get_device(one_device.id).health == "lost"
    assert store.list_devices()[0] == []  # lost devices are hidden by default
    # A fourth failure reports nothing new: the device was already lost.
    assert store.record_poll_failure(NODE, "connection refused", now=20.0, lost_after=3) == []

    changes = store.record_poll_success(NODE, report([one_device]), now=25.0)
    assert changes == [DeviceChange("recovered", one_device.id)]
    node = store.get_node(NODE)
    assert (node.state, node.missed_polls, node.last_error, node.last_seen_at) == ("active", 0, "", 25.0)
    assert store.get_device(one_device.id).health == "healthy"


def test_polls_for_an_unregistered_node_are_rejected(store):
    with pytest.raises(NotFound, match="not registered"):
        store.record_poll_success("10.9.9.9:1", report([]), now=0.0)
    with pytest.raises(NotFound, match="not registered"):
        store.record_poll_failure("10.9.9.9:1", "x", now=0.0, lost_after=1)


def test_unknown_device_is_not_found_with_a_hint(store):
    with pytest.raises(NotFound, match=r"device '10.0.0.1/cuda:9' is not in the inventory; list devices"):
        store.get_device("10.0.0.1/cuda:9")


# -- samples ----------------------------------------------------------------------------------


def test_retention_keeps_only_the_newest_n_samples(tmp_path):
    store = SqliteStore(tmp_path / "n.db", max_samples_per_device=3, retention_s=1e9)
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu = spec()
    for ts in range(1, 6):
        store.record_poll_success(NODE, report([gpu], [sample(gpu, float(ts), used=ts * GB)]), now=float(ts))
    assert [s.timestamp for s in store.samples(gpu.id)] == [3.0, 4.0, 5.0]
    assert store.latest_sample(gpu.id).memory_used_bytes == 5 * GB
    assert [s.timestamp for s in store.samples(gpu.id, since=4.0)] == [5.0]
    store.close()


def test_retention_drops_samples_older_than_the_window(tmp_path):
    store = SqliteStore(tmp_path / "age.db", max_samples_per_device=100, retention_s=10.0)
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu, other = spec(index=0), spec(index=1)
    store.record_poll_success(NODE, report([gpu, other], [sample(gpu, 0.0), sample(other, 0.0)]), now=0.0)
    store.record_poll_success(NODE, report([gpu, other], [sample(gpu, 5.0)]), now=5.0)
    store.record_poll_success(NODE, report([gpu, other], [sample(gpu, 12.0)]), now=12.0)
    assert [s.timestamp for s in store.samples(gpu.id)] == [5.0, 12.0]
    # Pruning is per device on insert: a device that reported nothing keeps its last reading.
    assert [s.timestamp for s in store.samples(other.id)] == [0.0]
    assert store.latest_sample("10.0.0.1/cuda:7") is None
    # A worker whose clock lags by more than the window still leaves its current reading.
    late = spec(index=2)
    store.record_poll_success(NODE, report([gpu, other, late], [sample(late, -100.0), sample(other, -50.0)]), now=30.0)
    assert [s.timestamp for s in store.samples(late.id)] == [-100.0]
    assert [s.timestamp for s in store.samples(other.id)] == [0.0]
    store.close()


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


def test_missing_parent_directory_is_created(tmp_path):
    store = SqliteStore(tmp_path / "state" / "deep" / "inventory.db")
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


# -- listing ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """10,000 devices on 100 nodes: a quarter ROCm, one node lost, memory use varying by index."""
    store = SqliteStore(tmp_path_factory.mktemp("big") / "big.db")
    for n in range(100):
        ip = f"10.1.{n // 250}.{n % 250}"
        address = f"{ip}:50051"
        store.upsert_node(address, ip, f"node-{n}", now=0.0)
        devices = [spec(ip, i, "rocm" if i % 4 == 0 else "cuda") for i in range(100)]
        samples = [sample(d, 1.0, used=(d.local_index % 10) * 8 * GB) for d in devices]
        store.record_poll_success(address, report(devices, samples, ip), now=1.0)
    store.record_poll_failure("10.1.0.7:50051", "gone", now=2.0, lost_after=1)
    yield store
    store.close()


def _all_pages(store, text: str, page_size: int = 100) -> list[str]:
    ids, after = [], ""
    while True:
        page, after = store.list_devices(parse_filter(text), page_size=page_size, after_id=after, now=3.0)
        assert len(page) <= page_size
        ids.extend(record.id for record in page)
        if not after:
            return ids


@pytest.mark.parametrize(
    "text, expected_count",
    [
        ("", 9900),
        ('platform = "rocm"', 2475),
        ('health = "lost"', 100),
        ("free_memory_bytes >= 60000000000", 2970),  # used 0, 8 or 16 GB of 80: indices ending 0-2
        ('platform = "cuda" AND free_memory_bytes < 10000000000', 990),  # indices ending 9, all cuda
        ("free_memory_bytes > 1e15", 0),  # matches nothing: the whole table is one page's work
        ("capabilities:avx2", 0),
    ],
)
def test_paging_10000_devices_returns_each_match_once_in_id_order(big_store, text, expected_count):
    ids = _all_pages(big_store, text)
    assert len(ids) == expected_count
    assert ids == sorted(set(ids))
    flt = parse_filter(text)
    every = [big_store.get_device(i, now=3.0) for i in ids[:: max(1, len(ids) // 50)]]
    assert all(flt.matches(record) for record in every)


def test_page_size_zero_means_default_and_negative_is_rejected(big_store):
    assert len(big_store.list_devices(page_size=0, now=3.0)[0]) == 100
    assert len(big_store.list_devices(page_size=5000, now=3.0)[0]) == 1000
    with pytest.raises(InvalidArgument, match="page_size"):
        big_store.list_devices(page_size=-1)


def test_next_token_is_the_last_id_and_empty_on_the_last_page(big_store):
    rocm = parse_filter('platform = "rocm"')
    sizes, after = [], ""
    while True:
        page, next_after = big_store.list_devices(rocm, page_size=1000, after_id=after, now=3.0)
        sizes.append(len(page))
        assert next_after in ("", page[-1].id)
        if not next_after:
            break
        after = next_after
    assert sizes == [1000, 1000, 475]
    # Exactly a page left: no phantom next page.
    exactly, after = big_store.list_devices(rocm, page_size=474, after_id=page[0].id, now=3.0)
    assert len(exactly) == 474 and after == ""
