"""The job queue and quotas (dispatch_svc/admission/queue.py, quotas.py) on the job runner: a job that finds
the pool full, or its owner's quota used up, waits QUEUED with its inputs stored and starts once
there is room; priorities order the queue; a deadline ends a job that waited too long; a queued
job can be cancelled; the queue outlives a restart and is one for two replicas. Each on SQLite
and PostgreSQL. The pool is a `PoolInventory`: the fake Inventory port whose reservations refuse what
does not fit, as the inventory's do. Queue passes are run by the test, so nothing waits on a timer."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from accelmesh import errors
from dispatch_svc.admission.admission import AdmissionGate, NoCapacityNow
from dispatch_svc.admission.queue import JobQueue, QueueSignals
from dispatch_svc.admission.quotas import Quota, Quotas
from dispatch_svc.admission.scheduling.rounds import Round
from dispatch_svc.api import delivery
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.planner import ThroughputModel

from fakes.ports import (
    AFFINE,
    BIAS,
    CHAIN,
    KS,
    WAIT_S,
    FakeInventory,
    FakeMesh,
    FakePipelineCompiler,
    FakePipelineInventory,
    FakePipelineWorkers,
    FakeWorkers,
    Feed,
    X,
    spec_for,
)

CLAIM = 16 + 1024  # what an AFFINE job reserves on each device it uses: its parameters and a shard
ALICE, BOB = "user:alice", "user:bob"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class PoolInventory(FakeInventory):
    """Devices of CLAIM * 1.5 bytes each: one job at a time fits. `occupy` reserves every device
    for a job of the test's; `order` lists jobs as their reservations succeeded."""

    def __init__(self, devices):
        super().__init__(devices)
        self.capacity = CLAIM * 3 // 2
        self.holding: dict[str, dict[str, int]] = {}  # job -> device -> bytes
        self.order: list[str] = []
        self._pool_lock = threading.Lock()

    def pool_state(self):
        with self._pool_lock:
            return tuple(sorted((job, tuple(sorted(held.items()))) for job, held in self.holding.items()))

    def reserved_device_ids(self):
        with self._pool_lock:
            return frozenset(device for held in self.holding.values() for device in held)

    def occupy(self, job_id: str) -> None:
        self.reserve(job_id, [(d.id, self.capacity) for d in self.devices], 60)

    def reserve(self, job_id, claims, ttl_s):
        with self._pool_lock:
            for device, nbytes in claims:
                used = sum(held.get(device, 0) for job, held in self.holding.items() if job != job_id)
                if used + nbytes > self.capacity:
                    raise errors.ResourceExhausted(
                        f"memory_bytes: requested {nbytes} bytes on device {device!r} but only "
                        f"{self.capacity - used} bytes are free after other jobs' reservations")
            self.holding[job_id] = dict(claims)
            self.order.append(job_id)
        super().reserve(job_id, claims, ttl_s)

    def release(self, job_id):
        with self._pool_lock:
            self.holding.pop(job_id, None)
        super().release(job_id)


class HeldWorkers(FakeWorkers):
    """The jobs in `held_jobs` run their shards only once `let_go` is set."""

    def __init__(self, program):
        super().__init__(program)
        self.held_jobs: set[str] = set()

    def execute(self, job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys=None,
                place_outputs=None, stored=None):
        if job_id in self.held_jobs:
            self.started.set()
            assert self.let_go.wait(WAIT_S)
        return super().execute(job_id, shard_index, attempt, device, build, artifact, arrays, rows, scope, held_keys,
                               place_outputs)


def pool_mesh() -> FakeMesh:
    return FakeMesh(AFFINE, inventory=PoolInventory, workers=HeldWorkers)


class ParameterFeed(Feed):
    def parameters(self):
        return [("b", BIAS * 3)]


@pytest.fixture
def book_db(database_url):
    return "" if "://" not in database_url else database_url


@pytest.fixture
def clock():
    return Clock()


