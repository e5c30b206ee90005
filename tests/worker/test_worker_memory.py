"""What a worker holds for calls and jobs, through real gRPC against a worker in this process: a
header's declared size allocates nothing, a cancelled call gives back what it received as soon as
it ends (with the garbage collector off, so a reference cycle would show), and the per-call and
held-tensor limits are enforced with statuses that name them. Memory is read with tracemalloc
and the servicer's own counters, never with the process's RSS or timing."""

from __future__ import annotations

import gc
import itertools
import threading
import tracemalloc
from collections.abc import Iterator

import grpc
import jax
import numpy as np
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import build_pb2
from accelmesh.programs import TargetType
from accelmesh.runtime.channels import open_channel
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from worker_svc.agent import NodeAgent
from worker_svc.config import WorkerConfig
from worker_svc.held_tensors import HeldTensors
from worker_svc.ledger import InputStats
from worker_svc.server import build_worker

from conftest import CREDENTIALS, as_role, rpc_error
from fakes import host
from fakes.nvml import FakeNvml

pytestmark = pytest.mark.fixture_cpu

MIB = 1024 * 1024
GIB = 1024 * MIB
CALL_TIMEOUT_S = 60.0
RECEIVED_CHUNKS = 16  # MiB a cancelled call receives of the GiB its header declares
LEFT_BEHIND_BYTES = 2 * MIB  # what may stay traced after it ends: the channel's own buffers, not its inputs
HELD_TENSORS = 2
MAX_INPUTS = 4


class GatedArtifacts:
    """No artifact is ever found; a fetch waits for `release` while `hold` is set, so a shard can
    keep the device while another queues."""

    def __init__(self):
        self.hold, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

    def fetch(self, key, digest):
        self.entered.set()
        if self.hold.is_set():
            assert self.release.wait(CALL_TIMEOUT_S)
        raise errors.FailedPrecondition(f"artifact {key} is not served in this test")


class Worker:
    def __init__(self, server, artifacts: GatedArtifacts):
        self.server, self.artifacts = server, artifacts
        self.servicer = server.services[0].servicer
        (device,) = self.servicer.agent.describe().devices
        self.device_id = device.id
        self.target_type = TargetType(device.platform, device.execution_platform, device.type, frozenset()).key
        self.channel = open_channel(f"127.0.0.1:{server.port}", **as_role(Role.DISPATCH))
        self.stub = worker_service_pb2_grpc.WorkerServiceStub(self.channel)

    def header(self, **fields) -> pb.ShardHeader:
        values = {"job_id": "job-1", "device_id": self.device_id, "target_type": self.target_type,
                  "artifact_key": "0" * 64, "artifact_digest": "0" * 64,
                  "artifact_format": build_pb2.ARTIFACT_FORMAT_EXECUTABLE, "input_count": 1, "batch_size": 1}
        return pb.ShardHeader(**(values | fields))

    def hold(self, job_id: str, key: str, nbytes: int) -> None:
        """Hold a tensor for `job_id` as this test's dispatcher would have it held (every call here
        fails, and a failed call keeps nothing it asked to keep)."""
        cert = x509.load_pem_x509_certificate(CREDENTIALS.service(Role.DISPATCH).tls.cert_file.read_bytes())
        role, name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value.split("/", 1)
        self.servicer.held.keep(f"{role}:{name}|{job_id}", key, np.zeros(nbytes, np.uint8))

    def call(self, messages) -> grpc.RpcError:
        """The error an Execute call of `messages` ends with (every call here fails)."""
        return rpc_error(list, self.stub.Execute(iter(messages), timeout=CALL_TIMEOUT_S))

    def wait_for_inputs(self, ready) -> InputStats:
        """Block until the servicer's input counters satisfy `ready` (they notify on each change)."""
        ledger = self.servicer.inputs
        with ledger.changed:
            assert ledger.changed.wait_for(lambda: ready(ledger.stats()), timeout=CALL_TIMEOUT_S), ledger.stats()
            return ledger.stats()


@pytest.fixture
def worker():
    artifacts = GatedArtifacts()
    agent = NodeAgent("127.0.0.1", jax_devices=jax.devices("cpu")[:1], nvml=FakeNvml([]),
                      proc_root=str(host.proc_root()), env={}, hostname="node-m")
    config = WorkerConfig(listen="127.0.0.1:0", held_tensors=HELD_TENSORS, max_inputs=MAX_INPUTS)
    server = build_worker(config, agent=agent, artifacts=artifacts).start()
    worker = Worker(server, artifacts)
    yield worker
    artifacts.release.set()
    worker.channel.close()
    server.stop(0)


