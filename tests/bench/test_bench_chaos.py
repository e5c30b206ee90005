"""bench/chaos.py's own rules, without a mesh: the seeded kill schedule, the comparison with the
fault-free run, which reservations count as leaked, how jobs are tallied, and the verdict."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# bench/ is no package: its scripts import each other by path, as this test does.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import chaos

TARGETS = {"worker": ["worker-0", "worker-1", "worker-2"], "inventory": ["inventory-0", "inventory-1"],
           "compile": ["compile-0", "compile-1"], "dispatch": ["dispatch-0", "dispatch-1"], "postgres": ["postgres"]}


def test_the_kill_schedule_is_the_same_for_a_seed_and_differs_for_another():
    assert chaos.kill_schedule(7, 1200, TARGETS) == chaos.kill_schedule(7, 1200, TARGETS)
    assert chaos.kill_schedule(7, 1200, TARGETS) != chaos.kill_schedule(8, 1200, TARGETS)


def test_kills_come_every_30_to_60_seconds_within_the_run_and_name_a_target_of_their_kind():
    kills = chaos.kill_schedule(3, 1200, TARGETS)
    gaps = np.diff([0.0] + [k.at_s for k in kills])
    assert 20 <= len(kills) <= 40
    assert all(30 <= g <= 60 for g in gaps) and kills[-1].at_s < 1200
    assert all(k.target in TARGETS[k.kind] for k in kills)
    assert all(1 <= k.restart_after_s <= 5 for k in kills)


@pytest.mark.parametrize("seed", range(10))
def test_every_five_kills_in_a_row_hit_every_kind(seed):
    kinds = [k.kind for k in chaos.kill_schedule(seed, 1200, TARGETS)]
    for first in range(0, len(kinds) - 4, 5):  # each shuffled round holds every kind once
        assert set(kinds[first:first + 5]) == set(TARGETS)


def test_a_run_shorter_than_the_first_gap_kills_nothing():
    assert chaos.kill_schedule(1, 29.9, TARGETS) == []


def test_inference_outputs_must_be_bit_identical_and_training_within_its_tolerance():
    want = {"logits": np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)}
    nudged = {"logits": want["logits"] + np.float32(1e-6)}
    assert chaos.compare(want, want, exact=True) == (True, 0.0)
    ok, diff = chaos.compare(nudged, want, exact=True)
    assert not ok and diff == pytest.approx(1e-6 / 4, rel=0.1)  # 1e-6 rounds to a float32 step
    assert chaos.compare(nudged, want, exact=False)[0]
    assert not chaos.compare({"logits": want["logits"] * 1.01}, want, exact=False)[0]


@pytest.mark.parametrize("outputs", [
    {},
    {"logits": np.zeros((2, 2), np.float32), "extra": np.zeros(1, np.float32)},
    {"logits": np.zeros((2, 3), np.float32)},
    {"logits": np.zeros((2, 2), np.float64)},
])
def test_outputs_of_another_name_shape_or_dtype_are_wrong(outputs):
    assert chaos.compare(outputs, {"logits": np.zeros((2, 2), np.float32)}, exact=False) == (False, float("inf"))


def test_a_reservation_is_leaked_once_its_job_ended_more_than_a_lease_ago_or_is_unknown():
    held = [{"job_id": "ended-long-ago"}, {"job_id": "ended-just-now"}, {"job_id": "running"},
            {"job_id": "unknown"}]
    ends = {"ended-long-ago": 100.0, "ended-just-now": 108.0, "running": None}
    leaked = chaos.leaked_reservations(held, ends, now=111.0, lease_s=10)
    assert [r["job_id"] for r in leaked] == ["ended-long-ago", "unknown"]
    assert "11.0 s earlier" in leaked[0]["why"] and "no such job" in leaked[1]["why"]


def run(state="SUCCEEDED", *, correct=True, error="", job_id="j", took_s=5.0, queued=False) -> chaos.JobRun:
    return chaos.JobRun("inference", "submit", 0, "r", 1000.0, job_id=job_id, state=state, error=error,
                        ended_at=1000.0 + took_s if state in ("SUCCEEDED", "FAILED", "CANCELLED") else None,
                        correct=correct if state == "SUCCEEDED" else None, queued=queued)


def test_tally_sorts_each_job_into_its_outcome():
    runs = [run(queued=True), run(correct=False),
            run("FAILED", error="the dispatcher restarted while the job was running; submit it again"),
            run("FAILED", error="worker said no"), run("RUNNING"), run(job_id=""), run(took_s=500.0),
            run("CANCELLED")]
    counts, bad = chaos.tally(runs, stuck_after_s=120)
    assert counts == {"submitted": 7, "run": 6, "correct": 2, "failed_resubmit": 1, "queued": 1, "lost": 1,
                      "stuck": 1, "wrong": 1, "failed_unclear": 1, "cancelled": 1, "not_submitted": 1}
    assert bad["stuck"] == [runs[6]] and bad["lost"] == [runs[4]] and bad["failed_unclear"] == [runs[3]]


def test_the_verdict_passes_only_a_clean_run_and_says_why_not():
    clean = {"submitted": 10, "run": 10, "correct": 9, "failed_resubmit": 1}
    memory = {"worker-0": {"ratio": 1.1}, "dispatch-0": {"ratio": None}}
    assert chaos.verdict(clean, memory, leaked=0) == (True, [])
    passed, reasons = chaos.verdict({**clean, "lost": 1, "stuck": 2}, {"worker-0": {"ratio": 1.3}}, leaked=3)
    assert not passed
    assert reasons == ["1 jobs lost (never ended)", "2 jobs stuck (ended past the bound)", "3 reservations leaked",
                       "worker-0: resident memory 1.3x its warm-up figure (bar 1.2x)"]
    assert chaos.verdict({"submitted": 3, "correct": 0}, {}, leaked=0) == (False, ["no job succeeded"])


def test_the_postgres_server_the_soak_crashes_comes_back_with_what_it_had():
    """tests/postgres.py's kill and start, which the soak's PostgreSQL kills use: the postmaster
    and its backends are gone, and the server starts again on its data folder with every commit it
    acknowledged (a server of its own: the session's is shared by other tests)."""
    import psycopg

    import postgres

    binaries = postgres.find_binaries()
    if binaries is None:
        pytest.skip(postgres.HOW_TO_ENABLE)
    server = postgres.PostgresServer(binaries, durable_commits=True)
    try:
        url = server.database()
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute("CREATE TABLE kept (n int)")
            connection.execute("INSERT INTO kept VALUES (7)")
        pid = server.kill()
        assert not Path(f"/proc/{pid}").exists()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=2).close()
        server.start()
        with psycopg.connect(url) as connection:
            assert connection.execute("SELECT n FROM kept").fetchall() == [(7,)]
    finally:
        server.stop()


