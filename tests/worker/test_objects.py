"""The worker's object store (worker_svc/objects.py), as plain Python over segment files in a
test's own folder: objects written, sealed and read back as views of their mappings without a
copy; segment files private and unguessable; the byte and count bounds, a create waiting for
room; ids written once and scopes kept apart; release, expiry (on a fake clock) and close freeing
files and bytes; and the sweep of a killed worker's leftovers. No server, no /dev/shm."""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import threading

import ml_dtypes
import numpy as np
import pytest
from _store_clock import clock_fixture  # noqa: F401  (fixture: pytest finds it in this module)

from accelmesh import errors
from worker_svc import objects
from worker_svc.held_tensors import MAX_KEY_CHARS
from worker_svc.objects import ObjectStore, StoreStats
from worker_svc.segments import SEGMENT_PREFIX, sweep_stale

JOIN_S = 30.0  # generous: a thread that is still alive after this is stuck
# Above any pid_max Linux allows (2**22), so no process has it.
DEAD_PID = 2**22 + 1


@pytest.fixture
def store(tmp_path, clock):
    made = ObjectStore(1000, root=str(tmp_path), ttl_s=60.0, wait_s=0.0, clock=clock)
    yield made
    made.close()


def segments(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(SEGMENT_PREFIX))


def run_in_thread(target, name: str = "") -> tuple[threading.Thread, dict]:
    """Start `target` on a thread; the dict gets its "result" or its "error"."""
    outcome: dict = {}

    def body():
        try:
            outcome["result"] = target()
        except errors.AccelmeshError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=name or None, daemon=True)
    thread.start()
    return thread, outcome


def test_an_object_written_in_pieces_and_sealed_reads_back_as_a_view_of_its_mapping(store):
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    obj = store.create("job-1", "x", np.float32, (2, 3, 4))
    raw = data.tobytes()
    obj.write(0, raw[:40])
    obj.write(40, memoryview(raw)[40:])
    assert store.seal("job-1", "x") is obj and obj.sealed
    first, second = store.get("job-1", "x").array(), obj.array()
    np.testing.assert_array_equal(first, data)
    assert (first.dtype, first.shape) == (np.float32, (2, 3, 4))
    assert np.shares_memory(first, second)
    assert not first.flags.writeable
    with open(obj.path, "r+b") as segment, mmap.mmap(segment.fileno(), 0) as client:  # as a same-host client
        assert client[:] == raw
        client[:4] = np.float32(-7).tobytes()
    assert first[0, 0, 0] == -7  # the view is of the mapping, not a copy


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.int64).reshape(3, 4).T,  # not contiguous: copied in as it reads
    np.array([True, False, True]),
    np.linspace(0, 1, 7).astype(ml_dtypes.bfloat16),
    np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i2"), ("b", "<f8")]),
    np.float16(3.5).reshape(()),
    np.zeros((0, 5), np.float32),
], ids=["transposed", "bool", "bfloat16", "structured", "scalar", "empty"])
def test_put_array_keeps_a_sealed_copy_with_the_arrays_dtype_and_shape(store, array):
    obj = store.put_array("job-1", "out", array)
    got = store.get("job-1", "out").array()
    assert obj.sealed and (got.dtype, got.shape) == (array.dtype, array.shape)
    assert got.tobytes() == array.tobytes()


def test_a_zero_byte_object_has_no_segment_file(store, tmp_path):
    obj = store.create("job-1", "empty", np.float32, (4, 0))
    obj.write(0, b"")
    store.seal("job-1", "empty")
    assert (obj.path, obj.nbytes, segments(tmp_path)) == ("", 0, [])
    assert store.get("job-1", "empty").array().shape == (4, 0)


@pytest.mark.parametrize("umask", [0o022, 0o277, 0o000])
def test_a_segment_is_a_private_file_named_for_the_worker_pid_and_128_random_bits(tmp_path, umask):
    store = ObjectStore(1000, root=str(tmp_path))
    old = os.umask(umask)
    try:
        one, two = store.create("job-1", "a", np.uint8, (10,)), store.create("job-1", "b", np.uint8, (10,))
    finally:
        os.umask(old)
    for obj in (one, two):
        info = os.stat(obj.path, follow_symlinks=False)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert (info.st_size, os.path.dirname(obj.path)) == (10, str(tmp_path))
        assert re.fullmatch(rf"accelmesh-obj-{os.getpid()}-[0-9a-f]{{32}}", os.path.basename(obj.path))
    assert one.path != two.path
    store.close()


