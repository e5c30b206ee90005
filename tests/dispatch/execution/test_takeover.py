"""Dispatch replicas on one job book (dispatch_svc/execution/takeover.py): a job is leased to the replica
running it; once that one stops renewing, another claims the job and takes it over, keeping the
shards finished, or ends it FAILED when its inputs never all arrived; a replica that lost a lease
can no longer write the job; a cancel through any replica reaches the runner. Each on SQLite and
PostgreSQL, two books sharing one database and one data dir, as two replicas would; the clock is
the test's, so a lease runs out when the test says."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from accelmesh import errors
from dispatch_svc.dataplane.device_queues import ShardFailed
from dispatch_svc.execution import runner as runner_module
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.execution.takeover import Takeover
from dispatch_svc.jobs import events as jobs
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import INPUTS_LOST_ERROR, JobBook, LeaseLost
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.jobs.training_options import TrainingOptions
from dispatch_svc.planner import ThroughputModel

from fakes.ports import (
    AFFINE,
    BIAS,
    LINREG,
    WAIT_S,
    FakeMesh,
    FakeWorkers,
    Feed,
    X,
    linreg_data,
    linreg_sgd,
    runner_for,
    spec_for,
)

LEASE_S = 10.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def book_db(database_url):
    return "" if "://" not in database_url else database_url


class HoldingWorkers(FakeWorkers):
    """Shards from `hold_from` on wait until `let_go` (the replica "dies" with them running)."""

    hold_from = 0

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None,
                place_outputs=None, stored=None):
        if shard_index >= self.hold_from:
            self.started.set()
            while not self.let_go.wait(0.01):
                if scope.cancelled.is_set():
                    raise ShardFailed("CANCELLED: the job was cancelled")
        return super().execute(job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys,
                               place_outputs)


def holding_mesh(hold_from: int, program=AFFINE) -> FakeMesh:
    mesh = FakeMesh(program, workers=HoldingWorkers)
    mesh.workers.hold_from = hold_from
    return mesh


def replica(mesh, tmp_path, book_db, clock) -> JobRunner:
    book = JobBook(tmp_path, retention_s=3600, clock=clock, database_url=book_db, lease_s=LEASE_S)
    return JobRunner(mesh.inventory, mesh.compiler, mesh.workers, book, ThroughputModel(), limits=Limits(512, 1 << 20))


def finished_events(book: JobBook, job_id: str, count: int) -> None:
    seen = 0
    for event in book.events(job_id):
        seen += event.type == m.SHARD_FINISHED
        if seen == count:
            return


def test_a_lapsed_job_is_taken_over_keeping_its_finished_shards(tmp_path, book_db):
    clock = Clock()
    first_mesh, second_mesh = holding_mesh(hold_from=3), FakeMesh(AFFINE)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job, live = first.start(spec_for(AFFINE, [X]))
        first.run(job, live, Feed([X]))  # 200 rows of 32 bytes, 16 a shard: 13 shards; 0-2 finish
        finished_events(first.book, job.job_id, 3)
        # Written within FLUSH_S, long before a lease could lapse; this test's clock jumps the lease.
        first.book.log.flush()
        shards = len(job.plan.shards)
        assert shards > 3 and first.book.leases.runner_of(job.job_id)[0] == first.book.replica
        takeover = Takeover(second)
        assert takeover.check() == []  # the lease holds: nothing to take

        clock.now += LEASE_S + 1  # the first replica renewed no more
        assert takeover.check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        y = next(e for e in second.book.results.entries(job.job_id) if e.name == "y").read()
        s = next(e for e in second.book.results.entries(job.job_id) if e.name == "s").read()
        np.testing.assert_array_equal(y, 2 * X + BIAS)
        np.testing.assert_allclose(s, X.sum(axis=0), rtol=1e-5)
        ran_again = {shard for _, shard, _ in second_mesh.workers.attempts}
        assert ran_again == set(range(3, shards))  # the finished shards were not run twice
        assert second_mesh.inventory.released.count(job.job_id) == 2  # the stopped replica's, then its own
        events = [e.type for e in second.book.events(job.job_id)]
        assert m.TAKEN_OVER in events and events[-1] == "succeeded"
        taken = next(e for e in second.book.events(job.job_id) if e.type == m.TAKEN_OVER)
        assert f"3 of {shards} shards" in taken.message
        assert second.wait_idle(WAIT_S)  # the run has let go of all it held (after the final record)
        assert not any(second.book.inputs.entries(job.job_id))  # stored inputs go with the job's end
        assert takeover.check() == []  # a final job is nobody's to claim

        # The first replica comes back: its writes to the job are refused, its end changes nothing.
        with pytest.raises(LeaseLost):
            first.book.update(first.book.get(job.job_id), state=m.FAILED, error="stale")
        first_mesh.workers.let_go.set()
        assert first.wait_idle(WAIT_S)
        again = second.book.get(job.job_id)
        assert again.state == m.SUCCEEDED and again.error == ""
        assert job.job_id not in first_mesh.inventory.released  # it did not release what the second one held
    finally:
        first_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()


def test_shards_whose_events_were_not_yet_written_run_again_on_takeover(tmp_path, book_db, monkeypatch):
    """A replica that stops holds its last shard events in memory (written in batches, FLUSH_S, or
    before a watcher sees them): the one taking the job over runs those shards again, over the rows
    already written, and the result is whole; the stopped replica's late events are refused."""
    monkeypatch.setattr(jobs, "FLUSH_S", 3600.0)  # the first replica writes none of its shard events
    clock = Clock()
    first_mesh, second_mesh = holding_mesh(hold_from=3), FakeMesh(AFFINE)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job, live = first.start(spec_for(AFFINE, [X]))
        first.run(job, live, Feed([X]))
        with first.book._changed:  # not through a watcher, which would write them (a client saw them)
            assert first.book._changed.wait_for(lambda: all(s.done for s in job.shards[:3]), WAIT_S)
        assert second.book.finished_shards(job.job_id) == set()  # none reached the book
        shards = len(job.plan.shards)
        clock.now += LEASE_S + 1
        assert Takeover(second).check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        y = next(e for e in second.book.results.entries(job.job_id) if e.name == "y").read()
        np.testing.assert_array_equal(y, 2 * X + BIAS)
        assert [e.name for e in second.book.results.entries(job.job_id)].count("y") == 1
        assert {shard for _, shard, _ in second_mesh.workers.attempts} == set(range(shards))
        first.book.log.flush()  # refused: the job is the second replica's now
        types = [e.type for e in second.book.events(job.job_id)]
        assert types.count(m.SHARD_FINISHED) == shards and types[-1] == "succeeded"
    finally:
        first_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()


