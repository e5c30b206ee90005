"""The job book: records, event logs, results on disk, retention and restarts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from accelmesh import errors
from dispatch_svc import records as m
from dispatch_svc.jobs import RESTART_ERROR, JobBook


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


SPEC = m.JobSpec(program="mlp_classifier", inputs=(m.InputDecl("x", "float32", (10, 64)),))


def test_records_events_and_results_survive_a_reopen(tmp_path):
    book = JobBook(tmp_path, retention_s=60)
    job = book.create(SPEC)
    book.emit(job, m.PLANNED, message="4 shards")
    writer = book.results.create(job.job_id, "logits", "float32", (10, 3))
    writer.write_rows(4, np.ones((6, 3), np.float32))
    writer.write_rows(0, np.zeros((4, 3), np.float32))
    writer.close()
    book.finish(job, m.SUCCEEDED)
    book.close()

    again = JobBook(tmp_path, retention_s=60)
    record = again.get(job.job_id)
    assert record.state == m.SUCCEEDED and record.spec == SPEC and record.expires is not None
    assert [e.type for e in again.events(job.job_id)] == [m.PLANNED, "succeeded"]
    (entry,) = again.results.entries(job.job_id)
    np.testing.assert_array_equal(entry.read(), np.r_[np.zeros((4, 3)), np.ones((6, 3))].astype(np.float32))
    np.testing.assert_array_equal(entry.read_rows(3, 5), np.array([[0, 0, 0], [1, 1, 1]], np.float32))


def test_a_job_running_when_the_dispatcher_stopped_is_reported_failed_not_running(tmp_path):
    book = JobBook(tmp_path, retention_s=60)
    job = book.create(SPEC)
    book.update(job, state=m.RUNNING)
    book.close()
    again = JobBook(tmp_path, retention_s=60)
    record = again.get(job.job_id)
    assert record.state == m.FAILED and record.error == RESTART_ERROR
    assert list(again.events(job.job_id))[-1].type == "failed"


def test_results_expire_after_the_retention_period(tmp_path):
    clock = Clock()
    book = JobBook(tmp_path, retention_s=30, clock=clock)
    job = book.create(SPEC)
    book.results.save(job.job_id, "y", np.arange(3, dtype=np.float32))
    book.finish(job, m.SUCCEEDED)
    clock.now += 29
    assert book.expire_results() == 0 and book.get(job.job_id).state == m.SUCCEEDED
    clock.now += 2
    assert book.expire_results() == 1
    with pytest.raises(errors.NotFound):
        book.get(job.job_id)
    assert book.results.entries(job.job_id) == []


def test_a_watcher_gets_every_event_including_the_last(tmp_path):
    book = JobBook(tmp_path, retention_s=60)
    job = book.create(SPEC)
    seen = []
    watching = threading.Thread(target=lambda: seen.extend(e.type for e in book.events(job.job_id)))
    watching.start()
    for i in range(5):
        book.emit(job, m.SHARD_FINISHED, message=str(i))
    book.finish(job, m.FAILED, error="shard 3 could not run")
    watching.join(timeout=30)
    assert not watching.is_alive()
    assert seen == [m.SHARD_FINISHED] * 5 + ["failed"]
    assert book.get(job.job_id).error == "shard 3 could not run"


def test_a_book_from_before_the_expires_column_still_expires_its_jobs(tmp_path):
    clock = Clock()
    book = JobBook(tmp_path, retention_s=30, clock=clock)
    job = book.create(SPEC)
    book.finish(job, m.SUCCEEDED)
    book.close()
    import sqlite3  # the layout of earlier versions: the expiry only inside the JSON record

    with sqlite3.connect(tmp_path / "jobs.db") as db:
        db.execute("CREATE TABLE old AS SELECT job_id, created, state, record FROM jobs")
        db.execute("DROP TABLE jobs")
        db.execute("ALTER TABLE old RENAME TO jobs")
    clock.now += 31
    reopened = JobBook(tmp_path, retention_s=30, clock=clock)  # opening sweeps expired jobs
    with pytest.raises(errors.NotFound):
        reopened.get(job.job_id)


def plan_of(shards: int) -> m.Plan:
    """`shards` shards over two devices, each device's share in at most two sizes, larger first
    (as the planner cuts them)."""
    half, out, first = shards // 2, [], 0
    for i in range(shards):
        device, rows = (0, 8) if i < half else (1, 5 if i < half + half // 2 else 4)  # larger pieces first
        out.append(m.ShardPlan(i, f"10.0.0.1/cuda:{device}", f"type{device}", first, rows,
                               rows * 0.01))
        first += rows
    target = m.TargetPlan("type0", "cuda-fp32", "fp32", "p", ("10.0.0.1/cuda:0",), 10.0, "catalog")
    return m.Plan((target,), tuple(out), 1.0, 1.0)


def test_a_plan_of_many_equal_shards_is_stored_as_runs_and_read_back_whole(tmp_path):
    book = JobBook(tmp_path, retention_s=60)
    job = book.create(SPEC)
    plan = plan_of(20_000)
    book.update(job, plan=plan, state=m.COMPILING)
    book.emit(job, m.PLANNED, plan=plan)
    book.finish(job, m.SUCCEEDED)
    book.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "jobs.db") as db:
        (record,) = db.execute("SELECT length(record) FROM jobs").fetchone()
        (event,) = db.execute("SELECT max(length(event)) FROM events").fetchone()
    assert record < 4096 and event < 4096  # 20,000 shards spelled out would be ~2 MB
    again = JobBook(tmp_path, retention_s=60)
    assert again.get(job.job_id).plan == plan
    assert next(again.events(job.job_id)).plan == plan


def store_old_record(book_dir, shards: int) -> str:
    """A finished job as a dispatcher before the limits stored it: every shard spelled out."""
    import dataclasses
    import json
    import sqlite3

    book = JobBook(book_dir, retention_s=3600)
    job = book.create(SPEC)
    book.finish(job, m.SUCCEEDED)
    book.close()
    old = dataclasses.asdict(job)
    old["plan"] = {"targets": [], "predicted_seconds": 1.0, "equal_split_predicted_seconds": 1.0, "placement": None,
                   "shards": [{"index": i, "device_id": "10.0.0.1/cuda:0", "target_type": "t", "first_row": i,
                               "rows": 1, "predicted_seconds": i * 1e-6} for i in range(shards)]}
    with sqlite3.connect(book_dir / "jobs.db") as db:
        db.execute("UPDATE jobs SET record = ? WHERE job_id = ?", (json.dumps(old), job.job_id))
    return job.job_id


def test_an_oversized_record_from_before_the_limits_is_read_without_its_plan(tmp_path, caplog):
    old = store_old_record(tmp_path, shards=50_000)  # ~6 MB of JSON
    book = JobBook(tmp_path, retention_s=3600)
    newer = book.create(SPEC)
    book.finish(newer, m.SUCCEEDED)
    record = book.get(old)
    assert record.state == m.SUCCEEDED and record.spec == SPEC and record.plan is None
    assert "too large" in record.error and f"job {old}" in caplog.text
    assert [j.job_id for j in book.list(10)] == [newer.job_id, old]
    assert [j.job_id for j in book.list(1)] == [newer.job_id]


def test_a_record_that_does_not_parse_is_read_from_its_columns(tmp_path, caplog):
    import sqlite3

    book = JobBook(tmp_path, retention_s=3600)
    job = book.create(SPEC)
    book.finish(job, m.FAILED, error="boom")
    book.close()
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        db.execute("UPDATE jobs SET record = ? WHERE job_id = ?", ('{"job_id": "x", "spec": 3', job.job_id))
    again = JobBook(tmp_path, retention_s=3600)
    (listed,) = again.list(5)
    assert listed.job_id == job.job_id and listed.state == m.FAILED and "does not parse" in caplog.text
    assert again.get(job.job_id).job_id == job.job_id


def test_listings_and_the_expiry_sweep_read_an_index_not_the_whole_table(tmp_path):
    """Every new job sweeps for expired ones and ListJobs asks for the newest: with thousands of
    jobs kept, neither may scan (and sort) the whole book."""
    book = JobBook(tmp_path, retention_s=30)
    for owner in ("a", "b"):
        book.finish(book.create(SPEC, owner=owner), m.SUCCEEDED)
    statements: list[str] = []
    book._db.set_trace_callback(statements.append)
    book.list(5)
    book.list(5, owner="a")
    book.expire_results()
    book._db.set_trace_callback(None)
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT") and " FROM jobs" in s]
    assert len(reads) == 3, statements
    for sql in reads:
        plan = " | ".join(row[3] for row in book._db.execute("EXPLAIN QUERY PLAN " + sql))
        assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, (sql, plan)