def replica(mesh, tmp_path, book_db, clock, lease_s=0.0, scheduling=None, max_queued=100,
            max_queued_bytes=1 << 30) -> tuple[JobRunner, JobQueue]:
    book = JobBook(tmp_path, retention_s=3600, clock=clock, database_url=book_db, lease_s=lease_s)
    quotas = Quotas(book.engine)
    gate = AdmissionGate(mesh.inventory, quotas=quotas, max_queued=max_queued, max_queued_bytes=max_queued_bytes)
    signals = QueueSignals(lambda: (mesh.inventory.pool_state(), quotas.all()), clock=clock)
    runner = JobRunner(mesh.inventory, mesh.compiler, mesh.workers, book, ThroughputModel(),
                       limits=Limits(1024, 1 << 20),
                       gate=gate, signals=signals, clock=clock)
    queue = JobQueue(book, runner.start_queued, runner.expire_queued, signals, clock=clock, scheduling=scheduling)
    return runner, queue


@pytest.fixture
def mesh():
    mesh = pool_mesh()
    yield mesh
    mesh.workers.let_go.set()


@pytest.fixture
def node(mesh, tmp_path, book_db, clock):
    runner, queue = replica(mesh, tmp_path, book_db, clock)
    yield runner, queue
    mesh.workers.let_go.set()
    runner.wait_idle(WAIT_S)
    runner.book.close()


def submit(runner: JobRunner, owner: str = ALICE, feed: Feed | None = None, hold: bool = False,
           **fields) -> m.JobRecord:
    """Start a job as RunJob does; returns its record once it runs in the background or waits queued.
    `hold`: its shards wait for the mesh's `let_go`."""
    job, live = runner.start(spec_for(AFFINE, [X], **fields), owner)
    if hold:
        runner.workers.held_jobs.add(job.job_id)
    runner.run(job, live, feed or Feed([X]))
    return runner.book.get(job.job_id)


def finished(runner: JobRunner, job: m.JobRecord) -> m.JobRecord:
    done = runner.book.wait_final(job.job_id, WAIT_S)
    assert runner.wait_idle(WAIT_S)
    return done


def let_go_of(runner: JobRunner, job: m.JobRecord) -> None:
    """Wait until the runner let go of the job (final in the book, its end told to the queue)."""
    live = runner.live(job.job_id)
    assert live is None or live.done.wait(WAIT_S)


def logged(book: JobBook, job_id: str) -> list[m.Event]:
    """The job's events so far (WatchJob's would go on waiting for a queued job's next one)."""
    idle = object()
    events = []
    for event in book.events(job_id, idle=idle):
        if event is idle:
            return events
        events.append(event)
    return events


def y_of(runner: JobRunner, job: m.JobRecord) -> np.ndarray:
    return next(e for e in runner.book.results.entries(job.job_id) if e.name == "y").read()


def test_a_job_that_finds_the_pool_full_waits_and_starts_once_devices_free_up(node, mesh):
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    job = submit(runner)
    assert job.state == m.QUEUED
    assert job.queue.position == 1 and "devices:" in job.queue.reason and "free" in job.queue.reason
    assert job.queue.deadline == pytest.approx(job.queue.since + 24 * 3600)
    queued = [e for e in logged(runner.book, job.job_id) if e.type == m.QUEUED_EVENT]
    assert [e.queue.position for e in queued] == [1] and queued[0].queue.reason == job.queue.reason
    assert {e.name for e in runner.book.inputs.entries(job.job_id)} == {"input:x"}  # stored whole
    assert runner.running == 0 and runner.book.live_count == 0  # nothing of it is held in memory

    assert queue.run_pass() == []  # nothing changed since it was refused: not tried again
    # A change that makes no room: the reservation a byte smaller.
    mesh.inventory.reserve("someone-else", [(d.id, mesh.inventory.capacity - 1) for d in mesh.devices], 60)
    assert queue.run_pass() == [job.job_id]  # tried: still no room
    assert runner.book.get(job.job_id).state == m.QUEUED
    # Refused again, and why changed: a second QUEUED event says so.
    queued = [e for e in logged(runner.book, job.job_id) if e.type == m.QUEUED_EVENT]
    assert len(queued) == 2 and "only 1 bytes are free" in queued[1].queue.reason
    assert queue.run_pass() == []  # and nothing changed since

    mesh.inventory.release("someone-else")
    assert queue.run_pass() == [job.job_id]
    done = finished(runner, job)
    assert done.state == m.SUCCEEDED, done.error
    np.testing.assert_array_equal(y_of(runner, done), 2 * X + BIAS)
    assert done.queue.reason == queued[1].queue.reason  # the record remembers why it waited last
    assert not any(runner.book.inputs.entries(job.job_id))  # stored inputs go with the job's end
    assert queue.run_pass() == []