class StalledFeed(Feed):
    """A client that sent part of its input, then stopped (its replica dies before the rest)."""

    def __init__(self, arrays, stop_at: int):
        super().__init__(arrays)
        self.stop_at, self.reached, self.resume = stop_at, threading.Event(), threading.Event()

    def blocks(self):
        for first, arrays in super().blocks():
            if first >= self.stop_at:
                self.reached.set()
                self.resume.wait(WAIT_S)
                return
            yield first, arrays


def test_a_job_whose_inputs_had_not_all_arrived_ends_failed_saying_so(tmp_path, book_db):
    clock = Clock()
    first_mesh, second_mesh = FakeMesh(AFFINE), FakeMesh(AFFINE)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    feed = StalledFeed([X], stop_at=64)
    try:
        job, live = first.start(spec_for(AFFINE, [X]))
        def feed_the_first():
            with pytest.raises(errors.AccelmeshError):  # its input ends short once the test lets it go
                first.run(job, live, feed)

        threading.Thread(target=feed_the_first, daemon=True).start()
        assert feed.reached.wait(WAIT_S)
        clock.now += LEASE_S + 1
        assert Takeover(second).check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.FAILED and done.error == INPUTS_LOST_ERROR
        assert job.job_id in second_mesh.inventory.released and not second_mesh.workers.attempts
    finally:
        live.scope.cancel("the test ends")
        feed.resume.set()
        first.wait_idle(WAIT_S)
        first.book.close()
        second.book.close()