def test_an_object_larger_than_the_whole_store_is_refused_at_once(tmp_path):
    store = ObjectStore(100, root=str(tmp_path), wait_s=600.0)
    thread, outcome = run_in_thread(lambda: store.create("job-1", "big", np.uint8, (101,)))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, errors.ResourceExhausted) and "more than the whole store" in str(error)
    assert error.metadata == {"limit_bytes": "100", "variable": "ACCELMESH_WORKER_STORE_BYTES"}
    assert store.stats() == StoreStats(objects=0, used_bytes=0, limit_bytes=100, waiting=0)


def waiting_create(tmp_path) -> tuple[ObjectStore, threading.Thread, dict]:
    """A store of 100 bytes holding 80 (job-1's "first") and a thread whose create of 50 waits for room."""
    entered = threading.Event()

    def clock() -> float:  # the waiting create reads it under the store's lock, just before it waits
        if threading.current_thread().name == "waiter":
            entered.set()
        return 0.0

    store = ObjectStore(100, root=str(tmp_path), wait_s=0.0, clock=clock)
    store.put_array("job-1", "first", np.zeros(80, np.uint8))
    thread, outcome = run_in_thread(lambda: store.create("job-2", "next", np.uint8, (50,), wait_s=600.0), "waiter")
    assert entered.wait(JOIN_S)
    assert store.stats().waiting == 1  # the lock is free only once the create waits
    return store, thread, outcome


def test_a_create_that_does_not_fit_waits_until_another_object_is_released(tmp_path):
    store, thread, outcome = waiting_create(tmp_path)
    assert store.release("job-1") == (1, 80)
    thread.join(JOIN_S)
    assert not thread.is_alive() and "error" not in outcome
    assert outcome["result"].nbytes == 50
    assert store.stats() == StoreStats(objects=1, used_bytes=50, limit_bytes=100, waiting=0)
    store.close()


def test_a_create_waiting_for_room_is_refused_when_the_store_closes(tmp_path):
    store, thread, outcome = waiting_create(tmp_path)
    store.close()
    thread.join(JOIN_S)
    assert not thread.is_alive() and isinstance(outcome.get("error"), errors.Unavailable)
    assert segments(tmp_path) == []


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
def test_a_create_that_finds_no_room_in_time_names_the_limit_and_its_variable(tmp_path, wait_s):
    store = ObjectStore(100, root=str(tmp_path), wait_s=600.0)
    store.create("job-1", "first", np.uint8, (80,))
    with pytest.raises(errors.ResourceExhausted) as caught:
        store.create("job-1", "second", np.uint8, (30,), wait_s=wait_s)
    message = str(caught.value)
    assert "ACCELMESH_WORKER_STORE_BYTES" in message and "80 of its 100 bytes" in message and "30 bytes" in message
    assert "release or fetch earlier objects" in message
    assert caught.value.metadata == {"limit_bytes": "100", "variable": "ACCELMESH_WORKER_STORE_BYTES"}
    assert store.stats() == StoreStats(objects=1, used_bytes=80, limit_bytes=100, waiting=0)
    store.close()


def test_past_the_object_count_limit_a_create_is_refused_at_once(tmp_path):
    store = ObjectStore(10**6, root=str(tmp_path), max_objects=2, wait_s=600.0)
    store.create("job-1", "a", np.uint8, (1,))
    store.create("job-2", "a", np.uint8, (0,))
    with pytest.raises(errors.ResourceExhausted) as caught:
        store.create("job-1", "b", np.uint8, (1,))
    assert caught.value.metadata["variable"] == "ACCELMESH_WORKER_STORE_OBJECTS"
    store.release("job-2")
    assert store.create("job-1", "b", np.uint8, (1,)).nbytes == 1
    store.close()


@pytest.mark.parametrize("sealed", [False, True])
def test_an_id_is_written_once_in_its_scope(store, sealed):
    store.create("job-1", "x", np.uint8, (4,))
    if sealed:
        store.seal("job-1", "x")
    with pytest.raises(errors.AlreadyExists, match="objects are written once") as caught:
        store.create("job-1", "x", np.uint8, (4,))
    assert caught.value.field == "object_id"
    assert store.stats().used_bytes == 4


