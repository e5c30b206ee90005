"""Several inventory replicas on one database: each node polled by exactly one live replica.

The store's claims (``claim_nodes``: leases on node rows, fair shares from heartbeats) on both
engines with ``now`` driven by the tests; two ``Inventory`` replicas run on the poller's schedule
(a poll cycle every interval, take-over checks between) by calling its steps at chosen times, to
show a dead replica's nodes polled again within two intervals of its last poll; concurrent claims
on PostgreSQL from two engines; and two real inventory servers sharing a PostgreSQL database.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from _inventory_helpers import register

from accelmesh.errors import InvalidArgument
from accelmesh.hardware.model import NodeDescription
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from inventory_svc.config import InventoryConfig
from inventory_svc.inventory import Inventory
from inventory_svc.poller import CLAIMS_PER_INTERVAL, LEASE_PER_INTERVAL, TAKEOVER_INTERVALS
from inventory_svc.server import build_inventory
from inventory_svc.store import SqlStore
from inventory_svc.tables import nodes

from conftest import make_worker, mesh_stub

pytestmark = pytest.mark.fixture_cpu

INTERVAL_S = 5.0
LEASE_S = LEASE_PER_INTERVAL * INTERVAL_S
STEP_S = INTERVAL_S / CLAIMS_PER_INTERVAL  # the poller's tick
ADDRESSES = [f"node-{i:02d}:50051" for i in range(10)]
ROUNDS = 10


def _register_all(store: SqlStore) -> None:
    for address in ADDRESSES:
        store.upsert_node(address, "10.0.0.1", "host", now=0.0)


def _held(store: SqlStore) -> dict[str, str | None]:
    """Each node's poller, as the database has it."""
    with store.engine.connect() as conn:
        return dict(conn.execute(sa.select(nodes.c.address, nodes.c.poller)).all())


def _addresses(records) -> list[str]:
    return [record.address for record in records]


@pytest.fixture
def stores(database_url):
    """Two stores (two engines) on one database holding ten nodes, as two replicas have it."""
    first, second = SqlStore(database_url), SqlStore(database_url)
    _register_all(first)
    yield first, second
    first.close()
    second.close()


# -- the store's claims ------------------------------------------------------------------------


def test_the_bound_the_lease_promises_is_under_two_intervals_and_the_lease_outlasts_one():
    assert 1.0 < LEASE_PER_INTERVAL and TAKEOVER_INTERVALS < 2.0


def test_a_replica_alone_claims_every_node_and_keeps_them_when_it_renews(stores):
    store, _ = stores
    assert _addresses(store.claim_nodes("a", now=0.0, lease_s=LEASE_S)) == ADDRESSES
    assert _addresses(store.claim_nodes("a", now=INTERVAL_S, lease_s=LEASE_S)) == ADDRESSES
    assert set(_held(store).values()) == {"a"}


def test_two_live_replicas_split_ten_nodes_five_and_five_and_keep_their_halves(stores):
    first, second = stores
    first.heartbeat("a", now=0.0, lease_s=LEASE_S)
    second.heartbeat("b", now=0.0, lease_s=LEASE_S)
    for now in (0.0, INTERVAL_S, 2 * INTERVAL_S):
        a = _addresses(first.claim_nodes("a", now, LEASE_S))
        b = _addresses(second.claim_nodes("b", now, LEASE_S))
        assert len(a) == len(b) == 5 and sorted(a + b) == ADDRESSES
        assert _held(first) == {**dict.fromkeys(a, "a"), **dict.fromkeys(b, "b")}


def test_a_replica_that_starts_later_gets_its_share_once_the_first_gives_back_its_excess(stores):
    first, second = stores
    assert len(first.claim_nodes("a", 0.0, LEASE_S)) == 10  # alone: all of them
    second.heartbeat("b", now=1.0, lease_s=LEASE_S)
    assert second.claim_nodes("b", 1.0, LEASE_S, renew=False) == []  # all held, and live
    a = _addresses(first.claim_nodes("a", INTERVAL_S, LEASE_S))
    assert a == ADDRESSES[:5]  # gave back the last five by address
    b = _addresses(second.claim_nodes("b", INTERVAL_S + STEP_S, LEASE_S, renew=False))
    assert b == ADDRESSES[5:]