def test_a_cancel_through_another_replica_stops_the_job_where_it_runs(tmp_path, book_db):
    clock = Clock()
    first_mesh, second_mesh = holding_mesh(hold_from=0), FakeMesh(AFFINE)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job, live = first.start(spec_for(AFFINE, [X]))
        first.run(job, live, Feed([X]))
        assert first_mesh.workers.started.wait(WAIT_S)
        second.cancel(job.job_id, "cancelled by CancelJob")
        assert second.book.get(job.job_id).state == m.RUNNING  # asked, not yet acted on
        Takeover(first).check()  # the runner's next renewal reads the request
        assert live.done.wait(WAIT_S)
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.CANCELLED and "CancelJob" in done.error
    finally:
        first_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()


def test_a_lease_is_renewed_while_the_job_runs_and_dropped_when_it_ends(tmp_path, book_db):
    clock = Clock()
    mesh = holding_mesh(hold_from=0)
    runner = replica(mesh, tmp_path, book_db, clock)
    try:
        job, live = runner.start(spec_for(AFFINE, [X]))
        runner.run(job, live, Feed([X]))
        takeover = Takeover(runner)
        for _ in range(3):  # three leases pass, renewed each time: never lapsed, never claimed
            clock.now += LEASE_S * 0.9
            assert takeover.check() == []
        assert runner.book.leases.runner_of(job.job_id) == (runner.book.replica, clock.now + LEASE_S)
        mesh.workers.let_go.set()
        assert live.done.wait(WAIT_S)
        assert runner.book.leases.runner_of(job.job_id)[1] is None
        assert runner.book.get(job.job_id).state == m.SUCCEEDED
    finally:
        mesh.workers.let_go.set()
        runner.book.close()


def test_an_unleased_book_fails_its_unfinished_jobs_at_start_as_before(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db)
    job = book.create(m.JobSpec(program="affine"))
    book.close()
    again = JobBook(tmp_path, retention_s=60, database_url=book_db)
    assert again.interrupted == [job.job_id] and again.get(job.job_id).state == m.FAILED
    again.close()
    with pytest.raises(ValueError, match="leases no jobs"):
        Takeover(runner_for(FakeMesh(AFFINE), tmp_path))


def test_a_cancel_of_a_job_no_replica_leases_is_refused_quietly(tmp_path, book_db):
    book = JobBook(tmp_path, retention_s=60, database_url=book_db, lease_s=LEASE_S)
    job = book.create(m.JobSpec(program="affine"))
    book.finish(job, m.SUCCEEDED)
    assert book.leases.request_cancel(job.job_id, "too late") is False
    with pytest.raises(errors.NotFound):
        book.leases.runner_of("0" * 16)
    book.close()


def test_the_replica_that_lost_a_job_leaves_what_the_new_runner_holds(tmp_path, book_db):
    clock = Clock()
    first_mesh, second_mesh = holding_mesh(hold_from=3), holding_mesh(hold_from=6)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job, live = first.start(spec_for(AFFINE, [X]))
        first.run(job, live, Feed([X]))
        finished_events(first.book, job.job_id, 3)
        clock.now += LEASE_S + 1
        assert Takeover(second).check() == [job.job_id]
        assert second_mesh.workers.started.wait(WAIT_S)  # the new runner holds shards 6 on
        live.scope.cancel("the stopped replica wakes up")  # the old one's run ends while the new one runs
        first_mesh.workers.let_go.set()
        assert first.wait_idle(WAIT_S)
        assert job.job_id not in first_mesh.inventory.released
        assert any(e.name.startswith("input:") for e in second.book.inputs.entries(job.job_id))  # still there
        assert second.book.get(job.job_id).state == m.RUNNING
        second_mesh.workers.let_go.set()
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        s = next(e for e in second.book.results.entries(job.job_id) if e.name == "s").read()
        np.testing.assert_allclose(s, X.sum(axis=0), rtol=1e-5)
    finally:
        first_mesh.workers.let_go.set()
        second_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()


