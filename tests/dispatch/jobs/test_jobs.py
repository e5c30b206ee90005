"""The job book: records, event logs, results on disk, retention and restarts."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest

from accelmesh import errors
from dispatch_svc.jobs import events as jobs
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import RESTART_ERROR, JobBook


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


SPEC = m.JobSpec(program="mlp_classifier", inputs=(m.InputDecl("x", "float32", (10, 64)),))


@pytest.fixture
def book_db(database_url):
    """The book's database on each engine: "" (the SQLite file in the data dir), then PostgreSQL."""
    return "" if "://" not in database_url else database_url


def test_records_events_and_results_survive_a_reopen(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    job = book.create(SPEC)
    book.emit(job, m.PLANNED, message="4 shards")
    writer = book.results.create(job.job_id, "logits", "float32", (10, 3))
    writer.write_rows(4, np.ones((6, 3), np.float32))
    writer.write_rows(0, np.zeros((4, 3), np.float32))
    writer.close()
    book.finish(job, m.SUCCEEDED)
    book.close()

    again = JobBook(tmp_path, retention_s=60, database_url=book_db)
    record = again.get(job.job_id)
    assert record.state == m.SUCCEEDED and record.spec == SPEC and record.expires is not None
    assert [e.type for e in again.events(job.job_id)] == [m.PLANNED, "succeeded"]
    (entry,) = again.results.entries(job.job_id)
    np.testing.assert_array_equal(entry.read(), np.r_[np.zeros((4, 3)), np.ones((6, 3))].astype(np.float32))
    np.testing.assert_array_equal(entry.read_rows(3, 5), np.array([[0, 0, 0], [1, 1, 1]], np.float32))


def test_a_job_running_when_the_dispatcher_stopped_is_reported_failed_not_running(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    job = book.create(SPEC)
    book.update(job, state=m.RUNNING)
    book.close()
    again = JobBook(tmp_path, retention_s=60, database_url=book_db)
    record = again.get(job.job_id)
    assert record.state == m.FAILED and record.error == RESTART_ERROR
    assert list(again.events(job.job_id))[-1].type == "failed"


def test_shard_events_are_written_in_batches_in_order_and_seen_from_memory_meanwhile(tmp_path, book_db, monkeypatch):
    """SHARD_STARTED and SHARD_FINISHED wait in memory (at most FLUSH_S, FLUSH_EVENTS): a watcher
    here sees them at once; any other event writes them first, so the log's order is the order
    they happened in; the database has them after that write, a full batch, or close."""
    monkeypatch.setattr(jobs, "FLUSH_S", 3600.0)  # only a full batch, another event or close writes them
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    try:
        job = book.create(SPEC)
        book.emit(job, m.PLANNED, message="2 shards")
        record = m.ShardRecord(0, "dev-0", "t", "r", 0, 5)
        book.emit(job, m.SHARD_STARTED, shard=record, message="shard 0")
        record.execute_seconds = 0.25  # the record changes later: the event keeps it as it was
        book.emit(job, m.SHARD_FINISHED, shard=record, message="shard 0 done")
        seen = book.events(job.job_id)
        assert [next(seen).type for _ in range(3)] == [m.PLANNED, m.SHARD_STARTED, m.SHARD_FINISHED]
        assert stored_events(book, job.job_id) == [m.PLANNED]  # the shard events wait in memory
        book.emit(job, m.SHARD_RETRIED, message="shard 1 retried")  # not batched: writes the others first
        assert stored_events(book, job.job_id) == [m.PLANNED, m.SHARD_STARTED, m.SHARD_FINISHED, m.SHARD_RETRIED]
        first_started = book.events(job.job_id, 1)
        assert next(first_started).shard.execute_seconds == 0 and next(first_started).shard.execute_seconds == 0.25
        for index in range(jobs.FLUSH_EVENTS):  # a full batch is written at once
            book.emit(job, m.SHARD_STARTED, shard=record, message=f"shard {index}")
        assert len(stored_events(book, job.job_id)) == 4 + jobs.FLUSH_EVENTS
        book.emit(job, m.SHARD_FINISHED, shard=record, message="last")
        assert len(stored_events(book, job.job_id)) == 4 + jobs.FLUSH_EVENTS
    finally:
        book.close()  # writes what waits
    again = JobBook(tmp_path, retention_s=60, database_url=book_db)  # ends the unfinished job (restart)
    try:
        types = stored_events(again, job.job_id)
        assert types[-2:] == [m.SHARD_FINISHED, "failed"] and len(types) == 6 + jobs.FLUSH_EVENTS
    finally:
        again.close()


def stored_events(book: JobBook, job_id: str) -> list[str]:
    """The types of the job's events in the book's database, as another process would read them."""
    with book.engine.connect() as connection:
        texts = connection.execute(jobs._ALL_EVENTS, {"job_id": job_id}).scalars().all()
    return [json.loads(text)["type"] for text in texts]


def test_batched_shard_events_reach_the_database_within_flush_s_on_their_own(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    other = JobBook(tmp_path, retention_s=60, database_url=book_db)
    try:
        job = book.create(SPEC)
        book.emit(job, m.PLANNED)
        book.emit(job, m.SHARD_STARTED, shard=m.ShardRecord(0, "dev-0", "t", "r", 0, 5))
        # Read through the other book, which sees only the database (its watcher looks every WATCH_POLL_S).
        seen = other.events(job.job_id)
        assert [next(seen).type for _ in range(2)] == [m.PLANNED, m.SHARD_STARTED]
    finally:
        book.close()
        other.close()


def test_results_expire_after_the_retention_period(tmp_path, book_db):
    clock = Clock()
    book = JobBook(tmp_path, retention_s=30, clock=clock, database_url=book_db)
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


def test_a_watcher_gets_every_event_including_the_last(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
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


# The layout of a book before migrations: tables made by CREATE IF NOT EXISTS, and at first the
# expiry and owner only inside the JSON record.
OLD_LAYOUT = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE events (job_id TEXT NOT NULL, idx INTEGER NOT NULL, event TEXT NOT NULL, PRIMARY KEY (job_id, idx))
    WITHOUT ROWID;
"""


def old_book(book_dir, *jobs: m.JobRecord, records: dict[str, str] | None = None) -> None:
    """A book as a dispatcher before migrations left it, holding `jobs` (their record text from
    `records` where given)."""
    import sqlite3

    from dispatch_svc.jobs.codec import record_text

    with sqlite3.connect(book_dir / "jobs.db") as db:
        db.executescript(OLD_LAYOUT)
        for job in jobs:
            db.execute("INSERT INTO jobs VALUES (?, ?, ?, ?)",
                       (job.job_id, job.created, job.state, (records or {}).get(job.job_id) or record_text(job)))


def finished(job_id: str, *, created: float, expires: float | None = None) -> m.JobRecord:
    return m.JobRecord(job_id=job_id, spec=SPEC, created=created, state=m.SUCCEEDED, ended=created, expires=expires)


def test_a_book_from_before_the_expires_column_still_expires_its_jobs(tmp_path):
    clock = Clock()
    old_book(tmp_path, finished("a" * 16, created=clock.now, expires=clock.now + 30),
             finished("b" * 16, created=clock.now, expires=clock.now + 300))
    clock.now += 31
    reopened = JobBook(tmp_path, retention_s=30, clock=clock)  # opening migrates it, then sweeps expired jobs
    with pytest.raises(errors.NotFound):
        reopened.get("a" * 16)
    kept = reopened.get("b" * 16)
    assert kept.state == m.SUCCEEDED and kept.spec == SPEC and kept.expires == clock.now - 31 + 300


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


def test_a_plan_of_many_equal_shards_is_stored_as_runs_and_read_back_whole(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    job = book.create(SPEC)
    plan = plan_of(20_000)
    book.update(job, plan=plan, state=m.COMPILING)
    book.emit(job, m.PLANNED, plan=plan)
    book.finish(job, m.SUCCEEDED)
    import sqlalchemy as sa

    with book.engine.connect() as db:
        record = db.execute(sa.text("SELECT length(record) FROM jobs")).scalar_one()
        event = db.execute(sa.text("SELECT max(length(event)) FROM events")).scalar_one()
    book.close()
    assert record < 4096 and event < 4096  # 20,000 shards spelled out would be ~2 MB
    again = JobBook(tmp_path, retention_s=60, database_url=book_db)
    assert again.get(job.job_id).plan == plan
    assert next(again.events(job.job_id)).plan == plan


def store_old_record(book_dir, shards: int) -> str:
    """A finished job as a dispatcher before the limits stored it: every shard spelled out."""
    import dataclasses
    import json

    job = finished("0" * 16, created=1000.0, expires=1e12)
    old = dataclasses.asdict(job)
    old["plan"] = {"targets": [], "predicted_seconds": 1.0, "equal_split_predicted_seconds": 1.0, "placement": None,
                   "shards": [{"index": i, "device_id": "10.0.0.1/cuda:0", "target_type": "t", "first_row": i,
                               "rows": 1, "predicted_seconds": i * 1e-6} for i in range(shards)]}
    old_book(book_dir, job, records={job.job_id: json.dumps(old)})
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


def test_listings_and_the_expiry_sweep_read_an_index_not_the_whole_table(tmp_path, book_db):
    """Every new job sweeps for expired ones and ListJobs asks for the newest: with thousands of
    jobs kept, neither may scan (and sort) the whole book. Each engine is asked how it would run the
    book's own statements (PostgreSQL told to avoid scans where it can, as it would on a big table)."""
    import sqlalchemy as sa

    book = JobBook(tmp_path, retention_s=30, database_url=book_db)
    for owner in ("a", "b"):
        book.finish(book.create(SPEC, owner=owner), m.SUCCEEDED)
    statements: list[tuple] = []

    def capture(_conn, _cursor, statement, parameters, _context, _many):
        statements.append((statement, parameters))

    sa.event.listen(book.engine, "before_cursor_execute", capture)
    book.list(5)
    book.list(5, owner="a")
    book.expire_results()
    sa.event.remove(book.engine, "before_cursor_execute", capture)
    reads = [(sql, args) for sql, args in statements
             if sql.lstrip().upper().startswith("SELECT") and "FROM jobs" in sql]
    assert len(reads) == 3, statements
    with book.engine.connect() as connection:
        postgres = connection.dialect.name == "postgresql"
        if postgres:
            for method in ("seqscan", "bitmapscan", "sort"):  # still chosen only where nothing else can do
                connection.exec_driver_sql(f"SET enable_{method} = off")
        for sql, args in reads:
            rows = connection.exec_driver_sql(("EXPLAIN " if postgres else "EXPLAIN QUERY PLAN ") + sql, args).all()
            plan = " | ".join(str(row[-1]) for row in rows)
            if postgres:
                assert "Index" in plan and "Sort" not in plan, (sql, plan)
            else:
                assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, (sql, plan)


def test_two_books_on_one_database_create_one_job_per_request_id(tmp_path, book_db):
    """Two dispatch replicas on one database: a request id is taken once, whichever creates first;
    another owner's same id is another job."""
    import dataclasses

    first = JobBook(tmp_path / "a", retention_s=60, database_url=book_db or str(tmp_path / "shared.db"))
    second = JobBook(tmp_path / "b", retention_s=60, database_url=book_db or str(tmp_path / "shared.db"))
    spec = dataclasses.replace(SPEC, request_id="retry-me")
    job = first.create(spec, owner="alice")
    with pytest.raises(errors.AlreadyExists):
        second.create(spec, owner="alice")
    assert second.by_request("alice", "retry-me").job_id == job.job_id
    assert second.by_request("bob", "retry-me") is None and second.by_request("alice", "") is None
    assert second.create(spec, owner="bob").job_id != job.job_id


def test_a_watcher_on_one_book_sees_the_events_another_book_on_the_database_writes(tmp_path, book_db):
    """WatchJob through a dispatch replica other than the one running the job: its events come,
    the last one included, though no write of this process wakes the watcher."""
    url = book_db or str(tmp_path / "shared.db")
    running, watching = (JobBook(tmp_path / name, retention_s=60, database_url=url) for name in ("a", "b"))
    job = running.create(SPEC)
    running.emit(job, m.PLANNED, message="2 shards")
    seen = []
    watcher = threading.Thread(target=lambda: seen.extend(e.type for e in watching.events(job.job_id)), daemon=True)
    watcher.start()
    waiting = threading.Event()  # never set: its wait() is a bounded poll interval
    for _ in range(3000):  # until the watcher has read the log so far and waits for more
        if watching._changed._waiters:
            break
        waiting.wait(0.01)
    assert watching._changed._waiters, "the watcher never waited for events"
    running.emit(job, m.SHARD_FINISHED, message="0")
    running.finish(job, m.SUCCEEDED)
    watcher.join(timeout=30)
    assert not watcher.is_alive(), "the watcher never saw the job end"
    assert seen == [m.PLANNED, m.SHARD_FINISHED, "succeeded"]


def test_a_watcher_caught_up_with_a_job_this_book_logs_waits_without_asking_the_database(tmp_path, book_db):
    """RunJob's watcher wakes for every shard event; once it has had them all, the book knows the
    database holds nothing newer for a job it logs itself (unleased), so it waits without a query."""
    import queue

    import sqlalchemy as sa

    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    try:
        job = book.create(SPEC)
        book.emit(job, m.PLANNED, message="3 shards")
        handed: queue.Queue[m.Event] = queue.Queue()
        watcher = threading.Thread(target=lambda: [handed.put(e) for e in book.events(job.job_id)], daemon=True)
        watcher.start()
        assert handed.get(timeout=30).type == m.PLANNED
        queries: list[str] = []
        sa.event.listen(book.engine, "before_cursor_execute",
                        lambda conn, cursor, statement, *rest: queries.append(statement))
        waiting = threading.Event()  # never set: its wait() is a bounded poll interval
        for index in range(3):
            book.emit(job, m.SHARD_FINISHED, shard=m.ShardRecord(index, "dev-0", "t", "r", index, 1))
            assert handed.get(timeout=30).shard.index == index
            for _ in range(3000):  # until the watcher has looped back and waits for the next one
                if book._changed._waiters:
                    break
                waiting.wait(0.01)
        reads = [q for q in queries if "events" in q and q.lstrip().upper().startswith("SELECT")]
        assert reads == [], f"a caught-up watcher read the events table {len(reads)} times"
        book.finish(job, m.SUCCEEDED)
        assert handed.get(timeout=30).type == "succeeded"
        watcher.join(timeout=30)
        assert not watcher.is_alive()
    finally:
        book.close()


def test_a_watcher_given_an_idle_marker_gets_it_before_each_wait_and_only_then(tmp_path, book_db):
    """RunJob sends what it gathered when the log has nothing more for now: the marker comes once
    the watcher has had every event so far, never between events that were there together."""
    idle = object()
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    try:
        job = book.create(SPEC)
        book.emit(job, m.PLANNED, message="2 shards")
        book.emit(job, m.SHARD_STARTED, shard=m.ShardRecord(0, "dev-0", "t", "r", 0, 5))
        seen = book.events(job.job_id, idle=idle)
        assert [next(seen).type for _ in range(2)] == [m.PLANNED, m.SHARD_STARTED]
        assert next(seen) is idle  # nothing more yet: said before waiting
        book.emit(job, m.SHARD_FINISHED, shard=m.ShardRecord(0, "dev-0", "t", "r", 0, 5))
        book.finish(job, m.SUCCEEDED)
        assert [e if e is idle else e.type for e in seen] == [m.SHARD_FINISHED, "succeeded"]
    finally:
        book.close()


def test_a_watcher_given_idle_s_waits_no_longer_than_it_says_and_is_told_idle_again(tmp_path, book_db):
    """With idle_s the marker comes again after each wait (here of 0 s), though nothing happened:
    RunJob lets a shard's events wait a little for company, and sends them when that is over."""
    idle = object()
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    waits = []
    try:
        job = book.create(SPEC)
        book.emit(job, m.PLANNED, message="1 shard")
        seen = book.events(job.job_id, idle=idle, idle_s=lambda: waits.append(0.0) or 0.0)
        assert next(seen).type == m.PLANNED
        assert [next(seen) for _ in range(3)] == [idle, idle, idle]
        assert len(waits) >= 2  # each idle after the first came after a wait bounded by idle_s
        book.finish(job, m.SUCCEEDED)
        assert [e if e is idle else e.type for e in seen] == ["succeeded"]
    finally:
        book.close()


def test_an_event_with_every_field_set_reads_back_equal():
    """event_text writes an event's fields out by name (not dataclasses.asdict): none is lost."""
    from dispatch_svc.jobs.codec import event_from, event_text

    shard = m.ShardRecord(3, "dev-1", "cuda:v100", "cuda-fp32", 24, 8, attempts=2, failures=["UNAVAILABLE: gone"],
                          queue_seconds=0.1, load_seconds=0.2, execute_seconds=0.3, total_seconds=0.7, done=True,
                          predicted_seconds=0.5)
    event = m.Event(index=7, type=m.SHARD_FINISHED, time=1234.5, progress=0.75, message="shard 3 done", shard=shard,
                    step=4, loss=0.125)
    assert {f.name for f in dataclasses.fields(event)} == set(json.loads(event_text(event)))
    assert event_from(json.loads(event_text(event))) == event


def test_a_watcher_rides_out_a_database_that_does_not_answer_for_a_while(tmp_path, book_db, monkeypatch):
    """In the chaos soak a RunJob following its job from the queue ended UNAVAILABLE when the
    database restarted for 4 s, and the end of its call cancelled the job ("the client of its
    RunJob call disconnected"). The watcher now looks again for FOLLOW_OUTAGE_S first."""
    monkeypatch.setattr(jobs, "OUTAGE_RETRY_S", 0.0)
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    job = book.create(SPEC)
    book.emit(job, m.PLANNED, message="2 shards")
    book.finish(job, m.SUCCEEDED)
    book.forget_live(job.job_id)  # read from the database, as a watcher on another replica reads it
    away = [3]

    def final(job_id):
        if away[0]:
            away[0] -= 1
            raise errors.Unavailable("the database is not answering; try again when it is back")
        return book._final(job_id)

    assert [e.type for e in book.log.read(job.job_id, 0, final)] == [m.PLANNED, "succeeded"]
    assert away == [0]
    monkeypatch.setattr(jobs, "FOLLOW_OUTAGE_S", 0.0)  # an outage past the bound is raised
    away[0] = 1
    with pytest.raises(errors.Unavailable):
        list(book.log.read(job.job_id, 0, final))