class HeldComputeInventory(FakePipelineInventory):
    """Scores devices as the inventory does while other jobs hold them: every claim takes the
    device's whole compute (GrpcInventory reserves compute_fraction 1), so a held device has none
    free, though its memory has room. A release lets go of the job's claims."""

    def score_devices(self, kind, precision, intensity, weights, constraints, device_ids=()):
        scoring = super().score_devices(kind, precision, intensity, weights, constraints, device_ids)
        held = self.reserved_device_ids()
        return dataclasses.replace(scoring, devices={
            d: dataclasses.replace(status, free_compute_tflops=0.0, reserved_compute_fraction=1.0) if d in held
            else status for d, status in scoring.devices.items()})

    def release(self, job_id):
        self.reserved.pop(job_id, None)
        super().release(job_id)


def placed_job(runner: JobRunner, rows: np.ndarray) -> m.JobRecord:
    """Start CHAIN placed as the soak (bench/chaos.py) places its pipeline: balanced over 2 devices."""
    placement = m.PlacementSpec("balanced", device_count=2, micro_batch_rows=8)
    job, live = runner.start(spec_for(CHAIN, [rows], placement=placement), ALICE)
    runner.run(job, live, Feed([rows]))
    return runner.book.get(job.job_id)


@pytest.fixture
def held_compute(tmp_path, book_db, clock):
    mesh = FakeMesh(CHAIN, types=("v100-32gb", "a100-80gb"), inventory=HeldComputeInventory,
                    compiler=FakePipelineCompiler, workers=FakePipelineWorkers)
    runner, queue = replica(mesh, tmp_path, book_db, clock)
    mesh.inventory.reserve("someone-else", [(d.id, 1) for d in mesh.devices], 60)
    yield mesh, runner, queue
    runner.wait_idle(WAIT_S)
    runner.book.close()


def test_a_placed_model_whose_devices_other_jobs_hold_waits_and_runs_once_they_let_go(held_compute):
    """The soak's pipelines failed here ("no split ... fits the devices' memory"): with every
    device's compute reserved the placement saw no free compute, which is no memory misfit."""
    mesh, runner, queue = held_compute
    rows = np.random.default_rng(5).normal(size=(24, 4)).astype(np.float32)
    job = placed_job(runner, rows)
    assert job.state == m.QUEUED, job.error
    assert "devices:" in job.queue.reason and "compute free now" in job.queue.reason
    assert job.job_id not in mesh.inventory.reserved  # nothing held while it waits

    mesh.inventory.release("someone-else")
    assert queue.run_pass() == [job.job_id]
    done = finished(runner, job)
    assert done.state == m.SUCCEEDED, done.error
    np.testing.assert_allclose(y_of(runner, done), rows + sum(KS), rtol=1e-6)
    assert done.plan.placement.device_count == 2


def test_a_placed_model_too_big_for_the_devices_even_free_fails_at_once_while_they_are_held(held_compute):
    """Only a model that the devices cannot hold even with nothing else on them stays a final failure."""
    mesh, runner, queue = held_compute
    placement = m.PlacementSpec("balanced", device_count=2, micro_batch_rows=10**10)  # 160 GB of activations a layer
    job, live = runner.start(spec_for(CHAIN, [X], placement=placement), ALICE)
    with pytest.raises(errors.ResourceExhausted, match="short by") as err:
        runner.run(job, live, Feed([X]))
    assert not isinstance(err.value, NoCapacityNow)
    assert runner.book.get(job.job_id).state == m.FAILED


