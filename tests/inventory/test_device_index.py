"""The device index ScoreDevices ranks from (index.py, ranking.py) and the change feed that keeps
it current (changes.py), on both engines: its rankings against scoring.score_devices over the
records the SQL path decodes, to the last bit, for every filter and profile; changes written by
another store (another replica) seen by the next ranking; on PostgreSQL, a change behind an older
running transaction held back until that one ends, never lost; leases lapsing at their expiry;
the feed's order, pruning, and the reload of a replica that could not follow."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from store_records import GB, report, store_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import NotFound
from accelmesh.hardware.catalog import load_catalog
from accelmesh.hardware.model import DeviceSample, device_id
from inventory_svc.changes import Change
from inventory_svc.filtering import DeviceFilter, Term, parse_filter
from inventory_svc.index import DeviceIndex
from inventory_svc.inventory import Claim, Inventory
from inventory_svc.records import DeviceChange
from inventory_svc.scoring import TaskProfile, Weights, score_devices, weights_for
from inventory_svc.store import SqlStore

NODES = 12
DEVICES_PER_NODE = 4
NOW = 1_000.0


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _address(node: int) -> str:
    return f"10.0.0.{node + 1}:50070"


def _fleet(db: SqlStore, seed: int = 7) -> list:
    """NODES nodes of catalog devices under random load, but nodes 0..3: the same four idle
    devices each (ties on score, broken by id); node 5's devices emulated."""
    rng = random.Random(seed)
    catalog = [load_catalog()[name] for name in sorted(load_catalog())]
    specs = []
    for node in range(NODES):
        ip = f"10.0.0.{node + 1}"
        db.upsert_node(_address(node), ip, f"host-{node}", now=0.0)
        idle = node < 4
        devices = [dataclasses.replace(catalog[(k if idle else node * DEVICES_PER_NODE + k) % len(catalog)]
                                       .device_spec(ip, k), emulated=node == 5)
                   for k in range(DEVICES_PER_NODE)]
        samples = [DeviceSample(d.id, NOW - 1, d.performance.memory_bytes,
                                0 if idle else int(d.performance.memory_bytes * rng.uniform(0, 0.9)),
                                0.0 if idle else rng.uniform(0, 1)) for d in devices]
        db.record_poll_success(_address(node), report(devices, samples, ip), now=NOW - 1)
        specs += devices
    # One node stops reporting a device (lost), reservations (one lapsed) on a few others.
    last = specs[-DEVICES_PER_NODE:]
    db.record_poll_success(_address(NODES - 1), report(last[:-1], (), last[0].node_ip), now=NOW - 1)
    db.reserve_many("job-a", [(specs[5].id, 4 * GB, 0.5), (specs[9].id, 1 * GB, 0.25)], 600.0, NOW - 1)
    db.reserve_many("job-b", [(specs[5].id, 2 * GB, 0.25)], 600.0, NOW - 1)
    db.reserve_many("job-c", [(specs[13].id, 8 * GB, 1.0)], 0.5, NOW - 1)  # lapsed by NOW
    return specs


@pytest.fixture
def fleet(database_url):
    db, clock = SqlStore(database_url), Clock()
    specs = _fleet(db)
    inventory = Inventory(db, lambda address, ids: None, clock=clock)
    yield SimpleNamespace(store=db, inventory=inventory, specs=specs, clock=clock)
    inventory.close()
    db.close()


def _reference(inventory: Inventory, profile: TaskProfile, filter_text: str, limit: int, ids=()):
    """What ScoreDevices answered before the index: every candidate read, decoded and scored."""
    flt = parse_filter(filter_text)
    records = ([inventory.store.get_device(d, NOW) for d in dict.fromkeys(ids)] if ids
               else inventory.all_devices(flt))
    candidates = [r for r in records if flt.matches(r)]
    return score_devices(candidates, profile, limit or None), weights_for(profile, candidates)