def test_a_sealed_object_takes_no_more_writes_and_no_second_seal(store):
    obj = store.put_array("job-1", "x", np.ones(4, np.uint8))
    with pytest.raises(errors.FailedPrecondition):
        obj.write(0, b"\0")
    with pytest.raises(errors.FailedPrecondition) as caught:
        store.seal("job-1", "x")
    assert caught.value.reason == ""
    np.testing.assert_array_equal(obj.array(), np.ones(4, np.uint8))


@pytest.mark.parametrize("offset, size", [(-1, 1), (99, 2), (100, 1), (0, 101)])
def test_a_write_outside_the_object_is_refused_naming_the_offset(store, offset, size):
    obj = store.create("job-1", "x", np.uint8, (100,))
    with pytest.raises(errors.InvalidArgument) as caught:
        obj.write(offset, bytes(size))
    assert caught.value.field == "offset"


@pytest.mark.parametrize("step", ["unknown", "unsealed", "released"])
def test_get_answers_sealed_objects_only_and_says_to_put_it_again(store, step):
    if step != "unknown":
        store.create("job-1", "x", np.uint8, (4,))
    if step == "released":
        store.seal("job-1", "x")
        store.release("job-1")
    with pytest.raises(errors.NotFound) as caught:
        store.get("job-1", "x")
    assert caught.value.field == "object_id"
    assert "ACCELMESH_WORKER_STORE_TTL_S" in str(caught.value) and "put it again" in str(caught.value)


def test_sealing_an_unknown_object_is_not_found(store):
    with pytest.raises(errors.NotFound):
        store.seal("job-1", "never")


def test_release_frees_a_scopes_objects_or_those_under_a_prefix_with_their_files(store, tmp_path):
    kept = store.put_array("job-2", "in/0", np.zeros(10, np.uint8))
    made = {name: store.put_array("job-1", name, np.zeros(size, np.uint8))
            for name, size in [("in/0", 10), ("in/1", 20), ("out/0", 30)]}
    assert store.release("job-1", "in/") == (2, 30)
    assert not os.path.exists(made["in/0"].path) and not os.path.exists(made["in/1"].path)
    assert store.get("job-1", "out/0") is made["out/0"]
    assert store.release("job-1") == (1, 30)
    assert store.release("job-1") == store.release("no-such-job") == (0, 0)
    assert segments(tmp_path) == [os.path.basename(kept.path)]
    assert store.stats() == StoreStats(objects=1, used_bytes=10, limit_bytes=1000, waiting=0)


def test_a_scope_idle_for_the_ttl_expires_whole_and_a_scope_in_use_stays(store, clock, tmp_path):
    idle = [store.put_array("job-idle", f"x{i}", np.zeros(5, np.uint8)) for i in range(3)]
    store.put_array("job-busy", "x", np.zeros(5, np.uint8))
    clock.now += 59.0
    store.get("job-busy", "x")
    assert store.expire() == 0
    clock.now += 1.0
    assert store.expire() == 3
    assert not any(os.path.exists(obj.path) for obj in idle)
    with pytest.raises(errors.NotFound):
        store.get("job-idle", "x0")
    assert store.get("job-busy", "x").nbytes == 5 and len(segments(tmp_path)) == 1


def test_the_same_id_in_two_scopes_is_two_objects(store):
    one = store.put_array("job-1", "x", np.full(4, 1, np.uint8))
    two = store.put_array("job-2", "x", np.full(4, 2, np.uint8))
    assert one.path != two.path and not np.shares_memory(one.array(), two.array())
    store.release("job-1")
    with pytest.raises(errors.NotFound):
        store.get("job-1", "x")
    np.testing.assert_array_equal(store.get("job-2", "x").array(), np.full(4, 2, np.uint8))


def test_releasing_an_object_whose_view_is_alive_keeps_the_view_readable(store):
    obj = store.put_array("job-1", "x", np.arange(100, dtype=np.int32))
    view = obj.array()
    assert store.release("job-1") == (1, 400)
    assert not os.path.exists(obj.path) and store.stats().used_bytes == 0
    np.testing.assert_array_equal(view, np.arange(100, dtype=np.int32))
    with pytest.raises(errors.NotFound):
        obj.array()
    with pytest.raises(errors.NotFound):
        obj.write(0, b"\0")


