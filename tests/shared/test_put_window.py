"""object_client.PutWindow: a direct job's puts run at most its limit ahead of the shards said
finished; what was put for a shard (anywhere, a retry's too) is given back once it finished, and
a job's end lets every waiting put go."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from accelmesh import object_client
from accelmesh.object_client import PutWindow

WAIT_S = 30.0  # a bound on a thread's end, not a synchronisation: it fails the test if reached


def _waiter(window: PutWindow, shards: dict[int, int]) -> threading.Thread:
    """A put waiting for room; returns once the window counts it as waiting."""
    thread = threading.Thread(target=window.take, args=(shards,), daemon=True)
    thread.start()
    with window._changed:
        assert window._changed.wait_for(lambda: window.waiting == 1, WAIT_S)
    return thread


def test_a_put_past_the_limit_waits_until_shards_ahead_are_said_finished():
    window = PutWindow(100)
    window.take({0: 60})
    window.take({1: 40})  # exactly at the limit: it goes
    third = _waiter(window, {2: 10})
    window.finished([1])
    third.join(WAIT_S)
    assert not third.is_alive() and window.waiting == 0
    window.finished([0, 2])
    window.take({3: 100})  # the whole window again, at once


def test_a_shard_put_twice_gives_back_both_puts_once_finished():
    window = PutWindow(100)
    window.take({0: 50})
    window.take({0: 50})  # put again at another worker (a retry there)
    waiting = _waiter(window, {1: 1})
    window.finished([0])
    waiting.join(WAIT_S)
    assert not waiting.is_alive()


def test_a_group_larger_than_the_window_goes_alone_and_close_lets_every_put_go():
    window = PutWindow(10)
    window.take({0: 500})  # nothing ahead: it goes, or the job could never run
    waiting = _waiter(window, {1: 5})
    window.close()  # the job ended
    waiting.join(WAIT_S)
    assert not waiting.is_alive()


def test_a_worker_s_shards_are_put_in_groups_that_start_small_and_double_up_to_the_group_size(monkeypatch):
    """The first group is FIRST_PUT_BYTES, so the worker starts soon; each next twice the last, up
    to PUT_GROUP_BYTES, so a large job still takes few calls."""
    monkeypatch.setattr(object_client, "FIRST_PUT_BYTES", 2)
    monkeypatch.setattr(object_client, "PUT_GROUP_BYTES", 8)
    shards = [SimpleNamespace(rows=1) for _ in range(30)]  # a byte a row, a row a shard
    assert [len(group) for group in object_client._groups(shards, row_bytes=1)] == [2, 4, 8, 8, 8]