def test_a_training_job_taken_over_runs_again_from_its_stored_inputs(tmp_path, book_db):
    clock = Clock()
    x, y = linreg_data()
    options = TrainingOptions(epochs=2, batch_size=40, learning_rate=0.05, momentum=0.5, shuffle_seed=2)
    first_mesh, second_mesh = holding_mesh(hold_from=0, program=LINREG), FakeMesh(LINREG)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job, live = first.start(spec_for(LINREG, [x, y], kind=m.TRAINING, training=options))
        threading.Thread(target=first.run, args=(job, live, Feed([x, y])), daemon=True).start()
        assert first_mesh.workers.started.wait(WAIT_S)  # its first step is on the devices, its inputs all stored
        clock.now += LEASE_S + 1
        assert Takeover(second).check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        w, losses = linreg_sgd(x, y, options)  # the steps from the start, as one process would take them
        entries = {e.name: e for e in second.book.results.entries(job.job_id)}
        np.testing.assert_allclose(entries["w"].read(), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(entries["losses"].read(), losses, rtol=1e-5)
        taken = next(e for e in second.book.events(job.job_id) if e.type == m.TAKEN_OVER)
        assert "runs again from its stored inputs" in taken.message
    finally:
        first_mesh.workers.let_go.set()
        first.wait_idle(WAIT_S)
        first.book.close()
        second.book.close()


def test_a_leased_book_ends_the_unfinished_jobs_no_replica_leases(tmp_path, book_db):
    unleased = JobBook(tmp_path, retention_s=60, database_url=book_db)  # as a book before leases
    job = unleased.create(m.JobSpec(program="affine"))
    unleased.close()
    clock = Clock()
    leased = JobBook(tmp_path, retention_s=60, database_url=book_db, lease_s=LEASE_S, clock=clock)
    running = leased.create(m.JobSpec(program="affine"))  # leased: not this start's to end
    other = JobBook(tmp_path, retention_s=60, database_url=book_db, lease_s=LEASE_S, clock=clock)
    try:
        assert leased.interrupted == [job.job_id]
        assert leased.get(job.job_id).state == m.FAILED and "restarted" in leased.get(job.job_id).error
        assert other.interrupted == [] and other.get(running.job_id).state == m.PLANNING
        assert other.leases.runner_of(job.job_id)[1] is None  # final: nobody's to take over
    finally:
        leased.close()
        other.close()


def ended_while_the_book_was_away(first: JobRunner, first_mesh: FakeMesh, monkeypatch) -> m.JobRecord:
    """A job of AFFINE over X run on `first` whose shards all finish while its book's `finish`
    does not answer (RECORD_WAIT_S set to 0 by the caller): let go of unrecorded."""
    job, live = first.start(spec_for(AFFINE, [X]))
    first.run(job, live, Feed([X]))
    first_mesh.workers.started.wait(WAIT_S)

    def away(*_, **__):
        raise errors.Unavailable("the database is not answering")
    monkeypatch.setattr(first.book, "finish", away)
    first_mesh.workers.let_go.set()
    assert live.done.wait(WAIT_S), "the job was never let go of"
    return job


def test_a_job_whose_end_the_book_could_not_record_is_let_go_of_and_taken_over(tmp_path, book_db, monkeypatch):
    """The chaos soak's stall: the database went away as a job ended, its end could not be written,
    and the replica kept the job live and its lease renewed for good (RUNNING, never taken over),
    while the queue pass that had started it waited on it."""
    monkeypatch.setattr(runner_module, "RECORD_WAIT_S", 0.0)  # give up at the first failure
    clock = Clock()
    first_mesh = holding_mesh(hold_from=0)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(FakeMesh(AFFINE), tmp_path, book_db, clock)
    try:
        job = ended_while_the_book_was_away(first, first_mesh, monkeypatch)
        assert first.live(job.job_id) is None
        assert first.book.get(job.job_id).state == m.RUNNING  # unrecorded, as the database was away

        renewing = Takeover(first)
        clock.now += LEASE_S * 0.9
        assert renewing.check() == []
        clock.now += LEASE_S * 0.2  # past the lease it had: not renewed, since nothing runs it here
        assert Takeover(second).check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        np.testing.assert_array_equal(
            next(e for e in second.book.results.entries(job.job_id) if e.name == "y").read(), 2 * X + BIAS)
    finally:
        first_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()


def test_a_job_end_is_recorded_once_the_book_answers_again(tmp_path, book_db, monkeypatch):
    """The database back within RECORD_WAIT_S: the job's end is written by its own replica, its
    final event once although the first try logged it and then failed to save the state."""
    monkeypatch.setattr(runner_module, "RECORD_RETRY_S", 0.0)
    clock = Clock()
    mesh = holding_mesh(hold_from=0)
    runner = replica(mesh, tmp_path, book_db, clock)
    try:
        job, live = runner.start(spec_for(AFFINE, [X]))
        runner.run(job, live, Feed([X]))
        mesh.workers.started.wait(WAIT_S)
        save, failures = runner.book.rows.save, []

        def fails_once(record, **options):
            if record.final and not failures:
                failures.append(record.state)
                raise errors.Unavailable("the database is not answering")
            return save(record, **options)
        monkeypatch.setattr(runner.book.rows, "save", fails_once)
        mesh.workers.let_go.set()
        assert live.done.wait(WAIT_S)
        assert failures == [m.SUCCEEDED]
        done = runner.book.get(job.job_id)
        assert done.state == m.SUCCEEDED and runner.book.leases.runner_of(job.job_id)[1] is None
        assert [e.type for e in runner.book.events(job.job_id)].count("succeeded") == 1
    finally:
        mesh.workers.let_go.set()
        runner.book.close()


def test_a_job_taken_over_with_every_shard_finished_ends_without_reserving_anything(tmp_path, book_db, monkeypatch):
    """In the chaos soak a job whose every shard had finished, but whose end the database (down
    for 4 s) did not take, was taken over and FAILED "claims is empty": the new runner asked the
    inventory to reserve no device. It has nothing left to run: it combines what its shards wrote."""
    monkeypatch.setattr(runner_module, "RECORD_WAIT_S", 0.0)
    clock = Clock()
    first_mesh, second_mesh = holding_mesh(hold_from=0), FakeMesh(AFFINE)
    first, second = replica(first_mesh, tmp_path, book_db, clock), replica(second_mesh, tmp_path, book_db, clock)
    try:
        job = ended_while_the_book_was_away(first, first_mesh, monkeypatch)
        first.book.log.flush()  # every SHARD_FINISHED written, as in the soak
        assert len(first.book.finished_shards(job.job_id)) == len(job.plan.shards)

        clock.now += LEASE_S + 1
        assert Takeover(second).check() == [job.job_id]
        done = second.book.wait_final(job.job_id, WAIT_S)
        assert done.state == m.SUCCEEDED, done.error
        np.testing.assert_array_equal(
            next(e for e in second.book.results.entries(job.job_id) if e.name == "y").read(), 2 * X + BIAS)
        np.testing.assert_allclose(
            next(e for e in second.book.results.entries(job.job_id) if e.name == "s").read(), X.sum(axis=0),
            rtol=1e-5)
        assert second_mesh.workers.attempts == [] and job.job_id not in second_mesh.inventory.reserved
    finally:
        first_mesh.workers.let_go.set()
        first.book.close()
        second.book.close()