class _Process:
    def __init__(self, pid):
        self.process = type("Popen", (), {"pid": pid})()


class _SoakMesh:
    """What Memory reads of the soak's mesh: its processes by name, their incarnations and starts."""

    def __init__(self):
        self.live = {"dispatch-0": _Process(10), "dispatch-1": _Process(11)}
        self.incarnations = {"dispatch-0": 1, "dispatch-1": 1}
        self.started_at = {"dispatch-0": 0.0, "dispatch-1": 0.0}

    def processes(self):
        return self.live


def test_a_restarted_process_is_measured_against_the_larger_of_its_own_and_its_first_warm_up(monkeypatch):
    """A dispatcher restarted into a quiet spell measured 121 MiB at 45 s and 163 at the end, where
    the one never restarted stayed at 160: its own early figure alone read 1.35x, a growth it never had."""
    rss = {10: 160 << 20, 11: 160 << 20}
    monkeypatch.setattr(chaos, "rss_bytes", lambda pid: rss[pid])
    monkeypatch.setattr(chaos.time, "monotonic", lambda: 1000.0)
    mesh = _SoakMesh()
    memory = chaos.Memory(mesh)
    memory.baseline_all()
    mesh.live["dispatch-0"], mesh.incarnations["dispatch-0"], mesh.started_at["dispatch-0"] = _Process(12), 2, 900.0
    rss[12] = 121 << 20
    memory.sample()  # 100 s after its restart: its own warm-up figure
    rss[12], rss[11] = 163 << 20, 200 << 20
    report = memory.report()
    assert report["dispatch-0"]["warm_mib"] == 121.0 and report["dispatch-0"]["first_warm_mib"] == 160.0
    assert report["dispatch-0"]["ratio"] == pytest.approx(163 / 160, abs=1e-3)
    assert report["dispatch-1"]["ratio"] == pytest.approx(200 / 160, abs=1e-3)  # growth still shows
    rss[12] = 260 << 20
    assert memory.report()["dispatch-0"]["ratio"] == pytest.approx(260 / 160, abs=1e-3)


def test_a_quiet_spell_with_jobs_in_flight_leaves_evidence_once_per_spell(monkeypatch, tmp_path):
    """A restarted dispatcher once ran nothing for 104 s with a job's shards started: the soak
    writes what the database and the dispatchers were doing, rather than leave it to a guess."""
    clock = [1000.0]
    monkeypatch.setattr(chaos.time, "time", lambda: clock[0])
    monkeypatch.setattr(chaos.shutil, "which", lambda name: None)
    mesh = _SoakMesh()
    mesh.log_dir, mesh.dispatchers, mesh.dispatch_db = tmp_path, [], "postgresql://nobody@127.0.0.1:1/none"
    runs = [chaos.JobRun("small", "run", 0, "r0", 990.0, ended_at=999.0), chaos.JobRun("small", "run", 0, "r1", 995.0)]
    watch = chaos.StallWatch(mesh, runs, chaos.threading.Lock())
    clock[0] = 1000.0 + chaos.STALL_AFTER_S - 1
    watch.sample()
    assert watch.files == []
    clock[0] = 1000.0 + chaos.STALL_AFTER_S
    watch.sample()
    watch.sample()
    assert watch.files == ["stall-0.txt"]
    text = (tmp_path / "stall-0.txt").read_text()
    assert "1 jobs in flight" in text and "dispatch database not read" in text and "py-spy is not on PATH" in text
    runs[1].ended_at = clock[0]  # the job ended: a new spell starts from there
    clock[0] += chaos.STALL_AFTER_S - 1
    watch.sample()
    assert watch.files == ["stall-0.txt"]
