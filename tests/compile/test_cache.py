"""ArtifactCache: content addressing, durability, eviction, single-flight builds, streaming."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from accelmesh.errors import InvalidArgument, NotFound
from compile_svc.cache import ArtifactCache, key_for

MiB = 1 << 20


def key(n: int) -> str:
    return key_for(program="p", batch_size=n)


def test_key_is_canonical_and_depends_on_every_part():
    a = key_for(program="mlp", options={"xla": {"b": 1, "a": True}}, caps=frozenset({"bf16", "avx2"}))
    b = key_for(caps=frozenset({"avx2", "bf16"}), options={"xla": {"a": True, "b": 1}}, program="mlp")
    assert a == b and len(a) == 64
    assert a != key_for(program="mlp", options={"xla": {"b": 2, "a": True}}, caps=frozenset({"bf16", "avx2"}))


def test_put_then_get_returns_payload_metadata_and_digest(tmp_path: Path):
    cache = ArtifactCache(tmp_path, MiB)
    put = cache.put(key(1), b"artifact", {"format": "stablehlo"})
    got = cache.get(key(1))
    assert got == put
    assert got.payload == b"artifact" and got.metadata == {"format": "stablehlo"} and got.size == 8
    assert got.digest == hashlib.sha256(b"artifact").hexdigest() and cache.get(key(2)) is None
    assert cache.hits == 1


def test_sidecar_records_digest_size_and_created_time(tmp_path: Path):
    cache = ArtifactCache(tmp_path, MiB)
    put = cache.put(key(1), b"abc", {})
    sidecar = json.loads(next(tmp_path.glob("*/*.json")).read_text())
    assert sidecar["digest"] == put.digest == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert sidecar["size"] == 3 and sidecar["created"] == put.created


def test_entries_survive_a_new_cache_on_the_same_root(tmp_path: Path):
    ArtifactCache(tmp_path, MiB).put(key(1), b"kept", {"n": 1})
    again = ArtifactCache(tmp_path, MiB)
    assert again.get(key(1)).payload == b"kept"


@pytest.mark.parametrize("damage", ["flip_payload", "truncate_payload", "garble_sidecar", "drop_payload"])
def test_corrupt_entry_is_a_miss_and_is_deleted(tmp_path: Path, damage: str):
    cache = ArtifactCache(tmp_path, MiB)
    cache.put(key(1), b"0123456789", {})
    payload, sidecar = next(tmp_path.glob("*/*.bin")), next(tmp_path.glob("*/*.json"))
    {"flip_payload": lambda: payload.write_bytes(b"0123456780"),
     "truncate_payload": lambda: payload.write_bytes(b"01234"),
     "garble_sidecar": lambda: sidecar.write_text("{not json"),
     "drop_payload": payload.unlink}[damage]()
    assert cache.get(key(1)) is None
    assert not sidecar.exists() and not payload.exists()
    assert cache.get_or_build(key(1), lambda: (b"rebuilt", {}))[1] is True


def test_lru_evicts_least_recently_used_first(tmp_path: Path):
    cache = ArtifactCache(tmp_path, max_bytes=30)
    for n in (1, 2, 3):
        cache.put(key(n), bytes(10), {})
    cache.get(key(1))  # now 2 is the oldest
    cache.put(key(4), bytes(10), {})
    assert [cache.get(key(n)) is not None for n in (1, 2, 3, 4)] == [True, False, True, True]
    assert cache.total_bytes() == 30


def test_entry_larger_than_the_cache_is_kept_and_evicts_everything_else(tmp_path: Path):
    cache = ArtifactCache(tmp_path, max_bytes=30)
    cache.put(key(1), bytes(10), {})
    cache.put(key(2), bytes(50), {})
    assert cache.get(key(1)) is None and cache.get(key(2)).size == 50


def test_concurrent_callers_build_once(tmp_path: Path):
    cache, threads = ArtifactCache(tmp_path, MiB), 8
    start, release = threading.Barrier(threads), threading.Event()
    calls = []

    def build():
        calls.append(1)
        release.wait(timeout=10)  # held until every other caller is waiting on this build
        return b"compiled", {"by": "one"}

    def call():
        start.wait(timeout=10)
        return cache.get_or_build(key(1), build)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(call) for _ in range(threads)]
        _wait_for_waiters(cache, key(1), threads - 1)
        release.set()
        results = [f.result(timeout=10) for f in futures]
    assert len(calls) == 1 and cache.builds == 1 and cache.hits == threads - 1
    assert sorted(built for _, built in results) == [False] * (threads - 1) + [True]
    assert {a.payload for a, _ in results} == {b"compiled"}


def test_failing_build_reaches_every_waiter_and_caches_nothing(tmp_path: Path):
    cache, threads = ArtifactCache(tmp_path, MiB), 8
    start, release = threading.Barrier(threads), threading.Event()

    def build():
        release.wait(timeout=10)
        raise RuntimeError("xla said no")

    def call():
        start.wait(timeout=10)
        return cache.get_or_build(key(1), build)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(call) for _ in range(threads)]
        _wait_for_waiters(cache, key(1), threads - 1)
        release.set()
        errors = [f.exception(timeout=10) for f in futures]
    assert all(isinstance(e, RuntimeError) and "xla said no" in str(e) for e in errors)
    assert cache.builds == 1 and cache.get(key(1)) is None and not list(tmp_path.glob("*/*"))
    assert cache.get_or_build(key(1), lambda: (b"second try", {}))[1] is True


def _wait_for_waiters(cache: ArtifactCache, k: str, count: int) -> None:
    """Return once `count` callers have joined the in-flight build; only then may it finish."""
    polled = threading.Event()  # never set: its wait() is a bounded poll interval, not a timing assumption
    for _ in range(10_000):
        if cache.waiting(k) >= count:
            return
        polled.wait(0.001)
    raise AssertionError(f"only {cache.waiting(k)} of {count} callers joined the build")


def test_open_stream_chunks_reassemble_to_the_payload(tmp_path: Path):
    cache = ArtifactCache(tmp_path, MiB)
    payload = bytes(range(256)) * 41  # 10,496 bytes: not a multiple of the chunk
    cache.put(key(1), payload, {})
    chunks = list(cache.open_stream(key(1), chunk_bytes=1000))
    assert len(chunks) == 11 and max(map(len, chunks)) == 1000
    assert b"".join(chunks) == payload


def test_open_stream_of_unknown_key_raises_not_found_at_once(tmp_path: Path):
    cache = ArtifactCache(tmp_path, MiB)
    with pytest.raises(NotFound):
        cache.open_stream(key(9), chunk_bytes=1000)
    with pytest.raises(InvalidArgument):
        cache.get("../../etc/passwd")


def test_second_process_finds_the_entry_without_building(tmp_path: Path):
    ArtifactCache(tmp_path, MiB).put(key(1), b"built once", {"format": "executable"})
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from compile_svc.cache import ArtifactCache, key_for\n"
        "cache = ArtifactCache(Path(sys.argv[1]), 1 << 20)\n"
        "art, built = cache.get_or_build(key_for(program='p', batch_size=1), lambda: (b'rebuilt', {}))\n"
        "print(json.dumps({'builds': cache.builds, 'built': built, 'payload': art.payload.decode()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"builds": 0, "built": False, "payload": "built once"}


_BUILDER = """
import sys, time
from pathlib import Path
from compile_svc.cache import ArtifactCache, key_for
root, name, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
def build():
    with open(root / "builds.log", "a") as log:
        log.write(name + "\\n")
    (root / f"{name}.building").touch()
    while not go.exists():  # the test says when this build may finish
        time.sleep(0.01)
    return f"built by {name}".encode(), {}
