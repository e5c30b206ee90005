"""SqlStore on both engines: migrations, polling bookkeeping and sample retention; and what only
a SQLite file has (a file of the hand-written migration chain, a file that is not a database)."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa
from store_records import GB, NODE, one_device_fixture, report, sample, spec, store_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import FailedPrecondition, NotFound
from inventory_svc.migrations import LATEST_VERSION, MIGRATIONS
from inventory_svc.records import DeviceChange
from inventory_svc.schema import VERSION_TABLE
from inventory_svc.store import SqlStore
from inventory_svc.tables import metadata

HEAD = "0004"


# -- migrations -------------------------------------------------------------------------------


def _revisions(store: SqlStore) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())


def test_fresh_database_is_migrated_to_head_and_reopening_keeps_it(database_url):
    first = SqlStore(database_url)
    assert first.schema_version == HEAD and _revisions(first) == [HEAD]
    assert set(sa.inspect(first.engine).get_table_names()) >= {"nodes", "devices", "status_samples", "reservations"}
    if first.engine.dialect.name == "sqlite":
        with first.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    first.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    first.close()
    again = SqlStore(database_url)
    assert again.schema_version == HEAD and _revisions(again) == [HEAD]
    assert [n.address for n in again.list_nodes()] == [NODE]
    again.close()


def test_the_migrated_schema_is_the_one_tables_py_describes(database_url):
    """The revisions and ``tables.py`` are written apart; a column added to one alone fails here."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    store = SqlStore(database_url)
    try:
        with store.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={
                "include_name": lambda name, kind, _: not (kind == "table" and name == VERSION_TABLE)})
            assert compare_metadata(context, metadata) == []
    finally:
        store.close()


def _legacy_file(path, versions: int, extra_version: int | None = None) -> sqlite3.Connection:
    """A file as the hand-written chain left it after its first ``versions`` migrations."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    for version, statements in MIGRATIONS[:versions]:
        for statement in statements:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    if extra_version is not None:
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (extra_version,))
    return conn


def test_a_version_1_file_is_adopted_keeping_its_nodes_and_devices_under_the_one_node_name(tmp_path):
    path = tmp_path / "v1.db"
    conn = _legacy_file(path, 1)
    conn.execute("INSERT INTO nodes (node_id, address, ip, registered_at) VALUES (?, ?, '10.0.0.1', 0)", (NODE, NODE))
    conn.execute(
        "INSERT INTO devices (id, node_id, node_ip, local_index, platform, kind, type, first_seen_at, updated_at) "
        "VALUES ('10.0.0.1/cuda:0', ?, '10.0.0.1', 0, 'cuda', 'NVIDIA A100-SXM4-80GB', 'a100-80gb', 0, 0)",
        (NODE,),
    )
    conn.close()
    store = SqlStore(path)
    assert store.schema_version == HEAD
    assert [n.address for n in store.list_nodes()] == [NODE]
    assert store.get_device("10.0.0.1/cuda:0").node_address == NODE
    check = sqlite3.connect(path)
    columns = {row[1] for row in check.execute("PRAGMA table_info(nodes)")}
    assert "node_id" not in columns and "address" in columns
    tables = {row[0] for row in check.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "schema_migrations" not in tables and VERSION_TABLE in tables  # one record of the schema from now on
    store.close()


def test_a_version_2_file_keeps_its_reservations(tmp_path, one_device):
    path = tmp_path / "v2.db"
    conn = _legacy_file(path, LATEST_VERSION)
    conn.execute("INSERT INTO nodes (address, ip, registered_at) VALUES (?, '10.0.0.1', 0)", (NODE,))
    conn.execute(
        "INSERT INTO devices (id, node_address, node_ip, local_index, platform, kind, type, performance, "
        "first_seen_at, updated_at) VALUES (?, ?, '10.0.0.1', 0, 'cuda', 'k', 'a100-80gb', ?, 0, 0)",
        (one_device.id, NODE, '{"interconnect_bandwidth_gbps": 0.0, "memory_bandwidth_gbps": 2039.0, '
         f'"memory_bytes": {80 * GB}, "peak_tflops": {{"bf16": 312.0}}}}'),
    )
    conn.execute("INSERT INTO reservations VALUES ('job-1', ?, ?, 0.5, 0, 100)", (one_device.id, 30 * GB))
    conn.close()
    store = SqlStore(path)
    assert [(r.job_id, r.memory_bytes) for r in store.reservations()] == [("job-1", 30 * GB)]
    assert store.get_device(one_device.id, now=1.0).free_memory_bytes == 50 * GB
    store.close()


def test_a_file_from_a_longer_hand_written_chain_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "newer.db"
    _legacy_file(path, LATEST_VERSION, extra_version=LATEST_VERSION + 1).close()
    with pytest.raises(FailedPrecondition, match=rf"newer.db.*version {LATEST_VERSION + 1}.*up to {LATEST_VERSION}"):
        SqlStore(path)
    tables = {row[0] for row in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "schema_migrations" in tables and VERSION_TABLE not in tables  # the refusal rolled everything back


def test_database_from_a_newer_build_is_refused(database_url):
    first = SqlStore(database_url)
    with first.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = 'ffff9999'"))
    first.close()
    with pytest.raises(FailedPrecondition, match=rf"revision .ffff9999.,.* up to {HEAD}\); run a newer"):
        SqlStore(database_url)


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"definitely not sqlite" * 100)
    with pytest.raises(FailedPrecondition, match="junk.db cannot be opened"):
        SqlStore(path)


def test_data_survives_close_and_reopen(database_url, one_device):
    store = SqlStore(database_url)  # the fixture's store wrote here too; this is a second engine
    store.reserve("job-1", one_device.id, 5 * GB, 0.5, ttl_s=60, now=1.0)
    store.close()
    reopened = SqlStore(database_url)
    record = reopened.get_device(one_device.id, now=2.0)
    assert record.spec == one_device
    assert record.latest == sample(one_device, 0.0)
    assert record.reserved_memory_bytes == 5 * GB
    assert [n.address for n in reopened.list_nodes()] == [NODE]
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


def test_retention_keeps_only_the_newest_n_samples(database_url):
    store = SqlStore(database_url, max_samples_per_device=3, retention_s=1e9)
    store.upsert_node(NODE, "10.0.0.1", "host", now=0.0)
    gpu = spec()
    for ts in range(1, 6):
        store.record_poll_success(NODE, report([gpu], [sample(gpu, float(ts), used=ts * GB)]), now=float(ts))
    assert [s.timestamp for s in store.samples(gpu.id)] == [3.0, 4.0, 5.0]
    assert store.latest_sample(gpu.id).memory_used_bytes == 5 * GB
    assert [s.timestamp for s in store.samples(gpu.id, since=4.0)] == [5.0]
    store.close()


def test_retention_drops_samples_older_than_the_window(database_url):
    store = SqlStore(database_url, max_samples_per_device=100, retention_s=10.0)
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
