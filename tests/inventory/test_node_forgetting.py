"""Forgetting lost nodes: an ``Inventory`` on a real store, its clock and its node (``describe``)
injected, so hours of silence pass in a call. A node lost for less than ``forget_lost_after_s``
stays, one lost longer is removed by the next poll cycle as RemoveNode with force would, and 0
never forgets; and the setting is read, and refused, as the other inventory settings are."""

from __future__ import annotations

import pytest
from store_records import NODE, sample, spec

from accelmesh import errors
from accelmesh.hardware.model import NodeDescription
from inventory_svc import events as ev
from inventory_svc.config import parse_args
from inventory_svc.inventory import Inventory
from inventory_svc.store import SqlStore

HOUR_S = 3600.0
GPU = spec()


class Clock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Node:
    """The one worker, answering until told to stop."""

    def __init__(self, clock: Clock):
        self.clock, self.answers = clock, True

    def __call__(self, address, device_ids) -> NodeDescription:
        if not self.answers:
            raise errors.Unavailable(f"{address} did not answer: connection refused")
        return NodeDescription("10.0.0.1", "host", (GPU,), (sample(GPU, self.clock.now),))


@pytest.fixture
def lost_node(database_url):
    """An inventory (lost after one missed poll) whose one node last answered at t=1000 and
    was found lost at t=1005; returns a builder taking ``forget_lost_after_s``."""
    stores, built = [], []

    def build(forget_lost_after_s: float):
        clock = Clock()
        node = Node(clock)
        store = SqlStore(database_url)
        stores.append(store)
        inventory = Inventory(store, node, clock=clock, lost_after_polls=1, poll_workers=2,
                              forget_lost_after_s=forget_lost_after_s)
        built.append(inventory)
        inventory.register_node(NODE)
        store.reserve("job-1", GPU.id, 10**9, 0.5, ttl_s=24 * HOUR_S, now=clock.now)
        node.answers = False
        clock.now += 5
        assert inventory.poll_all() == {NODE: False}
        assert store.get_node(NODE).state == "lost"
        return inventory, clock

    yield build
    for inventory in built:
        inventory.close()
    for store in stores:
        store.close()


def test_a_node_lost_for_less_than_the_limit_stays_and_one_lost_longer_is_forgotten(lost_node):
    inventory, clock = lost_node(HOUR_S)
    watch = inventory.hub.subscribe()
    clock.now = 1_000 + HOUR_S  # silent for exactly the limit: not longer
    assert inventory.poll_all() == {NODE: False}
    assert [n.address for n in inventory.store.list_nodes()] == [NODE]
    clock.now += 1
    assert inventory.poll_all() == {NODE: False}  # polled once more, then forgotten in the same cycle
    assert inventory.poll_all() == {}  # and never polled again
    assert inventory.store.list_nodes() == []
    assert inventory.store.reservations() == []  # as a forced removal: the job's lease ended with it
    inventory.follow()
    assert len(inventory.index) == 0
    watch.close()
    events = list(watch)
    assert [(e.kind, e.device_id) for e in events] == [(ev.REMOVED, GPU.id)]
    assert events[0].record.spec.type == "a100-80gb" and events[0].record.node_address == NODE


def test_zero_never_forgets(lost_node):
    inventory, clock = lost_node(0)
    clock.now += 20 * HOUR_S  # within the lease of job-1 (24 h)
    assert inventory.poll_all() == {NODE: False}
    assert [n.state for n in inventory.store.list_nodes()] == ["lost"]
    assert [r.job_id for r in inventory.store.reservations()] == ["job-1"]


def test_a_forgotten_node_registers_again_as_a_new_one(lost_node):
    inventory, clock = lost_node(60.0)
    clock.now += 120
    inventory.poll_all()
    assert inventory.store.list_nodes() == []
    inventory._describe.answers = True
    node, devices = inventory.register_node(NODE)
    assert node.state == "active" and node.registered_at == clock.now and [d.id for d in devices] == [GPU.id]


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, HOUR_S),
    ([], {"ACCELMESH_FORGET_LOST_AFTER_S": "600"}, 600.0),
    (["--forget-lost-after", "0"], {"ACCELMESH_FORGET_LOST_AFTER_S": "600"}, 0.0),  # the flag wins
])
def test_the_limit_comes_from_the_flag_or_the_environment(argv, env, expected):
    assert parse_args(argv, env={"ACCELMESH_INSECURE": "1", **env}).forget_lost_after_s == expected


@pytest.mark.parametrize("argv, env, words", [
    (["--forget-lost-after", "-1"], {}, "--forget-lost-after (ACCELMESH_FORGET_LOST_AFTER_S) is -1"),
    (["--forget-lost-after", "nan"], {}, "0 means lost nodes are never forgotten"),
    ([], {"ACCELMESH_FORGET_LOST_AFTER_S": "an hour"}, "ACCELMESH_FORGET_LOST_AFTER_S='an hour' is not a number"),
    ([], {"ACCELMESH_FORGET_LOST_AFTER_S": "-5"}, "ACCELMESH_FORGET_LOST_AFTER_S=-5.0 is below the minimum 0"),
])
def test_a_bad_limit_is_refused_naming_the_setting(argv, env, words):
    with pytest.raises(errors.InvalidArgument) as info:
        parse_args(argv, env={"ACCELMESH_INSECURE": "1", **env})
    assert words in str(info.value)