@pytest.mark.parametrize("request_id", ["", "retry-7"])
def test_the_run_job_client_of_a_queued_job_that_fails_is_told_what_to_do_with_or_without_a_request_id(
        node, mesh, request_id):
    """A job that went to the queue ends through delivery's _ending, which once said "of this
    request_id" to a client that had sent none."""
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    job, live = runner.start(spec_for(AFFINE, [X], request_id=request_id), ALICE)
    pieces = delivery.run(runner, job, live, Feed([X]), slab_bytes=64)
    assert any(isinstance(p, delivery.EventOut) and p.event.type == m.QUEUED_EVENT for p in pieces)  # stops there
    assert runner.expire_queued(job.job_id, "it waited in the queue past its deadline (spec.queue_timeout)")
    with pytest.raises(errors.FailedPrecondition) as err:
        list(pieces)
    message = str(err.value)
    assert f"job {job.job_id}" in message and "past its deadline" in message
    if request_id:
        assert "of request_id 'retry-7' failed" in message and "a new request_id" in message
    else:
        assert "request_id" not in message and "submit the job again" in message


def test_client_parameters_wait_with_the_job_and_are_the_ones_it_runs_with(node, mesh):
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    job = submit(runner, feed=ParameterFeed([X]), client_parameters=True)
    assert job.state == m.QUEUED
    mesh.inventory.release("someone-else")
    queue.run_pass()
    done = finished(runner, job)
    assert done.state == m.SUCCEEDED, done.error
    np.testing.assert_array_equal(y_of(runner, done), 2 * X + BIAS * 3)


def test_higher_priority_goes_first_and_equal_priorities_in_queue_order(node, mesh, clock):
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    low = submit(runner, name="low")
    clock.now += 1
    high = submit(runner, name="high", priority=5)
    clock.now += 1
    later = submit(runner, name="later")
    positions = {j.spec.name: runner.book.get(j.job_id).queue.position for j in (low, high, later)}
    assert positions == {"high": 1, "low": 2, "later": 3}

    mesh.inventory.release("someone-else")
    mesh.workers.held_jobs.add(high.job_id)  # high holds the pool until the test lets it go
    queue.run_pass()
    assert mesh.inventory.order[-1] == high.job_id
    assert runner.book.get(low.job_id).state == m.QUEUED  # tried, no room: back, keeping its place
    low_events = [e for e in logged(runner.book, low.job_id) if e.type == m.QUEUED_EVENT]
    # Queued 1st; behind high (2nd) when the pass tried it; 1st again when it came back: said again.
    assert [e.queue.position for e in low_events] == [1, 1]

    mesh.workers.let_go.set()
    assert finished(runner, high).state == m.SUCCEEDED
    queue.run_pass()
    assert finished(runner, low).state == m.SUCCEEDED
    queue.run_pass()
    assert finished(runner, later).state == m.SUCCEEDED
    assert mesh.inventory.order[-3:] == [high.job_id, low.job_id, later.job_id]


def test_a_quota_holds_a_tenants_next_job_but_not_another_tenants(node, mesh):
    runner, queue = node
    mesh.inventory.capacity = CLAIM * 10  # room for every job: only the quota holds one back
    runner.gate.quotas.set(Quota(ALICE, max_jobs=1))
    first = submit(runner, owner=ALICE, hold=True)
    second = submit(runner, owner=ALICE)
    assert second.state == m.QUEUED
    assert second.queue.reason.startswith("quota: user:alice's other jobs hold 1 jobs holding devices")
    bobs = submit(runner, owner=BOB)
    assert bobs.state != m.QUEUED
    assert runner.book.wait_final(bobs.job_id, WAIT_S).state == m.SUCCEEDED  # bob has no quota: not held back
    let_go_of(runner, bobs)  # so its end's wake-up is in: the pass below tries alice's job for it
    use = {u.tenant: u for u in runner.gate.quotas.usage()}
    assert (use[ALICE].jobs, use[ALICE].queued, use[ALICE].quota.max_jobs) == (1, 1, 1)
    assert use[ALICE].devices == len(mesh.inventory.holding[first.job_id])

    assert queue.run_pass() == [second.job_id] and runner.book.get(second.job_id).state == m.QUEUED
    mesh.workers.let_go.set()
    assert finished(runner, first).state == m.SUCCEEDED
    queue.run_pass()
    assert finished(runner, second).state == m.SUCCEEDED


