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