def test_a_segment_that_cannot_be_allocated_is_refused_and_leaves_nothing(store, tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(objects.os, "posix_fallocate", full)
    with pytest.raises(errors.ResourceExhausted, match="filesystem is full"):
        store.create("job-1", "x", np.uint8, (10,))
    assert segments(tmp_path) == [] and store.stats().objects == 0
    monkeypatch.undo()
    assert store.create("job-1", "x", np.uint8, (10,)).nbytes == 10


def test_an_object_released_while_its_segment_is_made_leaves_no_file(store, tmp_path, monkeypatch):
    make = objects.make_segment

    def released_meanwhile(root, nbytes):  # the store's lock is free here, or this release would hang
        made = make(root, nbytes)
        assert store.release("job-1") == (1, nbytes)
        return made

    monkeypatch.setattr(objects, "make_segment", released_meanwhile)
    with pytest.raises(errors.NotFound, match="released while it was created"):
        store.create("job-1", "x", np.uint8, (10,))
    assert segments(tmp_path) == [] and store.stats().used_bytes == 0


@pytest.mark.parametrize("field, scope, object_id, dtype, shape", [
    ("scope", "", "x", np.uint8, (1,)),
    ("scope", "s" * (MAX_KEY_CHARS + 1), "x", np.uint8, (1,)),
    ("object_id", "job", "", np.uint8, (1,)),
    ("object_id", "job", "x" * (MAX_KEY_CHARS + 1), np.uint8, (1,)),
    ("dtype", "job", "x", object, (1,)),
    ("dtype", "job", "x", "S", (1,)),
    ("dtype", "job", "x", "no-such-dtype", (1,)),
    ("shape", "job", "x", np.uint8, (2, -1)),
    ("shape", "job", "x", np.uint8, (1.5,)),
    ("shape", "job", "x", np.uint8, (1,) * 33),
])
def test_a_malformed_create_is_refused_naming_its_field(store, field, scope, object_id, dtype, shape):
    with pytest.raises(errors.InvalidArgument) as caught:
        store.create(scope, object_id, dtype, shape)
    assert caught.value.field == field
    assert store.stats().objects == 0


def test_an_id_of_the_longest_length_is_taken(store):
    assert store.create("s" * MAX_KEY_CHARS, "x" * MAX_KEY_CHARS, np.uint8, (1,)).nbytes == 1


def test_close_frees_every_object_and_refuses_later_creates(store, tmp_path):
    for scope in ("job-1", "job-2"):
        store.put_array(scope, "x", np.zeros(8, np.uint8))
    store.close()
    assert segments(tmp_path) == [] and store.stats() == StoreStats(0, 0, 1000, 0)
    with pytest.raises(errors.Unavailable):
        store.create("job-1", "y", np.uint8, (1,))


def test_the_sweep_removes_segments_of_dead_workers_and_keeps_live_ones(store, tmp_path):
    live = store.put_array("job-1", "x", np.zeros(4, np.uint8))
    dead = tmp_path / f"accelmesh-obj-{DEAD_PID}-{'ab' * 16}"
    dead.write_bytes(b"left behind")
    other = tmp_path / f"other-{DEAD_PID}-{'ab' * 16}"
    other.write_bytes(b"not ours")
    link = tmp_path / f"accelmesh-obj-{DEAD_PID}-{'cd' * 16}"
    link.symlink_to(other)
    assert sweep_stale(str(tmp_path)) == 1
    assert not dead.exists() and os.path.exists(live.path) and other.exists() and link.is_symlink()
    assert store.get("job-1", "x").array().tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("shape", [(0, 2**62), (2**62, 0, 4)])
def test_a_zero_byte_shape_numpy_cannot_make_is_refused_at_create(tmp_path, shape):
    """[0, 2**62] holds no byte, but numpy cannot make an array of it: refused when created, not
    INTERNAL when read (a fuzzing finding)."""
    store = ObjectStore(1 << 20, root=str(tmp_path))
    with pytest.raises(errors.InvalidArgument, match="too large"):
        store.create("user:a|job", "in/0/0", np.float32, shape)
