"""The dispatcher's side of a worker's stream, against in-process fake workers: a result cut
short fails the attempt and is never used, and a worker back on its address takes the next
shard at once. No mesh: these need only GrpcWorkers and a fake WorkerService."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import build_pb2 as build_pb
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import Placed, split
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.workers import GrpcWorkers
from dispatch_svc.ports import ArtifactRef, Build, JobDevice
from worker_svc.server import ACCESS as WORKER_ACCESS

from conftest import CREDENTIALS
from fakes.worker_streams import shards

pytestmark = pytest.mark.slow


CLEAN_END = "clean end"
STRAY = "stray chunk"  # a chunk of a tensor the answer never declared: a malformed answer


class FakeWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Answers every shard with a two-chunk output. `cut` ends the call after the first chunk: with
    that status, or with CLEAN_END as a normal end (timings sent, half the tensor never); STRAY
    adds a chunk of a tensor it sent no header for."""

    def __init__(self, cut: grpc.StatusCode | str | None = None):
        self.cut = cut
        self.released: list[str] = []  # job ids of ReleaseJob calls

    def ReleaseJob(self, request, context):
        self.released.append(request.job_id)
        return worker_pb.ReleaseJobResponse()

    def Execute(self, request_iterator, context):
        for _ in request_iterator:
            pass
        yield from self._answer(context, worker_pb.ExecuteResponse)

    def ExecuteMany(self, request_iterator, context):
        for _ in shards(request_iterator):
            yield from self._answer(context, worker_pb.ExecuteManyResponse)

    def _answer(self, context, into):
        header, chunks = split("output_0", np.arange(2048, dtype=np.float32), 4096)
        chunks = list(chunks)
        yield into(tensor=header)
        for chunk in chunks:
            yield into(chunk=chunk)
            if isinstance(self.cut, grpc.StatusCode):
                context.abort(self.cut, "worker went away")
            if self.cut == CLEAN_END:
                break
        if self.cut == STRAY:
            stray = common_pb2.TensorChunk()
            stray.CopyFrom(chunks[-1])
            stray.name = "output_9"
            yield into(chunk=stray)
        yield into(timings=worker_pb.ShardTimings(execute_seconds=0.001))


def serve_fake(worker: FakeWorker, port: int = 0):
    return create_server([Service("accelmesh.worker.v1.WorkerService",
                                  worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, worker)],
                         security=CREDENTIALS.service(Role.WORKER), access=WORKER_ACCESS,
                         address=f"127.0.0.1:{port}").start()


def send_shard(mesh: GrpcWorkers, port: int, x: np.ndarray | None = None, held_keys=None, device_id="127.0.0.1/cuda:0",
               shard_index: int = 0, place=None):
    device = JobDevice(type("Spec", (), {"id": device_id})(), f"127.0.0.1:{port}", "t")
    artifact = ArtifactRef("k", "d", "stablehlo", 2048)
    build = Build("t", "rule", "float32", build_pb.Rule(), (device.id,), artifact, {})
    x = np.zeros(2048, np.float32) if x is None else x
    return mesh.execute("job", shard_index, 1, device, build, artifact, [("x", x)], 2048, CancelScope(), held_keys,
                        place_outputs=place)


@pytest.fixture
def workers():
    mesh = GrpcWorkers(CREDENTIALS.service(Role.DISPATCH), max_message_bytes=1 << 22, chunk_bytes=4096)
    yield mesh
    mesh.close()