def gib_header(name: str = "x") -> common_pb2.TensorHeader:
    return common_pb2.TensorHeader(name=name, dtype=common_pb2.DATA_TYPE_UINT8, shape=[GIB], total_bytes=GIB)


def tensor(name: str, nbytes: int) -> Iterator[pb.ExecuteRequest]:
    yield pb.ExecuteRequest(tensor=common_pb2.TensorHeader(name=name, dtype=common_pb2.DATA_TYPE_UINT8,
                                                           shape=[nbytes], total_bytes=nbytes))
    for offset in range(0, max(nbytes, 1), MIB):
        yield pb.ExecuteRequest(chunk=common_pb2.TensorChunk(name=name, offset=offset,
                                                             data=bytes(min(MIB, nbytes - offset))))


class Traced:
    """tracemalloc over the block, with the cycle collector off: what a call keeps then is what
    plain reference counting keeps, so a reference cycle would hold it and show."""

    def __enter__(self):
        gc.collect()
        gc.disable()
        tracemalloc.start()
        self.base = tracemalloc.get_traced_memory()[0]
        return self

    def held(self) -> int:
        return tracemalloc.get_traced_memory()[0] - self.base

    def peak(self) -> int:
        return tracemalloc.get_traced_memory()[1] - self.base

    def __exit__(self, *exc):
        tracemalloc.stop()
        gc.enable()


# -- a cancelled call gives back what it received ----------------------------------------------------

@pytest.mark.parametrize("ending, code, fragment", [
    ("cancel", grpc.StatusCode.CANCELLED, ""),
    # The caller ends its stream: the call fails, and the error gRPC keeps a while holds no input.
    ("end of stream", grpc.StatusCode.INVALID_ARGUMENT, f"stream ended after {RECEIVED_CHUNKS * MIB} of {GIB} bytes"),
])
def test_a_call_ending_mid_tensor_held_what_arrived_not_what_was_declared_and_frees_it_at_once(
        worker, ending, code, fragment):
    go_on = threading.Event()

    def requests():
        yield pb.ExecuteRequest(header=worker.header())
        yield pb.ExecuteRequest(tensor=gib_header())
        for index in range(RECEIVED_CHUNKS):
            yield pb.ExecuteRequest(chunk=common_pb2.TensorChunk(name="x", offset=index * MIB, data=bytes(MIB)))
        go_on.wait(CALL_TIMEOUT_S)  # the rest of the GiB never comes

    received = RECEIVED_CHUNKS * MIB
    with Traced() as traced:
        call = worker.stub.Execute(requests(), timeout=CALL_TIMEOUT_S)
        assert worker.wait_for_inputs(lambda s: s.bytes == received) == InputStats(calls=1, bytes=received)
        assert received <= traced.held() <= 2 * received, "the worker holds the bytes that arrived"
        assert traced.peak() < 4 * received, "a header's declared GiB was allocated"
        if ending == "cancel":
            call.cancel()
        else:
            go_on.set()
        assert worker.wait_for_inputs(lambda s: s.calls == 0) == InputStats(calls=0, bytes=0)
        left = traced.held()
    go_on.set()
    assert left < LEFT_BEHIND_BYTES, f"{left} bytes still held after the call ended ({ending})"
    error = rpc_error(list, call)
    assert error.code() == code and fragment in (error.details() or "")


def test_a_shard_cancelled_while_queued_frees_its_inputs_at_once(worker):
    """Shard A holds the device (its artifact fetch is held); B, with its inputs in full, queues
    behind it and is cancelled: B's inputs go as soon as B's call ends, while A still runs."""
    worker.artifacts.hold.set()
    first = worker.stub.Execute(iter([pb.ExecuteRequest(header=worker.header(input_count=0))]),
                                timeout=CALL_TIMEOUT_S)
    assert worker.artifacts.entered.wait(CALL_TIMEOUT_S)
    received = RECEIVED_CHUNKS * MIB
    with Traced() as traced:
        second = worker.stub.Execute(itertools.chain([pb.ExecuteRequest(header=worker.header(report_stages=True))],
                                                     tensor("x", received)), timeout=CALL_TIMEOUT_S)
        assert next(second).stage == pb.SHARD_STAGE_QUEUED
        assert worker.wait_for_inputs(lambda s: s.calls == 2) == InputStats(calls=2, bytes=received)
        assert traced.held() >= received
        second.cancel()
        assert worker.wait_for_inputs(lambda s: s.calls == 1) == InputStats(calls=1, bytes=0)
        left = traced.held()
    assert left < LEFT_BEHIND_BYTES, f"{left} bytes still held after the queued shard was cancelled"
    worker.artifacts.release.set()
    error = rpc_error(list, first)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "not served in this test" in error.details()
    assert worker.servicer.executor.executions == 0


