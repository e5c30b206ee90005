"""SqlStore on both engines: removing a node (RemoveNode) and forgetting the nodes lost too long
(``forget_lost_nodes``). What leaves, what is refused while jobs hold the node's devices, what
other replicas read of it in the change feed, and that a removed node may register again."""

from __future__ import annotations

import pytest
from store_records import GB, NODE, one_device_fixture, report, sample, spec, store_fixture  # noqa: F401 (fixtures)

from accelmesh.errors import FailedPrecondition, NotFound
from inventory_svc.records import DeviceChange
from inventory_svc.store import SqlStore

OTHER = "10.0.0.2:50051"


def _two_nodes(store: SqlStore) -> tuple:
    """NODE with two GPUs and OTHER with one, each reported once at t=0."""
    mine, theirs = [spec(index=0), spec(index=1)], [spec(ip="10.0.0.2")]
    store.upsert_node(NODE, "10.0.0.1", "host-a", now=0.0)
    store.upsert_node(OTHER, "10.0.0.2", "host-b", now=0.0)
    store.record_poll_success(NODE, report(mine, [sample(d, 0.0) for d in mine]), now=0.0)
    store.record_poll_success(OTHER, report(theirs, [sample(theirs[0], 0.0)], ip="10.0.0.2"), now=0.0)
    return mine, theirs


def test_removing_a_node_takes_its_devices_and_samples_and_leaves_the_other_nodes(store):
    mine, theirs = _two_nodes(store)
    removed = store.remove_node(NODE, now=1.0)
    assert removed.node.address == NODE and removed.node.hostname == "host-10.0.0.1"
    assert [d.id for d in removed.devices] == [mine[0].id, mine[1].id]
    assert removed.released == ()
    assert [n.address for n in store.list_nodes()] == [OTHER]
    assert [d.id for d in store.list_devices(now=1.0)[0]] == [theirs[0].id]
    assert store.samples(mine[0].id) == [] and len(store.samples(theirs[0].id)) == 1
    with pytest.raises(NotFound):
        store.get_device(mine[0].id)
    # No replica polls it any more: the poll leases are claimed from the nodes left.
    assert [n.address for n in store.claim_nodes("replica", now=1.0, lease_s=7.5)] == [OTHER]


def test_another_replica_reads_the_removal_of_each_device_in_the_change_feed(database_url):
    writer, reader = SqlStore(database_url), SqlStore(database_url)
    try:
        mine, _ = _two_nodes(writer)
        cursor = reader.change_cursor()
        writer.remove_node(NODE, now=1.0)
        changes, _ = reader.read_changes(cursor)
        assert [e for c in changes for e in c.events] == [DeviceChange("removed", d.id) for d in mine]
    finally:
        writer.close()
        reader.close()


def test_an_unknown_address_is_not_found_naming_the_field_and_how_to_list_nodes(store):
    _two_nodes(store)
    with pytest.raises(NotFound) as info:
        store.remove_node("10.9.9.9:1", now=1.0)
    assert info.value.field == "address"
    assert "'10.9.9.9:1' is not registered" in str(info.value) and "accelmesh nodes list" in str(info.value)
    assert len(store.list_nodes()) == 2


def test_a_node_whose_devices_jobs_hold_is_refused_naming_them_until_forced(store):
    mine, _ = _two_nodes(store)
    store.reserve("job-b", mine[1].id, 10 * GB, 0.5, ttl_s=60.0, now=0.0)
    store.reserve("job-a", mine[0].id, 10 * GB, 0.5, ttl_s=60.0, now=0.0)
    with pytest.raises(FailedPrecondition) as info:
        store.remove_node(NODE, now=1.0)
    assert "job(s) job-a, job-b" in str(info.value) and "--force" in str(info.value)
    assert len(store.list_nodes()) == 2 and len(store.reservations()) == 2  # nothing went
    removed = store.remove_node(NODE, now=1.0, force=True)
    assert sorted((r.job_id, r.device_id) for r in removed.released) == [("job-a", mine[0].id), ("job-b", mine[1].id)]
    assert store.reservations() == []


def test_a_lapsed_reservation_does_not_hold_a_node_back(store, one_device):
    store.reserve("job-old", one_device.id, GB, 0.1, ttl_s=10.0, now=0.0)
    removed = store.remove_node(NODE, now=10.0)  # the lease ended at 10
    assert removed.released == () and store.reservations() == []


def test_a_removed_node_registers_again_as_a_new_one(store, one_device):
    store.remove_node(NODE, now=1.0)
    store.upsert_node(NODE, "10.0.0.1", "host", now=2.0)
    changes = store.record_poll_success(NODE, report([one_device], [sample(one_device, 2.0)]), now=2.0)
    assert changes == [DeviceChange("added", one_device.id)]
    node = store.get_node(NODE)
    assert node.registered_at == 2.0 and node.state == "active"
    assert store.get_device(one_device.id, now=2.0).first_seen_at == 2.0


def _lose(store: SqlStore, address: str, now: float) -> None:
    store.record_poll_failure(address, "connection refused", now, lost_after=1)


def test_a_lost_node_is_forgotten_only_once_silent_since_before_the_limit(store):
    mine, theirs = _two_nodes(store)  # both last answered at t=0
    store.reserve("job-a", mine[0].id, GB, 0.1, ttl_s=3600.0, now=0.0)
    _lose(store, NODE, now=5.0)
    assert store.forget_lost_nodes(silent_since=0.0, now=100.0) == []  # silent exactly since the limit: kept
    forgotten = store.forget_lost_nodes(silent_since=0.5, now=100.0)
    assert [r.node.address for r in forgotten] == [NODE]
    assert [r.job_id for r in forgotten[0].released] == ["job-a"]  # as RemoveNode with force
    # OTHER answered at 0 too, but it is not lost: silence alone never forgets a node.
    assert [n.address for n in store.list_nodes()] == [OTHER]
    assert [d.id for d in store.list_devices(now=100.0)[0]] == [theirs[0].id]


def test_a_node_that_answers_again_is_not_forgotten(store, one_device):
    _lose(store, NODE, now=5.0)
    store.record_poll_success(NODE, report([one_device], [sample(one_device, 50.0)]), now=50.0)
    assert store.forget_lost_nodes(silent_since=40.0, now=100.0) == []
    assert store.get_node(NODE).state == "active"


def test_two_replicas_forgetting_at_once_remove_a_node_once(database_url):
    first, second = SqlStore(database_url), SqlStore(database_url)
    try:
        _two_nodes(first)
        _lose(first, NODE, now=5.0)
        assert [r.node.address for r in first.forget_lost_nodes(silent_since=10.0, now=100.0)] == [NODE]
        assert second.forget_lost_nodes(silent_since=10.0, now=100.0) == []
        assert [n.address for n in second.list_nodes()] == [OTHER]
    finally:
        first.close()
        second.close()