def test_the_default_quota_applies_to_tenants_without_their_own(node, mesh):
    runner, _ = node
    mesh.inventory.capacity = CLAIM * 10
    runner.gate.quotas.set(Quota("*", max_jobs=1))
    runner.gate.quotas.set(Quota(BOB))  # bob's own: no limit
    submit(runner, owner=ALICE, hold=True)
    second = submit(runner, owner=ALICE)
    assert second.state == m.QUEUED
    assert "the default quota (\"*\"), which applies to user:alice" in second.queue.reason
    bobs = [submit(runner, owner=BOB) for _ in range(2)]
    assert all(runner.book.wait_final(j.job_id, WAIT_S).state == m.SUCCEEDED for j in bobs)


def test_a_job_over_its_quota_by_itself_fails_at_once_naming_the_limit(node, mesh):
    runner, _ = node
    runner.gate.quotas.set(Quota(ALICE, max_devices=1))
    with pytest.raises(errors.ResourceExhausted, match="so it can never start"):
        submit(runner, owner=ALICE)
    (job,) = runner.book.list(10)
    assert job.state == m.FAILED
    used = len(job.plan.shards and {s.device_id for s in job.plan.shards})
    assert used > 1 and f"needs {used} devices" in job.error and "allows 1 at once, so it can never start" in job.error
    assert "spec.constraints.max_devices" in job.error
    fits = submit(runner, owner=ALICE, constraints=m.Constraints(filter="a100"))  # one device
    assert runner.book.wait_final(fits.job_id, WAIT_S).state == m.SUCCEEDED


def test_a_priority_above_the_quota_is_refused_before_the_job_exists(node):
    runner, _ = node
    runner.gate.quotas.set(Quota(ALICE, max_priority=3))
    with pytest.raises(errors.PermissionDenied,
                       match="spec.priority is 5, but the quota of user:alice allows at most 3"):
        runner.start(spec_for(AFFINE, [X], priority=5), ALICE)
    assert runner.book.list(10) == []
    within = submit(runner, owner=ALICE, priority=3)
    assert finished(runner, within).state == m.SUCCEEDED


def test_a_job_queued_past_its_deadline_fails_saying_why_it_waited(node, mesh, clock):
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    job = submit(runner, queue_timeout_s=30.0)
    assert job.queue.deadline == clock.now + 30
    clock.now += 29
    queue.run_pass()
    assert runner.book.get(job.job_id).state == m.QUEUED
    clock.now += 2
    assert queue.run_pass() == []
    done = runner.book.get(job.job_id)
    assert done.state == m.FAILED and "past its deadline (spec.queue_timeout)" in done.error
    assert "it was waiting because devices:" in done.error
    assert not any(runner.book.inputs.entries(job.job_id))


def test_a_job_that_may_not_wait_fails_at_once_as_before_queues(node, mesh):
    runner, _ = node
    mesh.inventory.occupy("someone-else")
    with pytest.raises(errors.ResourceExhausted, match="the job was not queued"):
        submit(runner, queue_timeout_s=0.0)
    (job,) = runner.book.list(10)
    assert job.state == m.FAILED
    assert "free after other jobs' reservations" in job.error and "spec.queue_timeout is 0 s" in job.error
    assert not any(runner.book.inputs.entries(job.job_id))


def test_a_tenant_with_as_many_jobs_queued_as_one_may_is_refused_the_next_and_another_tenant_is_not(
        mesh, tmp_path, book_db, clock):
    runner, queue = replica(mesh, tmp_path, book_db, clock, max_queued=2)
    mesh.inventory.occupy("someone-else")
    waiting = [submit(runner, owner=ALICE) for _ in range(2)]
    assert [j.state for j in waiting] == [m.QUEUED, m.QUEUED]
    with pytest.raises(errors.ResourceExhausted, match=r"user:alice has 2 jobs queued already, the most one tenant "
                                                         r"may \(ACCELMESH_MAX_QUEUED_PER_TENANT=2\)"):
        submit(runner, owner=ALICE)
    refused = next(j for j in runner.book.list(10) if j.job_id not in {w.job_id for w in waiting} and j.owner == ALICE)
    assert refused.state == m.FAILED and "devices:" in refused.error  # why it could not start, too
    assert not any(runner.book.inputs.entries(refused.job_id))  # nothing of it stored
    assert submit(runner, owner=BOB).state == m.QUEUED  # bob's own count
    mesh.inventory.release("someone-else")
    mesh.inventory.capacity = CLAIM * 10  # room for all: one pass starts every queued job
    queue.run_pass()
    assert [finished(runner, job).state for job in waiting] == [m.SUCCEEDED, m.SUCCEEDED]
    runner.book.close()