def test_a_replica_that_stops_claiming_loses_its_nodes_when_its_leases_lapse_and_not_before(stores):
    first, second = stores
    last_claim, takeover = 0.0, LEASE_S
    first.heartbeat("a", last_claim, LEASE_S)
    second.heartbeat("b", last_claim, LEASE_S)
    a = _addresses(first.claim_nodes("a", last_claim, LEASE_S))  # a's last claim
    b = _addresses(second.claim_nodes("b", last_claim, LEASE_S))
    assert set(a).isdisjoint(b)
    assert _addresses(second.claim_nodes("b", takeover - STEP_S, LEASE_S, renew=False)) == b
    assert _addresses(second.claim_nodes("b", takeover, LEASE_S, renew=False)) == ADDRESSES
    assert set(_held(first).values()) == {"b"} and takeover - last_claim <= 2 * INTERVAL_S


def test_released_nodes_are_taken_at_once_by_the_replica_left(stores):
    first, second = stores
    first.heartbeat("a", 0.0, LEASE_S)
    second.heartbeat("b", 0.0, LEASE_S)
    a = _addresses(first.claim_nodes("a", 0.0, LEASE_S))
    second.claim_nodes("b", 0.0, LEASE_S)
    assert first.release_nodes("a") == len(a) == 5
    assert _addresses(second.claim_nodes("b", 0.0, LEASE_S, renew=False)) == ADDRESSES


@pytest.mark.parametrize("call", [
    lambda s: s.claim_nodes("", 0.0, LEASE_S), lambda s: s.claim_nodes("a", 0.0, 0.0),
    lambda s: s.heartbeat("a", 0.0, -1.0),
])
def test_a_claim_without_a_replica_or_a_positive_lease_is_refused(stores, call):
    with pytest.raises(InvalidArgument, match="replica|lease_s"):
        call(stores[0])


# -- two Inventory replicas on the poller's schedule -------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _replica(store: SqlStore, name: str, clock: Clock, polls: list) -> Inventory:
    """A replica whose nodes answer with an empty description, noting who polled what, when."""

    def describe(address, device_ids):
        polls.append((name, address, clock.now))
        return NodeDescription("10.0.0.1", "host", (), ())

    return Inventory(store, describe, clock=clock, poll_interval_s=INTERVAL_S, replica_id=name, poll_workers=4)


def _tick(inventory: Inventory, tick: int) -> None:
    """What the poller does at its ``tick``-th step: a poll cycle every CLAIMS_PER_INTERVAL."""
    inventory.poll_all() if tick % CLAIMS_PER_INTERVAL == 0 else inventory.take_over()


