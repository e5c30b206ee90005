"""RunJob's batches (RunJobRequest.accept_batches): a client that accepts them gets the same parts
in the same order in fewer messages, nothing it could have now waits for the job's next step, and
a client that does not ask gets no batch. Through a real in-process server on port 0 over the fake
mesh of tests/fakes/ports.py (tests/fakes/small_dispatcher.py)."""

from __future__ import annotations

import numpy as np
import pytest

from accelmesh.client import job_spec, request_parts
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.runtime.batches import unbatched
from accelmesh.runtime.tensors import TensorCollector
from dispatch_svc.api import delivery

from fakes.ports import BIAS, WAIT_S, X
from fakes.small_dispatcher import requests, serving


@pytest.fixture
def dispatcher(tmp_path):
    with serving(tmp_path) as d:
        yield d


def run_stream(stub, x: np.ndarray, accept_batches: bool):
    parts = request_parts(job_spec("affine", {"x": x}), {"x": x}, None, 1024)
    stream = (pb.RunJobRequest(**{field: message}, accept_batches=accept_batches and field == "spec")
              for field, message in parts)
    return stub.RunJob(stream, timeout=WAIT_S)


def read(parts: list[pb.RunJobResponse]):
    """(event types, results, final state) of a RunJob's parts."""
    results = TensorCollector("result").collect(p for p in parts if p.WhichOneof("part") in ("tensor", "chunk"))
    events = [p.event.type for p in parts if p.WhichOneof("part") == "event"]
    (job,) = [p.job for p in parts if p.WhichOneof("part") == "job"]
    return events, results, job.state


def test_a_client_accepting_batches_gets_the_same_parts_in_fewer_messages(dispatcher):
    x = X[:192]
    plain = list(run_stream(dispatcher.stub, x, accept_batches=False))
    assert all(p.WhichOneof("part") != "batch" for p in plain)

    messages = list(run_stream(dispatcher.stub, x, accept_batches=True))
    parts = list(unbatched(messages))
    # At least the job's end comes batched: its last event, the folded result and the job record
    # are all ready at once.
    assert any(m.WhichOneof("part") == "batch" for m in messages)
    assert len(messages) < len(parts)
    events, results, state = read(parts)
    assert state == job_pb.JOB_STATE_SUCCEEDED
    # The same events (their order among shards on different devices is the run's own).
    assert sorted(events) == sorted(read(plain)[0]) and events[-1] == job_pb.JOB_EVENT_TYPE_SUCCEEDED
    np.testing.assert_array_equal(results["y"], 2 * x + BIAS)
    np.testing.assert_allclose(results["s"], x.sum(axis=0), rtol=1e-5)


def test_nothing_ready_waits_in_a_batch_for_the_jobs_next_step(dispatcher):
    """With every shard held on its device, the events so far (the plan) reach the client: the
    batch went when the job had nothing more ready, not when it filled or the job ended."""
    dispatcher.mesh.workers.hold = True
    call = run_stream(dispatcher.stub, X[:192], accept_batches=True)
    try:
        first = list(unbatched([next(call)]))
        assert first[0].WhichOneof("part") == "event" and first[0].event.type == job_pb.JOB_EVENT_TYPE_PLANNED
        assert dispatcher.mesh.workers.started.wait(WAIT_S) and not dispatcher.mesh.workers.let_go.is_set()
    finally:
        dispatcher.mesh.workers.let_go.set()
    rest = list(unbatched(call))
    assert read([*first, *rest])[2] == job_pb.JOB_STATE_SUCCEEDED


def test_a_request_id_retried_replays_the_job_in_batches_too(dispatcher):
    x = X[:128]
    spec = job_spec("affine", {"x": x}, request_id="2f1e0c8a-batches")
    parts = list(request_parts(spec, {"x": x}, None, 1024))
    first = list(dispatcher.stub.RunJob(requests(parts, pb.RunJobRequest), timeout=WAIT_S))
    again = [pb.RunJobRequest(**{field: message}, accept_batches=field == "spec") for field, message in parts]
    replayed = list(dispatcher.stub.RunJob(iter(again), timeout=WAIT_S))
    assert any(m.WhichOneof("part") == "batch" for m in replayed)
    (events, results, state), (first_events, first_results, _) = read(list(unbatched(replayed))), read(first)
    assert events == first_events and state == job_pb.JOB_STATE_SUCCEEDED
    for name in ("y", "s"):
        np.testing.assert_array_equal(results[name], first_results[name])


def test_shard_events_wait_a_little_for_company_and_never_for_the_jobs_next_step(dispatcher):
    """With every shard held on its device, their SHARD_STARTED events still reach the client:
    they waited at most LINGER_S for more to go with them, not for the next event."""
    dispatcher.mesh.workers.hold = True
    call = run_stream(dispatcher.stub, X[:192], accept_batches=True)
    parts = unbatched(call)
    seen = []
    try:
        while job_pb.JOB_EVENT_TYPE_SHARD_STARTED not in seen:
            part = next(parts)
            if part.WhichOneof("part") == "event":
                seen.append(part.event.type)
        assert not dispatcher.mesh.workers.let_go.is_set()
    finally:
        dispatcher.mesh.workers.let_go.set()
    assert read(list(parts))[2] == job_pb.JOB_STATE_SUCCEEDED


def test_shard_events_and_rows_linger_and_anything_else_goes_at_once():
    now = [100.0]
    linger = delivery._Linger(lambda: now[0])
    assert linger.due()  # nothing gathered: an IDLE sends (nothing)
    linger.added(False)  # a shard event
    assert not linger.due() and linger.wait_s() == pytest.approx(delivery.LINGER_S)
    now[0] += delivery.LINGER_S / 4
    linger.added(False)  # another: the first one's time still counts
    assert not linger.due() and linger.wait_s() == pytest.approx(delivery.LINGER_S * 3 / 4)
    now[0] += delivery.LINGER_S
    assert linger.due() and linger.wait_s() == delivery.WATCH_POLL_S
    linger.added(False)
    linger.added(True)  # put_inputs, outputs, the job's end, another event: all of it goes now
    assert linger.due()