class BarrierFeed(Feed):
    """Hands out its rows only once every submitter of the test has come this far (its place in the
    queue granted, its inputs about to be stored) or been refused: each decision is then made
    while every other job granted a place still has its inputs being stored, not yet QUEUED."""

    def __init__(self, arrays, barrier: threading.Barrier):
        super().__init__(arrays)
        self._barrier = barrier

    def blocks(self):
        self._barrier.wait(WAIT_S)
        yield from super().blocks()


def submit_at_once(runners: list[JobRunner], count: int, owner: str = ALICE) -> list:
    """`count` jobs of `owner` submitted from as many threads, spread over `runners`: each one's
    state once submitted (QUEUED), or the error it was refused with."""
    barrier = threading.Barrier(count)
    outcomes: list = [None] * count

    def one(index: int) -> None:
        try:
            outcomes[index] = submit(runners[index % len(runners)], owner, feed=BarrierFeed([X], barrier)).state
        except errors.AccelmeshError as exc:
            outcomes[index] = exc
            barrier.wait(WAIT_S)  # refused before storing anything: let the others' inputs through

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_per_tenant_queue_bound_holds_under_concurrent_submits_on_one_or_two_replicas(
        mesh, tmp_path, book_db, clock, replicas):
    """Ten jobs of one tenant submitted at once, against a bound of 3 places in the queue, through one
    replica or two sharing the book: exactly 3 are queued and the other 7 are refused
    RESOURCE_EXHAUSTED, naming the bound, with nothing of theirs stored."""
    nodes = [replica(mesh, tmp_path, book_db, clock, lease_s=10.0 if replicas > 1 else 0.0, max_queued=3)
             for _ in range(replicas)]
    runners = [runner for runner, _ in nodes]
    try:
        mesh.inventory.occupy("someone-else")
        outcomes = submit_at_once(runners, 10)
        assert outcomes.count(m.QUEUED) == 3, outcomes
        refused = [o for o in outcomes if o != m.QUEUED]
        assert len(refused) == 7 and all(isinstance(o, errors.ResourceExhausted) for o in refused), refused
        for error in refused:
            assert error.reason == errors.QUEUE_FULL
            assert ("devices:" in str(error) and "user:alice has 3 jobs queued already, the most one tenant may "
                    "(ACCELMESH_MAX_QUEUED_PER_TENANT=3)" in str(error)), str(error)
        (use,) = runners[0].gate.quotas.usage(ALICE)
        assert use.queued == 3
        jobs = runners[0].book.list(20, owner=ALICE)
        assert sorted(j.state for j in jobs) == sorted([m.QUEUED] * 3 + [m.FAILED] * 7)
        assert all(not any(runners[0].book.inputs.entries(j.job_id)) for j in jobs if j.state == m.FAILED)
    finally:
        for runner in runners:
            runner.book.close()