art, built = ArtifactCache(root, 1 << 20).get_or_build(key_for(program="p", batch_size=2), build)
print(art.payload.decode(), built)
"""


def _blocked_on(path: Path) -> bool:
    """Whether some process waits for a flock on `path` (Linux lists waiters in /proc/locks with '->')."""
    inode = f":{path.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def test_two_processes_on_one_folder_build_a_key_once_the_second_waiting_for_the_first(tmp_path: Path):
    """Compile replicas on one shared folder: while one builds a key, another asking for it waits on
    the key's build lock instead of building it again, then reads the first one's artifact."""
    import time

    go = tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", _BUILDER, str(tmp_path), "first", str(go)],
                             stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "first.building").exists():  # its build has begun (and holds the lock)
        assert first.poll() is None and time.monotonic() < deadline, "the first build never started"
        time.sleep(0.01)
    second = subprocess.Popen([sys.executable, "-c", _BUILDER, str(tmp_path), "second", str(go)],
                              stdout=subprocess.PIPE, text=True)
    (lock,) = tmp_path.glob("??/*.building")
    while not _blocked_on(lock):
        assert not (tmp_path / "second.building").exists(), "the second process built the key as well"
        assert second.poll() is None and time.monotonic() < deadline, "the second process never waited"
        time.sleep(0.01)
    go.touch()
    outputs = [p.communicate(timeout=60)[0].split() for p in (first, second)]
    assert outputs == [["built", "by", "first", "True"], ["built", "by", "first", "False"]]
    assert (tmp_path / "builds.log").read_text() == "first\n"
