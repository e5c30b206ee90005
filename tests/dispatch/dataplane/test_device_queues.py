"""The device pool's wait for a job's shards (DevicePool.wait_all): it returns once every shard
ended, raises a shard's final failure as soon as it comes, and a cancel of the job."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import pytest

from accelmesh import errors
from dispatch_svc.dataplane.device_queues import (
    SHARDS_IN_FLIGHT_PER_DEVICE,
    SHARDS_PER_GROUP,
    Cancelled,
    CancelScope,
    DevicePool,
    ShardFailed,
)

GUARD_S = 30.0  # a blocked shard gives up after this: only a broken wait_all would make it


@dataclass(frozen=True)
class Spec:
    id: str


@dataclass(frozen=True)
class Device:
    spec: Spec
    target_type: str = "t"


@dataclass
class Shard:
    index: int


DEVICES = [Device(Spec("d0")), Device(Spec("d1"))]


def test_wait_all_returns_once_every_shard_ran():
    done = []
    pool = DevicePool(DEVICES, lambda attempt: attempt.shard.index * 2, CancelScope())
    try:
        pending = [pool.submit(Shard(i), DEVICES[i % 2].spec.id, on_done=done.append) for i in range(50)]
        pool.wait_all(pending)
        assert sorted(done) == [2 * i for i in range(50)]
        assert all(p.done.is_set() and p.error is None for p in pending)
    finally:
        pool.close()


def test_wait_all_raises_a_final_failure_while_other_shards_still_run():
    release, gave_up = threading.Event(), []

    def run(attempt):
        if attempt.shard.index == 0:
            raise ShardFailed("INVALID_ARGUMENT: no such input", "INVALID_ARGUMENT")
        if not release.wait(GUARD_S):
            gave_up.append(attempt.shard.index)
        return None

    pool = DevicePool(DEVICES, run, CancelScope())
    try:
        pending = [pool.submit(Shard(0), "d0"), pool.submit(Shard(1), "d1")]
        with pytest.raises(errors.FailedPrecondition, match="failed the same way on every device"):
            pool.wait_all(pending)  # shard 1 is still running: only its release ends it
        assert not pending[1].done.is_set()
        release.set()
    finally:
        release.set()
        pool.close()
    assert gave_up == []


def test_wait_all_stops_at_a_cancel_of_the_job():
    scope, release = CancelScope(), threading.Event()
    started = threading.Event()

    def run(attempt):
        started.set()
        release.wait(GUARD_S)

    pool = DevicePool(DEVICES, run, scope)
    try:
        pending = [pool.submit(Shard(0), "d0")]
        started.wait(GUARD_S)
        scope.cancel("stopped by the test")
        with pytest.raises(Cancelled, match="stopped by the test"):
            pool.wait_all(pending)
    finally:
        release.set()
        pool.close()


def test_a_shard_left_without_devices_by_the_same_refusal_on_other_shards_says_retrying_will_not_help():
    """Every device refused the job's artifact the same way while on other shards, so a shard still
    queued finds none left before it was tried anywhere: it fails as not retryable, naming the
    refusal, as a shard that met it itself does (not UNAVAILABLE with no device left)."""
    refusal = ShardFailed("FAILED_PRECONDITION: the artifact did not load", "FAILED_PRECONDITION")
    busy = SHARDS_IN_FLIGHT_PER_DEVICE  # shards 0..busy-1 take every d0 thread; shard `busy` waits in its queue
    d1_out = threading.Event()

    def run(attempt):
        if attempt.shard.index < busy and not d1_out.wait(GUARD_S):  # d0 fails only once d1 has
            raise AssertionError("d1 never failed")
        if attempt.shard.index == busy + 1:
            d1_out.set()
        raise refusal

    pool = DevicePool(DEVICES, run, CancelScope())
    try:
        pending = [pool.submit(Shard(i), "d0") for i in range(busy + 1)] + [pool.submit(Shard(busy + 1), "d1")]
        for p in pending:
            assert p.done.wait(GUARD_S)
    finally:
        d1_out.set()
        pool.close()
    queued = pending[busy]
    assert isinstance(queued.error, errors.FailedPrecondition), queued.error
    assert re.fullmatch(r"shard \d+ failed the same way on every device tried \(d[01], d[01]\): FAILED_PRECONDITION: "
                        r"the artifact did not load; retrying will not help", str(queued.error)), queued.error
    assert all(isinstance(p.error, errors.FailedPrecondition) for p in pending)


# -- shards in groups (run_group) -------------------------------------------------------------------

class Held:
    """A pool's first attempts held until `go`: the device's threads all busy, so what is
    submitted meanwhile waits in its queue and goes in groups once they are free."""

    def __init__(self, count: int):
        self.count, self.go = count, threading.Event()
        self._started = threading.Condition()
        self.started = 0

    def run(self, attempt):
        with self._started:
            self.started += 1
            self._started.notify_all()
        assert self.go.wait(GUARD_S)
        return attempt.shard.index

    def busy(self, pool: DevicePool, device: str, on_done=None) -> list:
        """The first `count` shards, submitted one at a time, each once the one before started
        (else they would go as a group): every thread of the device then holds one."""
        pending = []
        for index in range(self.count):
            pending.append(pool.submit(Shard(index), device, on_done=on_done))
            with self._started:
                assert self._started.wait_for(lambda count=index + 1: self.started == count, GUARD_S)
        return pending


def grouped_pool(held: Held, groups: list, *, fail: set[tuple[str, int]] = frozenset(),
                 ready=lambda shard, device: True) -> DevicePool:
    def run_group(attempts):
        groups.append([(a.device.spec.id, a.shard.index) for a in attempts])
        return [ShardFailed("UNAVAILABLE: gone", "UNAVAILABLE") if (a.device.spec.id, a.shard.index) in fail
                else a.shard.index for a in attempts]
    return DevicePool(DEVICES, held.run, CancelScope(), run_group=run_group, ready=ready)


def test_shards_queued_for_a_busy_device_go_in_groups_each_run_once():
    held, groups, done = Held(SHARDS_IN_FLIGHT_PER_DEVICE), [], []
    pool = grouped_pool(held, groups)
    try:
        first = held.busy(pool, "d0", done.append)
        rest = [pool.submit(Shard(i), "d0", on_done=done.append) for i in range(len(first), len(first) + 40)]
        held.go.set()
        pool.wait_all(first + rest)
    finally:
        pool.close()
    assert sorted(done) == list(range(len(first) + 40))
    grouped = [index for group in groups for _, index in group]
    alone = len(first + rest) - len(grouped)  # run by `run` (a group of one), the held first ones among them
    assert len(grouped) == len(set(grouped)) and alone >= len(first)
    assert groups and all(1 < len(group) <= SHARDS_PER_GROUP for group in groups)


def test_a_shard_whose_inputs_are_not_ready_never_joins_a_group_behind_another():
    held, groups = Held(SHARDS_IN_FLIGHT_PER_DEVICE), []
    pool = grouped_pool(held, groups, ready=lambda shard, device: shard.index % 3 != 0)
    try:
        first = held.busy(pool, "d0")
        rest = [pool.submit(Shard(i), "d0") for i in range(100, 130)]
        held.go.set()
        pool.wait_all(first + rest)
    finally:
        pool.close()
    assert groups and all(index % 3 for group in groups for _, index in group[1:])


def test_a_shard_failing_in_a_group_is_retried_on_another_device_and_the_others_succeed():
    held, groups, done = Held(SHARDS_IN_FLIGHT_PER_DEVICE), [], []
    pool = grouped_pool(held, groups, fail={("d0", 7)})
    try:
        first = held.busy(pool, "d0", done.append)
        rest = [pool.submit(Shard(i), "d0", on_done=done.append) for i in range(len(first), 20)]
        held.go.set()
        pool.wait_all(first + rest)
    finally:
        pool.close()
    assert sorted(done) == list(range(20))
    assert ("d0", 7) in [pair for group in groups for pair in group]
    assert rest[7 - len(first)].tried[-1] == "d1"  # where the retry went: the failed device is out of the job