# -- limits per call and on what is held for jobs ----------------------------------------------------

def test_keeping_more_tensors_than_the_worker_may_hold_is_refused_before_any_input_arrives(worker):
    refs = [pb.TensorRef(name=f"input_{i}", key=f"k{i}") for i in range(HELD_TENSORS + 1)]
    messages = [pb.ExecuteRequest(header=worker.header(input_count=len(refs), keep_tensors=refs))]
    for ref in refs:
        messages.extend(tensor(ref.name, 8))
    error = worker.call(messages)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"at most {HELD_TENSORS}" in error.details() and "ACCELMESH_WORKER_HELD_TENSORS" in error.details()
    assert worker.servicer.held.stats().tensors == 0 and worker.servicer.inputs.stats() == InputStats(0, 0)


def test_more_inputs_than_the_worker_takes_are_refused_naming_the_limit(worker):
    header = worker.header(input_count=MAX_INPUTS + 1)
    messages = [pb.ExecuteRequest(header=header)] + [m for i in range(MAX_INPUTS + 1) for m in tensor(f"e{i}", 0)]
    error = worker.call(messages)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"at most {MAX_INPUTS}" in error.details() and "ACCELMESH_WORKER_MAX_INPUTS" in error.details()


def test_a_key_longer_than_the_limit_is_refused_and_not_stored(worker):
    ref = pb.TensorRef(name="input_0", key="k" * 5000)
    messages = [pb.ExecuteRequest(header=worker.header(keep_tensors=[ref])), *tensor("input_0", 8)]
    error = worker.call(messages)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keep_tensors[0].key" in error.details() and "(5000 chars)" in error.details()
    assert worker.servicer.held.stats().tensors == 0


def test_the_held_tensor_count_is_bounded_over_all_jobs_least_recently_used_first(worker):
    for job in ("job-a", "job-b", "job-c"):
        worker.hold(job, "params", 8)
    stats = worker.servicer.held.stats()
    assert (stats.tensors, stats.jobs, stats.kept, stats.evicted) == (HELD_TENSORS, HELD_TENSORS, 3, 1)
    refer = [pb.ExecuteRequest(header=worker.header(job_id="job-a")),
             pb.ExecuteRequest(held=pb.TensorRef(name="input_0", key="params"))]
    error = worker.call(refer)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "ACCELMESH_WORKER_HELD_TENSORS" in error.details()


def test_release_job_drops_the_callers_tensors_of_that_job_only(worker):
    """The dispatcher's ReleaseJob at a job's end: that job's tensors go at once; another job's
    stay, and another dispatcher (its own holder scope) releases nothing of this one's."""
    for job in ("job-a", "job-b"):
        worker.hold(job, "params", 8)
    assert worker.servicer.held.stats().tensors == 2
    other = open_channel(f"127.0.0.1:{worker.server.port}",
                         security=CREDENTIALS.issue(Role.DISPATCH, "dispatch-2", ["127.0.0.1"]))
    try:
        stranger = worker_service_pb2_grpc.WorkerServiceStub(other)
        assert stranger.ReleaseJob(pb.ReleaseJobRequest(job_id="job-a"), timeout=CALL_TIMEOUT_S).released_tensors == 0
    finally:
        other.close()
    released = worker.stub.ReleaseJob(pb.ReleaseJobRequest(job_id="job-a"), timeout=CALL_TIMEOUT_S)
    assert (released.released_tensors, released.released_bytes) == (1, 8)
    stats = worker.servicer.held.stats()
    assert (stats.tensors, stats.jobs) == (1, 1)
    assert worker.stub.ReleaseJob(pb.ReleaseJobRequest(job_id="job-a"), timeout=CALL_TIMEOUT_S).released_tensors == 0
    error = rpc_error(worker.stub.ReleaseJob, pb.ReleaseJobRequest(job_id=""), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in error.details()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_jobs_entries_leave_with_its_last_tensor_and_when_it_goes_idle():
    clock = Clock()
    store = HeldTensors(10_000, idle_s=10, max_tensors=3, clock=clock)
    for job in ("a", "b"):
        for key in ("w", "b"):
            store.keep(job, key, np.zeros(0, np.uint8))  # empty: only the count bounds them
    # Four kept, three fit: a's least recently used went, and a is still known for its other one.
    assert (store.stats().tensors, store.stats().jobs, store.stats().evicted) == (3, 2, 1)
    assert store.get("a", "w") is None and store.get("a", "b") is not None
    clock.now += 10
    store.expire()
    stats = store.stats()
    assert (stats.tensors, stats.jobs, stats.bytes, stats.expired) == (0, 0, 0, 3)