CUTS = [(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE: "), (grpc.StatusCode.CANCELLED, "CANCELLED: "),
        (grpc.StatusCode.INTERNAL, "INTERNAL: "), (CLEAN_END, "worker sent a malformed result: ")]


@pytest.mark.parametrize("cut, cause", [*CUTS, (STRAY, "worker sent a malformed result: ")],
                         ids=["unavailable", "cancelled", "internal", "clean-end", "stray-chunk"])
def test_a_result_cut_short_fails_the_attempt_and_is_never_used(workers, cut, cause):
    server = serve_fake(FakeWorker(cut))  # the error interceptor keeps the status it aborted with
    try:
        with pytest.raises(ShardFailed) as info:  # the pool retries a ShardFailed on another device
            send_shard(workers, server.port)
        assert info.value.cause.startswith(cause), info.value.cause
    finally:
        server.stop(0)


class Rows:
    """A PlaceTensor over one buffer, as JobOutputs.placer is over a result file's rows."""

    def __init__(self, nbytes: int):
        self.data, self.writes = bytearray(nbytes), 0

    def __call__(self, index, dtype, shape):
        def write(offset, data):
            self.data[offset:offset + len(data)] = data
            self.writes += 1
        return write if (index, dtype, shape) == (0, np.dtype("<f4"), (2048,)) else None


def test_outputs_a_shard_places_are_written_as_their_chunks_arrive(workers):
    server = serve_fake(FakeWorker())
    rows = Rows(2048 * 4)
    try:
        out = send_shard(workers, server.port, place=rows)
    finally:
        server.stop(0)
    assert out.outputs == [Placed("output_0", np.dtype("<f4"), (2048,))]
    assert bytes(rows.data) == np.arange(2048, dtype=np.float32).tobytes() and rows.writes == 2


@pytest.mark.parametrize("cut, cause", CUTS, ids=["unavailable", "cancelled", "internal", "clean-end"])
def test_a_placed_result_cut_short_fails_the_attempt_after_its_first_chunk(workers, cut, cause):
    server = serve_fake(FakeWorker(cut))
    rows = Rows(2048 * 4)
    try:
        with pytest.raises(ShardFailed) as info:  # its rows are not taken: the shard's next attempt writes them
            send_shard(workers, server.port, place=rows)
        assert info.value.cause.startswith(cause), info.value.cause
    finally:
        server.stop(0)
    assert rows.writes == 1


def test_a_failed_worker_call_keeps_no_reference_to_the_shard_inputs(workers):
    """grpcio's call object is the error it raises, so its traceback held the dispatcher's frame
    holding the call and the request stream over the shard's inputs: a cycle that kept a failed
    job's inputs until a full garbage collection. With the collector off, they go at once."""
    server = serve_fake(FakeWorker(grpc.StatusCode.UNAVAILABLE))
    x = np.zeros(2048, np.float32)
    inputs = weakref.ref(x)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(ShardFailed):
            send_shard(workers, server.port, x)
        del x
        assert inputs() is None, "the failed call still holds the shard's inputs"
    finally:
        gc.enable()
        server.stop(0)


def test_a_job_ending_tells_the_workers_that_keep_its_tensors_to_let_them_go(workers):
    """A shard sent with a tensor to keep: when the job ends, that worker gets ReleaseJob for it
    (its tensors leave now, not at its idle expiry); a worker that kept nothing gets no call."""
    keeper, other = FakeWorker(), FakeWorker()
    servers = [serve_fake(keeper), serve_fake(other)]
    try:
        send_shard(workers, servers[0].port, held_keys={"x": "params"})
        send_shard(workers, servers[1].port)
        assert workers.held.workers_of("job") == {f"127.0.0.1:{servers[0].port}"}
        with contextlib.suppress(errors.AccelmeshError):  # no inventory here: its release fails after
            workers.release("job")
        assert (keeper.released, other.released) == (["job"], [])
        assert workers.held.workers_of("job") == set()
    finally:
        for server in servers:
            server.stop(0)


def test_a_worker_back_on_its_address_takes_the_next_shard_at_once(workers):
    server = serve_fake(FakeWorker())
    port = server.port
    np.testing.assert_array_equal(send_shard(workers, port).outputs[0], np.arange(2048, dtype=np.float32))
    server.stop(0)
    for _ in range(3):  # the dispatcher keeps trying while the worker is down: its channel backs off
        with pytest.raises(ShardFailed):
            send_shard(workers, port)
    server = serve_fake(FakeWorker(), port)
    try:
        np.testing.assert_array_equal(send_shard(workers, port).outputs[0], np.arange(2048, dtype=np.float32))
    finally:
        server.stop(0)


class MeetingWorker(FakeWorker):
    """Answers a shard only once a shard of another call has arrived too (or says it never did)."""

    def __init__(self):
        super().__init__()
        self.met = threading.Barrier(2)

    def ExecuteMany(self, request_iterator, context):
        for _ in shards(request_iterator):
            try:
                self.met.wait(timeout=10)
            except threading.BrokenBarrierError:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no other shard arrived")
            yield from self._answer(context, worker_pb.ExecuteManyResponse)


def test_shards_for_two_devices_of_one_worker_run_at_the_same_time(workers):
    """One stream a device, not a worker: a worker runs a stream's shards one after another, so a
    node's devices would otherwise take turns."""
    server = serve_fake(MeetingWorker())
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(send_shard, workers, server.port, device_id=f"127.0.0.1/cuda:{i}") for i in range(2)]
            for run in runs:
                np.testing.assert_array_equal(run.result().outputs[0], np.arange(2048, dtype=np.float32))
    finally:
        server.stop(0)


class RefusingWorker(FakeWorker):
    """Ends a stream on the inputs of shard 0 (a shard's status), after shard 1 came behind it on the
    same stream; answers shard 1 when it comes first on a stream."""

    def __init__(self):
        super().__init__()
        self.received = threading.Event()  # shard 0 has arrived
        self.streams = 0

    def ExecuteMany(self, request_iterator, context):
        self.streams += 1
        for header, _ in shards(request_iterator):
            if header.shard_index == 0:
                self.received.set()
                next(shards(request_iterator))  # shard 1, sent behind it
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "input 0 of shard 0 does not fit")
            yield from self._answer(context, worker_pb.ExecuteManyResponse)


def test_a_shard_behind_one_whose_inputs_end_the_stream_is_sent_again_not_failed(workers):
    worker = RefusingWorker()
    server = serve_fake(worker)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(send_shard, workers, server.port, shard_index=0)
            assert worker.received.wait(10)
            second = pool.submit(send_shard, workers, server.port, shard_index=1)
            with pytest.raises(ShardFailed) as info:
                first.result()
            assert info.value.code == "FAILED_PRECONDITION" and "does not fit" in info.value.cause
            np.testing.assert_array_equal(second.result().outputs[0], np.arange(2048, dtype=np.float32))
        assert worker.streams == 2  # shard 1 went again, on a stream of its own
    finally:
        server.stop(0)