@pytest.mark.parametrize("last_tick", [8, 11])  # a dies right after a poll cycle, or just before the next
@pytest.mark.parametrize("phase", [0.0, 0.4, 0.9])  # where b's ticks fall between a's, in ticks
def test_the_nodes_of_a_replica_that_died_are_polled_by_the_other_within_two_intervals(stores, last_tick, phase):
    clock, polls = Clock(), []
    a, b = (_replica(store, name, clock, polls) for store, name in zip(stores, "ab"))
    events = sorted([(k * STEP_S, "a", k) for k in range(last_tick + 1)]
                    + [((k + phase) * STEP_S, "b", k) for k in range(last_tick + 4 * CLAIMS_PER_INTERVAL)])
    try:
        for now, name, tick in events:
            clock.now = now
            _tick(a if name == "a" else b, tick)
        died_at = last_tick * STEP_S
        for window in range(int(died_at // INTERVAL_S)):  # while both live: each node once an interval
            start = window * INTERVAL_S + phase * STEP_S
            polled = [address for _, address, t in polls if start <= t < start + INTERVAL_S]
            assert sorted(polled) == ADDRESSES
        by_a = {address for name, address, _ in polls if name == "a"}
        assert len(by_a) == 5
        for address in by_a:
            last_by_a = max(t for name, node, t in polls if name == "a" and node == address)
            next_by_b = min(t for name, node, t in polls if name == "b" and node == address and t > last_by_a)
            assert next_by_b - last_by_a <= TAKEOVER_INTERVALS * INTERVAL_S <= 2 * INTERVAL_S
        assert set(_held(stores[0]).values()) == {"b"}
    finally:
        b.close()
        a.close()


def test_a_replica_closing_cleanly_hands_its_nodes_to_the_other_at_once(stores):
    clock, polls = Clock(), []
    a, b = (_replica(store, name, clock, polls) for store, name in zip(stores, "ab"))
    try:
        held_by_a = set(a.poll_all())
        assert len(held_by_a) == 5 and set(b.poll_all()).isdisjoint(held_by_a)
        a.close()
        assert set(b.take_over()) == held_by_a  # at the same now: nothing had to lapse
        assert sorted(b.poll_all()) == ADDRESSES
    finally:
        b.close()


# -- PostgreSQL: claims racing from two engines ------------------------------------------------


def test_two_replicas_claiming_at_once_never_both_get_a_node(postgres_url):
    first, second = SqlStore(postgres_url), SqlStore(postgres_url)
    _register_all(first)
    try:
        for round_ in range(ROUNDS):
            now = round_ * 100.0
            for store, name in ((first, "a"), (second, "b")):
                store.release_nodes(name)
                store.heartbeat(name, now, LEASE_S)
            barrier, claimed = threading.Barrier(2), {}

            def claim(store: SqlStore, name: str, barrier=barrier, claimed=claimed, now=now) -> None:
                barrier.wait()
                claimed[name] = _addresses(store.claim_nodes(name, now, LEASE_S))

            threads = [threading.Thread(target=claim, args=pair) for pair in ((first, "a"), (second, "b"))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert set(claimed["a"]).isdisjoint(claimed["b"]), (round_, claimed)
            assert len(claimed["a"]) <= 5 and len(claimed["b"]) <= 5
            expected = {address: None for address in ADDRESSES}
            expected.update({**dict.fromkeys(claimed["a"], "a"), **dict.fromkeys(claimed["b"], "b")})
            assert _held(first) == expected
    finally:
        first.close()
        second.close()


# -- two inventory servers on one PostgreSQL database ------------------------------------------


def test_two_inventory_servers_poll_each_node_once_and_the_survivor_polls_both(postgres_url):
    workers = [make_worker(), make_worker(emulate=(), cpu_devices=0, hostname="node-b")]
    started = []
    try:
        for _ in range(2):
            config = InventoryConfig(listen="127.0.0.1:0", db=postgres_url, poll_interval_s=INTERVAL_S)
            server, inventory = build_inventory(config, start_poller=False)
            started.append((server.start(), inventory))
        (first, first_domain), (second, second_domain) = started
        for (server, _), worker in zip(started, workers):
            register(mesh_stub(inventory_service_pb2_grpc.InventoryServiceStub, f"127.0.0.1:{server.port}"), worker)
        addresses = sorted(f"127.0.0.1:{worker.port}" for worker in workers)
        for _ in range(2):
            by_first, by_second = first_domain.poll_all(), second_domain.poll_all()
            assert len(by_first) == len(by_second) == 1 and sorted([*by_first, *by_second]) == addresses
            assert all(by_first.values()) and all(by_second.values())
        first.stop(0)  # a clean stop hands its node back: the next cycle of the other polls both
        assert second_domain.poll_all() == dict.fromkeys(addresses, True)
    finally:
        for server, _ in started:
            server.stop(0)
        for worker in workers:
            worker.stop(0)