def _as_tuples(scored) -> list[tuple]:
    return [(s.record, s.score, s.components, s.status, s.weights) for s in scored]


PROFILES = [TaskProfile("training", "bf16"), TaskProfile("inference"), TaskProfile("inference", "fp16", 3.0),
            TaskProfile("training", weights=Weights(1, 2, 0))]
FILTERS = ["", "capabilities:bf16", 'platform = "cuda" AND free_memory_bytes >= 20000000000', 'health = "lost"',
           'type != "a100-80gb"', "emulated = false", 'node = "10.0.0.3:50070"', 'kind = "no such kind"',
           "free_memory_bytes < 1"]


@pytest.mark.parametrize("filter_text", FILTERS)
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.kind}-{p.precision}-{p.weights is not None}")
def test_the_index_ranks_exactly_as_scoring_the_decoded_records_does(fleet, profile, filter_text):
    for limit in (0, 3):
        ranking = fleet.inventory.score(profile, filter_text, limit)
        expected, weights = _reference(fleet.inventory, profile, filter_text, limit)
        assert _as_tuples(ranking.devices) == _as_tuples(expected) and ranking.weights == weights


def test_the_index_ranks_named_devices_as_the_reference_and_refuses_unknown_ones(fleet):
    specs = fleet.specs
    named = [specs[5].id, specs[0].id, specs[20].id, specs[5].id, specs[-1].id]  # a repeat; the last is lost
    ranking = fleet.inventory.score(PROFILES[0], "", 0, named)
    expected, _ = _reference(fleet.inventory, PROFILES[0], "", 0, named)
    assert _as_tuples(ranking.devices) == _as_tuples(expected) and len(expected) == 3
    with pytest.raises(NotFound, match="10.9.9.9/cuda:0"):
        fleet.inventory.score(PROFILES[0], "", 0, [specs[0].id, "10.9.9.9/cuda:0"])


def test_ties_go_to_the_lower_device_id_as_in_the_reference(fleet):
    first = fleet.specs[0]
    tied = [s for s in fleet.inventory.score(TaskProfile("training"), "", 0).devices
            if s.record.spec.type == first.type and not s.record.latest.memory_used_bytes]
    assert len(tied) == 4 and len({s.score for s in tied}) == 1
    assert [s.record.id for s in tied] == sorted(s.record.id for s in tied)


def test_a_term_the_columns_cannot_answer_is_filtered_record_by_record(fleet):
    flt = DeviceFilter((Term("type", "<", "c"),))  # hand-built: the grammar compares strings only with = and !=
    ranked, _ = fleet.inventory.index.score(PROFILES[1], flt, 0, NOW)
    assert {s.record.spec.type for s in ranked} == {"a100-40gb", "a100-80gb"}


def test_device_counts_per_node_match_the_stored_devices(fleet):
    counts: dict[str, int] = {}
    for record in fleet.inventory.all_devices(DeviceFilter(include_lost=True)):
        counts[record.node_address] = counts.get(record.node_address, 0) + 1
    assert fleet.inventory.device_counts() == counts and sum(counts.values()) == NODES * DEVICES_PER_NODE


# -- changes written by another replica -------------------------------------------------------


def _ranked_ids(inventory: Inventory, filter_text: str = "") -> list[str]:
    return [s.record.id for s in inventory.score(TaskProfile("inference"), filter_text, 0).devices]