def test_the_bytes_of_a_tenants_queued_jobs_are_bounded_and_the_next_is_refused_naming_the_limit(
        mesh, tmp_path, book_db, clock):
    """The stored inputs of one tenant's queued jobs take at most ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT
    together: the job that would pass it is refused before its inputs are stored, another tenant's
    is not, and one that cancels frees its bytes."""
    runner, _ = replica(mesh, tmp_path, book_db, clock, max_queued_bytes=2 * X.nbytes + X.nbytes // 2)
    try:
        mesh.inventory.occupy("someone-else")
        waiting = [submit(runner, owner=ALICE) for _ in range(2)]
        assert [j.state for j in waiting] == [m.QUEUED, m.QUEUED]
        with pytest.raises(errors.ResourceExhausted) as refused:
            submit(runner, owner=ALICE)
        assert refused.value.reason == errors.QUEUE_FULL
        assert (f"user:alice's queued jobs' inputs take {2 * X.nbytes:,} bytes already and this job's {X.nbytes:,} "
                "more" in str(refused.value)) and "ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT=" in str(refused.value)
        assert submit(runner, owner=BOB).state == m.QUEUED
        runner.cancel(waiting[0].job_id)
        assert submit(runner, owner=ALICE).state == m.QUEUED
    finally:
        runner.book.close()


def test_a_queued_job_can_be_cancelled_and_is_never_started(node, mesh):
    runner, queue = node
    mesh.inventory.occupy("someone-else")
    job = submit(runner)
    runner.cancel(job.job_id, "not needed any more")
    done = runner.book.get(job.job_id)
    assert done.state == m.CANCELLED and done.error == "not needed any more"
    assert [e.type for e in logged(runner.book, done.job_id)][-1] == "cancelled"
    mesh.inventory.release("someone-else")
    assert queue.run_pass() == []
    assert job.job_id not in mesh.inventory.order and not any(runner.book.inputs.entries(job.job_id))


def test_the_queue_outlives_a_restart(mesh, tmp_path, book_db, clock):
    runner, _ = replica(mesh, tmp_path, book_db, clock)
    mesh.inventory.occupy("someone-else")
    job = submit(runner)
    runner.book.close()  # the dispatcher stops

    again, queue = replica(mesh, tmp_path, book_db, clock)
    try:
        assert again.book.interrupted == []  # a queued job was not cut off by the restart
        assert again.book.get(job.job_id).state == m.QUEUED
        mesh.inventory.release("someone-else")
        assert queue.run_pass() == [job.job_id]
        done = finished(again, job)
        assert done.state == m.SUCCEEDED, done.error
        np.testing.assert_array_equal(y_of(again, done), 2 * X + BIAS)
    finally:
        again.book.close()


def test_two_replicas_share_one_queue_and_start_a_job_once(mesh, tmp_path, book_db, clock):
    (first, first_queue), (second, second_queue) = (replica(mesh, tmp_path, book_db, clock, lease_s=10.0)
                                                    for _ in range(2))
    try:
        mesh.inventory.occupy("someone-else")
        job = submit(first)
        assert second.book.get(job.job_id).state == m.QUEUED and second.book.queue_rows.position(job.job_id) == 1
        mesh.inventory.release("someone-else")
        assert second_queue.run_pass() == [job.job_id]
        assert first_queue.run_pass() == []  # started by the other replica already
        assert first.book.claim_queued(job.job_id) is None
        done = finished(second, job)
        assert done.state == m.SUCCEEDED, done.error
        assert mesh.inventory.order.count(job.job_id) == 1
    finally:
        first.book.close()
        second.book.close()


def test_a_listing_shows_a_queued_jobs_place(node, mesh):
    runner, _ = node
    mesh.inventory.occupy("someone-else")
    submit(runner)
    listed = runner.book.list(10)
    assert [(j.state, j.queue.position) for j in listed] == [(m.QUEUED, 1)]


@pytest.mark.parametrize("tenant", ["alice", "user:", "robot:r2", ""])
def test_a_quota_for_something_that_owns_no_jobs_is_refused_naming_the_field(node, tenant):
    runner, _ = node
    with pytest.raises(errors.InvalidArgument, match="is not a tenant") as refused:
        runner.gate.quotas.set(Quota(tenant, max_jobs=1))
    assert refused.value.field == "quota.tenant"


def test_the_spec_carries_priority_and_queue_timeout_and_refuses_bad_ones_naming_the_field():
    from accelmesh.dispatch.v1 import job_pb2 as job_pb
    from dispatch_svc.api import translate as tr

    msg = job_pb.JobSpec(program="affine", priority=7)
    msg.queue_timeout.FromNanoseconds(2_500_000_000)
    spec = tr.spec_from_proto(msg)
    assert (spec.priority, spec.queue_timeout_s) == (7, 2.5)
    assert tr.spec_from_proto(tr.spec_to_proto(spec)) == spec  # and back, as records and listings carry it
    assert tr.spec_from_proto(job_pb.JobSpec(program="affine")).queue_timeout_s is None  # unset: the dispatcher's
    msg.queue_timeout.seconds = 10**12  # longer than a timedelta holds: still a number of seconds
    assert tr.spec_from_proto(msg).queue_timeout_s == 10**12 + 0.5
    for bad, field in ((job_pb.JobSpec(program="affine", priority=1001), "spec.priority"),
                       (job_pb.JobSpec(program="affine", priority=-1), "spec.priority")):
        with pytest.raises(errors.InvalidArgument) as refused:
            tr.spec_from_proto(bad)
        assert refused.value.field == field
    negative = job_pb.JobSpec(program="affine")
    negative.queue_timeout.seconds = -5
    with pytest.raises(errors.InvalidArgument, match="spec.queue_timeout is -5 s; use 0 s to never queue"):
        tr.spec_from_proto(negative)


def two_queued(runner: JobRunner, mesh: FakeMesh, clock: Clock) -> list[m.JobRecord]:
    """"first", then "second" a second later, both queued behind a reservation of the whole pool
    (the test releases it)."""
    mesh.inventory.occupy("someone-else")
    jobs = []
    for name in ("first", "second"):
        jobs.append(submit(runner, name=name))
        clock.now += 1
    assert [j.state for j in jobs] == [m.QUEUED, m.QUEUED]
    return jobs


def test_a_scheduling_round_starts_queued_jobs_together_each_on_the_devices_it_was_given(mesh, tmp_path, book_db,
                                                                                        clock):
    table = {AFFINE.name: {"v100-32gb": 10.0, "a100-80gb": 100.0}}
    scheduling = Round("max_min_fairness", mesh.inventory, ThroughputModel(), mesh.inventory.reserved_device_ids, table)
    runner, queue = replica(mesh, tmp_path, book_db, clock, scheduling=scheduling)
    jobs = two_queued(runner, mesh, clock)
    mesh.inventory.release("someone-else")
    assert sorted(queue.run_pass()) == sorted(j.job_id for j in jobs)  # one pass starts both
    done = [finished(runner, j) for j in jobs]
    assert [d.state for d in done] == [m.SUCCEEDED, m.SUCCEEDED], [d.error for d in done]
    for job in done:
        np.testing.assert_array_equal(y_of(runner, job), 2 * X + BIAS)
    used = [{s.device_id for s in job.plan.shards} for job in done]
    assert not used[0] & used[1]  # each kept to the devices the round gave it
    # The last plan of each: the first, when it was submitted, found the pool full.
    planned = [[e for e in logged(runner.book, job.job_id) if e.type == m.PLANNED][-1] for job in done]
    assert all("the queue's max_min_fairness policy gave it" in e.message for e in planned), [
        e.message for e in planned]
    assert runner.book.get(jobs[0].job_id).spec == jobs[0].spec  # the narrowing was never stored


def test_without_a_round_the_first_queued_job_takes_the_pool_and_the_next_waits(node, mesh, clock):
    runner, queue = node
    jobs = two_queued(runner, mesh, clock)
    mesh.inventory.release("someone-else")
    mesh.workers.held_jobs.add(jobs[0].job_id)
    assert queue.run_pass() == [j.job_id for j in jobs]
    assert runner.book.get(jobs[1].job_id).state == m.QUEUED  # first fit: the first took every device
    mesh.workers.let_go.set()
    assert finished(runner, jobs[0]).state == m.SUCCEEDED


class InventoryDown:
    """What a scheduling round reads the devices from, not answering."""

    def candidate_devices(self, constraints):
        raise errors.Unavailable("inventory: connection refused")


def test_a_round_that_fails_costs_only_its_advice_the_jobs_start_unnarrowed_in_order(mesh, tmp_path, book_db, clock,
                                                                                      caplog):
    scheduling = Round("min_total_time", InventoryDown(), ThroughputModel(), mesh.inventory.reserved_device_ids)
    runner, queue = replica(mesh, tmp_path, book_db, clock, scheduling=scheduling)
    jobs = two_queued(runner, mesh, clock)
    mesh.inventory.release("someone-else")
    mesh.inventory.capacity = CLAIM * 10  # room for both on every device
    assert queue.run_pass() == [j.job_id for j in jobs]
    assert "the scheduling round failed (inventory: connection refused)" in caplog.text
    for job in jobs:
        assert finished(runner, job).state == m.SUCCEEDED
        plan = [e for e in logged(runner.book, job.job_id) if e.type == m.PLANNED][-1]
        assert "policy gave it" not in plan.message
    runner.book.close()
