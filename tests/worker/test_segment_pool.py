"""The object store's pool of freed segments (worker_svc/segments.py): reused by the same owner's
next object of about their size, never by another owner's, and within the store's bound."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _store_clock import clock_fixture  # noqa: F401  (fixture: pytest finds it in this module)

from worker_svc.objects import ObjectStore
from worker_svc.segments import POOL_IDLE_S, POOL_MIN_BYTES, SEGMENT_PREFIX

SMALLEST = POOL_MIN_BYTES  # the smallest segment the pool keeps


@pytest.fixture
def store(tmp_path, clock):
    made = ObjectStore(4 * SMALLEST, root=str(tmp_path), ttl_s=600.0, wait_s=0.0, clock=clock)
    yield made
    made.close()


def segments(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(SEGMENT_PREFIX))


def test_a_freed_segment_is_reused_by_the_same_owners_next_object_with_the_new_bytes(store, tmp_path):
    first = store.put_array("user:a|job-1", "out/0", np.full(SMALLEST, 7, np.uint8))
    path = first.path
    assert store.release("user:a|job-1") == (1, SMALLEST)
    assert os.path.exists(path) and store.stats().pooled_bytes == SMALLEST and store.stats().used_bytes == 0
    again = store.put_array("user:a|job-2", "out/0", np.arange(SMALLEST, dtype=np.uint8))
    assert again.path == path and store.stats().pooled_bytes == 0 and store.stats().used_bytes == SMALLEST
    np.testing.assert_array_equal(store.get("user:a|job-2", "out/0").array(), np.arange(SMALLEST, dtype=np.uint8))


def test_another_owner_never_gets_a_pooled_segment(store, tmp_path):
    mine = store.put_array("user:a|job-1", "x", np.full(SMALLEST, 1, np.uint8))
    store.release("user:a|job-1")
    theirs = store.create("user:b|job-9", "x", np.uint8, (SMALLEST,))
    assert theirs.path != mine.path and os.path.exists(mine.path)
    assert theirs.array().tolist() == [0] * SMALLEST  # a new segment: zeroes, not user:a's sevens


def test_a_segment_much_larger_than_the_object_is_not_taken(store):
    big = store.put_array("user:a|job-1", "x", np.zeros(3 * SMALLEST, np.uint8))
    store.release("user:a|job-1")
    small = store.create("user:a|job-2", "x", np.uint8, (SMALLEST,))
    assert small.path != big.path and small.capacity == SMALLEST


def test_a_segment_whose_view_is_still_used_is_pooled_only_once_the_view_is_gone(store):
    obj = store.put_array("user:a|job-1", "x", np.full(SMALLEST, 3, np.uint8))
    view = store.get("user:a|job-1", "x").array()
    store.release("user:a|job-1")
    assert store.stats().pooled_bytes == 0 and store.stats().used_bytes == 0
    other = store.put_array("user:a|job-2", "y", np.full(SMALLEST, 5, np.uint8))
    assert other.path != obj.path  # not handed out while the view may still read it
    assert int(view[0]) == 3  # the view keeps its pages, and its bytes
    del view
    store.expire()  # the view is gone: its segment goes to the pool now
    assert store.stats().pooled_bytes == SMALLEST
    again = store.put_array("user:a|job-3", "z", np.full(SMALLEST, 9, np.uint8))
    assert again.path == obj.path and int(again.array()[0]) == 9


def test_a_segment_still_viewed_when_the_store_closes_is_unlinked(store, tmp_path):
    obj = store.put_array("user:a|job-1", "x", np.full(SMALLEST, 3, np.uint8))
    view = store.get("user:a|job-1", "x").array()
    store.release("user:a|job-1")
    store.close()
    assert not os.path.exists(obj.path) and int(view[0]) == 3


def test_pooled_bytes_count_in_the_bound_and_give_way_to_a_create(store, tmp_path):
    store.put_array("user:a|job-1", "x", np.zeros(3 * SMALLEST, np.uint8))
    store.release("user:a|job-1")
    assert store.stats().pooled_bytes == 3 * SMALLEST
    other = store.create("user:b|job-2", "x", np.uint8, (2 * SMALLEST,))  # 3 + 2 MiB would pass the 4 MiB bound
    stats = store.stats()
    assert (stats.used_bytes, stats.pooled_bytes) == (2 * SMALLEST, 0)
    assert segments(tmp_path) == [os.path.basename(other.path)]


def test_a_segment_pooled_for_long_is_unlinked_and_close_unlinks_the_rest(store, tmp_path, clock):
    old = store.put_array("user:a|job-1", "x", np.zeros(SMALLEST, np.uint8))
    store.release("user:a|job-1")
    clock.now += POOL_IDLE_S / 2
    recent = store.put_array("user:a|job-2", "x", np.zeros(2 * SMALLEST, np.uint8))
    store.release("user:a|job-2")
    clock.now += POOL_IDLE_S / 2
    store.expire()
    assert not os.path.exists(old.path) and os.path.exists(recent.path)
    assert store.stats().pooled_bytes == 2 * SMALLEST
    store.close()
    assert segments(tmp_path) == []


def test_small_segments_are_unlinked_when_freed(store, tmp_path):
    store.put_array("user:a|job-1", "x", np.zeros(SMALLEST - 1, np.uint8))
    store.release("user:a|job-1")
    assert segments(tmp_path) == [] and store.stats().pooled_bytes == 0


def test_a_take_gets_the_smallest_segment_that_fits_and_of_those_the_one_pooled_last():
    from worker_svc.segments import SegmentPool

    pool = SegmentPool()
    kib = 1024
    for name, capacity in [("a", 64 * kib), ("b", 32 * kib), ("c", 48 * kib), ("d", 32 * kib)]:
        assert pool.give("user:a", f"/pool/{name}", capacity, now=1.0)
    assert not pool.give("user:a", "/pool/tiny", POOL_MIN_BYTES - 1, now=1.0)  # unlinked by the caller
    assert pool.take("user:b", 30 * kib, room=1 << 30) is None  # another owner's are not offered
    assert pool.take("user:a", 30 * kib, room=1 << 30).path == "/pool/d"
    assert pool.take("user:a", 40 * kib, room=1 << 30).path == "/pool/c"
    assert pool.take("user:a", 20 * kib, room=1 << 30).path == "/pool/b"
    assert pool.take("user:a", 20 * kib, room=1 << 30) is None  # 64 KiB would leave more than half unused
    assert pool.take("user:a", 60 * kib, room=32 * kib) is None  # more than the bound has room for
    assert pool.take("user:a", 60 * kib, room=1 << 30).path == "/pool/a"
    assert pool.count == 0 and pool.bytes == 0