def test_every_kind_of_change_another_store_writes_is_in_the_next_ranking(fleet, database_url):
    inventory, specs = fleet.inventory, fleet.specs
    other = SqlStore(database_url)  # another replica's store on the same database
    try:
        best = _ranked_ids(inventory)[0]
        node = next(s for s in specs if s.id == best)
        address = _address(int(node.node_ip.rsplit(".", 1)[1]) - 1)
        siblings = [s for s in specs if s.node_ip == node.node_ip]
        # A newer sample: the best device is now fully used and busy, so it drops.
        busy = [DeviceSample(s.id, NOW, s.performance.memory_bytes, s.performance.memory_bytes, 1.0) for s in siblings]
        other.record_poll_success(address, report(siblings, busy, node.node_ip), now=NOW)
        assert _ranked_ids(inventory)[0] != best
        assert inventory.index.score(TaskProfile("inference"), parse_filter(f'node = "{address}"'), 1, NOW)[0][
            0].record.latest == next(b for b in busy if b.device_id == best)
        # The node stops reporting one device (lost), then reports a new one (added).
        other.record_poll_success(address, report(siblings[1:], (), node.node_ip), now=NOW + 1)
        assert siblings[0].id not in _ranked_ids(inventory)
        assert siblings[0].id in _ranked_ids(inventory, 'health = "lost"')
        fresh = load_catalog()["h100-sxm-80gb"].device_spec(node.node_ip, 7)
        other.record_poll_success(address, report([*siblings[1:], fresh], (), node.node_ip), now=NOW + 2)
        assert fresh.id in _ranked_ids(inventory, 'type = "h100-sxm-80gb"')
        # A reservation the other replica makes lowers free memory here; its release restores it.
        before = inventory.store.get_device(fresh.id, NOW).free_memory_bytes

        def free_here() -> int:
            scored = inventory.score(TaskProfile("inference"), "", 0, [fresh.id]).devices
            return scored[0].status.memory_free_bytes

        other.reserve_many("job-x", [(fresh.id, 30 * GB, 0.5)], 600.0, NOW)
        assert free_here() == before - 30 * GB
        other.renew("job-x", None, 1200.0, NOW)
        assert free_here() == before - 30 * GB
        other.release("job-x")
        assert free_here() == before
    finally:
        other.close()


def test_this_replicas_own_writes_are_in_its_next_ranking_at_once(fleet):
    inventory, target = fleet.inventory, fleet.specs[2].id
    free = inventory.score(TaskProfile("inference"), "", 0, [target]).devices[0].status.memory_free_bytes
    inventory.reserve("job-own", [Claim(target, GB, 0.5)], 60.0)
    scored = inventory.score(TaskProfile("inference"), "", 0, [target]).devices[0]
    assert scored.status.memory_free_bytes == free - GB and scored.record.reserved_compute_fraction == 0.5


def test_a_lease_stops_counting_at_its_expiry(fleet):
    target = fleet.specs[3].id
    fleet.store.reserve_many("job-short", [(target, 10 * GB, 0.5)], 5.0, NOW)

    def reserved() -> int:
        return fleet.inventory.score(TaskProfile("inference"), "", 0, [target]).devices[0].record.reserved_memory_bytes

    assert reserved() == 10 * GB
    fleet.clock.now = NOW + 5.0  # the lease ends at NOW + 5: no longer live, as in SQL's "expires_at > now"
    assert reserved() == 0 == fleet.store.get_device(target, NOW + 5.0).reserved_memory_bytes


# -- the feed itself --------------------------------------------------------------------------


def _write(db: SqlStore, device: str, ts: float) -> None:
    gpu = load_catalog()["a100-80gb"].device_spec("10.0.0.1", 0)
    assert gpu.id == device
    db.record_poll_success(_address(0), report([gpu], [DeviceSample(gpu.id, ts, 80 * GB, int(ts) * GB)]), now=ts)


def test_the_feed_gives_a_reader_the_other_writers_changes_in_commit_order_and_never_its_own(database_url):
    reader, writer = SqlStore(database_url), SqlStore(database_url)
    try:
        reader.upsert_node(_address(0), "10.0.0.1", "host", now=0.0)
        device = device_id("10.0.0.1", "cuda", 0)
        cursor = reader.change_cursor()
        _write(writer, device, 1.0)
        _write(reader, device, 2.0)
        _write(writer, device, 3.0)
        changes, cursor = reader.read_changes(cursor)
        assert [(c.writer, c.written_at) for c in changes] == [(writer.writer, 1.0), (writer.writer, 3.0)]
        assert changes[0].events == (DeviceChange("added", device),)
        assert [s.memory_used_bytes for c in changes for s in c.samples] == [1 * GB, 3 * GB]
        assert reader.read_changes(cursor)[0] == []
        mine, _ = writer.read_changes(0)
        assert [c.written_at for c in mine] == [2.0]
    finally:
        reader.close()
        writer.close()


def test_pruning_drops_old_rows_and_a_reader_still_gets_what_came_after(database_url):
    reader, writer = SqlStore(database_url), SqlStore(database_url)
    try:
        writer.upsert_node(_address(0), "10.0.0.1", "host", now=0.0)
        device = device_id("10.0.0.1", "cuda", 0)
        cursor = reader.change_cursor()
        _write(writer, device, 1.0)
        _write(writer, device, 2.0)
        assert writer.prune_changes(before=1.5) == 1
        _write(writer, device, 3.0)
        changes, _ = reader.read_changes(cursor)
        assert [c.written_at for c in changes] == [2.0, 3.0]
    finally:
        reader.close()
        writer.close()


def test_a_change_behind_an_older_running_transaction_waits_for_it_and_is_not_lost(postgres_url):
    """PostgreSQL commits concurrent transactions in any order: the reader's horizon (the oldest
    running transaction) keeps it from reading past a transaction that may still add a row."""
    reader, writer = SqlStore(postgres_url), SqlStore(postgres_url)
    try:
        writer.upsert_node(_address(0), "10.0.0.1", "host", now=0.0)
        device = device_id("10.0.0.1", "cuda", 0)
        cursor = reader.change_cursor()
        with writer.engine.connect() as older:  # a transaction with an id, begun before the change
            older.execute(sa.text("SELECT pg_current_xact_id()"))
            _write(writer, device, 1.0)
            held_back, cursor = reader.read_changes(cursor)
            assert held_back == []
            older.execute(sa.text("INSERT INTO inventory_changes (writer, written_at) VALUES ('older', 0.5)"))
            older.commit()
        changes, cursor = reader.read_changes(cursor)
        assert sorted(c.writer for c in changes) == sorted(["older", writer.writer])
        assert reader.read_changes(cursor)[0] == []
    finally:
        reader.close()
        writer.close()


def test_an_index_that_could_not_follow_for_too_long_reloads_everything(database_url):
    db, other = SqlStore(database_url), SqlStore(database_url)
    ticks = Clock(0.0)
    try:
        index = DeviceIndex(db, resync_after_s=10.0, monotonic=ticks)
        other.upsert_node(_address(0), "10.0.0.1", "host", now=0.0)
        _write(other, device_id("10.0.0.1", "cuda", 0), 1.0)
        ticks.now = 9.0
        assert [c.written_at for c in index.follow()] == [1.0] and len(index) == 1
        _write(other, device_id("10.0.0.1", "cuda", 0), 2.0)
        ticks.now = 20.0
        assert index.follow() is None  # reloaded: the feed may have been pruned past it
        assert index.follow() == []
        ranked, _ = index.score(TaskProfile("inference"), DeviceFilter(), 0, NOW)
        assert [s.record.latest.timestamp for s in ranked] == [2.0]
    finally:
        db.close()
        other.close()


def test_an_empty_change_writes_nothing_and_a_listener_failing_does_not_undo_the_write(store):
    heard: list[Change] = []

    def broken(change: Change) -> None:
        heard.append(change)
        raise RuntimeError("listener bug")

    store.add_listener(broken)
    store.upsert_node(_address(0), "10.0.0.1", "host", now=0.0)
    assert store.record_poll_failure(_address(0), "down", now=1.0, lost_after=3) == [] and heard == []
    _write(store, device_id("10.0.0.1", "cuda", 0), 1.0)
    assert len(heard) == 1 and store.get_device(device_id("10.0.0.1", "cuda", 0)).latest.timestamp == 1.0
