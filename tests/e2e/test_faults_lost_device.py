"""A device lost while its shard is in flight: the dispatcher stops that shard's stream as soon as
the inventory calls the device lost and retries the shard elsewhere, without waiting for the
worker or the transport; and a link that goes silent (no reset, no error) is given up on by
HTTP/2 keepalive within the configured time. Against in-process fake workers (one that stops
answering, without closing its connection), the runner over the real GrpcWorkers, no mesh."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest

from accelmesh.hardware.catalog import resolve_type
from accelmesh.runtime.config import MIN_PING_INTERVAL_S, channel_options
from accelmesh.runtime.server import Service, create_server
from accelmesh.runtime.tensors import TensorCollector, split
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.workers import GrpcWorkers
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.ports import JobDevice
from worker_svc.server import ACCESS as WORKER_ACCESS

from conftest import CREDENTIALS
from fakes.ports import AFFINE, BIAS, WAIT_S, FakeCompiler, FakeInventory, Feed, X, result, spec_for
from fakes.worker_streams import shards

pytestmark = pytest.mark.slow


class AffineWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Runs AFFINE with numpy, keeping the tensors a shard asks it to keep; notes in `order` each
    shard it receives. `freeze` set: it reads a shard and then stops answering (its call stays
    open, as behind a cut link) until `thaw` is set, noting `cancelled` when the call ends."""

    def __init__(self, order: list, name: str, freeze: bool = False):
        self.order, self.name, self.freeze = order, name, freeze
        self.received, self.cancelled, self.thaw = threading.Event(), threading.Event(), threading.Event()
        self._kept: dict[str, np.ndarray] = {}

    def ReleaseJob(self, request, context):
        return worker_pb.ReleaseJobResponse()

    def ExecuteMany(self, request_iterator, context):
        context.add_callback(self.cancelled.set)
        for header, messages in shards(request_iterator):
            self.order.append((self.name, header.shard_index, header.attempt))
            if self.freeze:
                self.received.set()
                self.thaw.wait(WAIT_S)
                return
            inputs = self._inputs(header, messages)
            for index, value in enumerate([2 * inputs["x"] + inputs["b"], inputs["x"].sum(axis=0)]):
                tensor, chunks = split(f"output_{index}", value, 4096)
                yield worker_pb.ExecuteManyResponse(tensor=tensor)
                yield from (worker_pb.ExecuteManyResponse(chunk=chunk) for chunk in chunks)
            yield worker_pb.ExecuteManyResponse(timings=worker_pb.ShardTimings(execute_seconds=0.001))

    def _inputs(self, header, messages) -> dict[str, np.ndarray]:
        collector, held = TensorCollector("input"), {}
        for message in messages:
            part = message.WhichOneof("part")
            if part == "held":
                held[message.held.name] = self._kept[message.held.key]
            elif part == "tensor":
                collector.header(message.tensor)
            else:
                collector.chunk(message.chunk)
        inputs = {**collector.results(), **held}
        self._kept.update({ref.key: inputs[ref.name] for ref in header.keep_tensors})
        return inputs


def serve(worker):
    return create_server([Service("accelmesh.worker.v1.WorkerService",
                                  worker_service_pb2_grpc.add_WorkerServiceServicer_to_server, worker)],
                         security=CREDENTIALS.service(Role.WORKER), access=WORKER_ACCESS,
                         address="127.0.0.1:0").start()


class TellingInventory(FakeInventory):
    """Notes in `order` the first answer of lost_devices that names a lost device."""

    order: list

    def lost_devices(self, device_ids):
        lost = super().lost_devices(device_ids)
        if lost and "lost reported" not in self.order:
            self.order.append("lost reported")
        return lost


def retry_events(runner: JobRunner, job_id: str) -> list[str]:
    so_far = object()
    messages = []
    for event in runner.book.events(job_id, 0, idle=so_far):
        if event is so_far:
            return messages
        if event.type == m.SHARD_RETRIED:
            messages.append(event.message)
    return messages


def test_a_device_the_inventory_calls_lost_leaves_its_stream_at_once_and_its_shard_runs_elsewhere(tmp_path):
    """A shard in flight on a device whose node went silent is retried as soon as the inventory
    says the device is lost, not once the worker or the transport gives up."""
    order: list = []
    frozen, healthy = AffineWorker(order, "frozen", freeze=True), AffineWorker(order, "healthy")
    servers = [serve(frozen), serve(healthy)]
    kind = resolve_type("v100-32gb")
    devices = [JobDevice(kind.device_spec("127.0.0.1", i), f"127.0.0.1:{server.port}")
               for i, server in enumerate(servers)]
    inventory = TellingInventory(devices)
    inventory.order = order
    workers = GrpcWorkers(CREDENTIALS.service(Role.DISPATCH), max_message_bytes=1 << 22, chunk_bytes=4096)
    runner = JobRunner(inventory, FakeCompiler(AFFINE), workers, JobBook(tmp_path, retention_s=3600),
                       ThroughputModel(), limits=Limits(1024, 1 << 20, device_watch_s=0.05))
    job, live = runner.start(spec_for(AFFINE, [X]))
    running = threading.Thread(target=runner.run, args=(job, live, Feed([X])), kwargs={"background": False})
    try:
        running.start()
        assert frozen.received.wait(WAIT_S), "no shard reached the frozen worker"
        inventory.lost.add(devices[0].id)
        running.join(WAIT_S)
        assert not running.is_alive(), "the job still waits for the frozen worker"
        assert not frozen.thaw.is_set()  # the job ended while the frozen shard was still held
        record = runner.book.get(job.job_id)
        assert record.state == m.SUCCEEDED, record.error
        np.testing.assert_allclose(result(runner, record, "y"), 2 * X + BIAS, rtol=1e-6)
        np.testing.assert_allclose(result(runner, record, "s"), X.sum(axis=0), rtol=1e-5)
        assert frozen.cancelled.wait(WAIT_S)  # its stream was cancelled, not left open
        frozen_shard = next(index for name, index, _ in order[:order.index("lost reported")] if name == "frozen")
        retry = ("healthy", frozen_shard, 2)
        assert retry in order and order.index("lost reported") < order.index(retry), order
        assert any(f"shard {frozen_shard} retried" in message and "was lost" in message
                   for message in retry_events(runner, job.job_id)), retry_events(runner, job.job_id)
    finally:
        frozen.thaw.set()
        running.join(WAIT_S)
        workers.close()
        for server in servers:
            server.stop(0)
        runner.book.close()


class Relay:
    """A TCP relay to `target` that can be frozen: it stops forwarding bytes either way but keeps
    both sockets open, as a cut link does (no reset, no error, just silence)."""

    def __init__(self, target: tuple[str, int]):
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.frozen = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket):
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.frozen.is_set():
                continue  # read and dropped: the kernel keeps acknowledging, nothing reaches the peer
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self):
        self._listener.close()
        for sock in self._sockets:
            sock.close()


def test_channel_options_take_the_keepalive_times_from_the_environment_and_accept_pings_that_often(monkeypatch):
    monkeypatch.setenv("ACCELMESH_KEEPALIVE_TIME_S", "1.5")
    monkeypatch.setenv("ACCELMESH_KEEPALIVE_TIMEOUT_S", "0.5")
    options = dict(channel_options(1 << 20))
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (1500, 500)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 1500
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_S * 1000


def test_a_silent_link_to_a_worker_fails_its_shard_by_keepalive_without_any_inventory(monkeypatch):
    """A cut link with no reset: the worker's stream is given up on within keepalive time +
    timeout, so the shard can be retried elsewhere even when no inventory says the node is lost."""
    monkeypatch.setenv("ACCELMESH_KEEPALIVE_TIME_S", "1")
    monkeypatch.setenv("ACCELMESH_KEEPALIVE_TIMEOUT_S", "1")
    worker = AffineWorker([], "worker")
    server = serve(worker)
    relay = Relay(("127.0.0.1", server.port))
    workers = GrpcWorkers(CREDENTIALS.service(Role.DISPATCH), max_message_bytes=1 << 22, chunk_bytes=4096)
    device = JobDevice(resolve_type("v100-32gb").device_spec("127.0.0.1", 0), f"127.0.0.1:{relay.port}")
    build = FakeCompiler(AFFINE).compile(AFFINE, [device], ())[0]
    x = X[:16]

    def send():
        return workers.execute("job", 0, 1, device, build, build.portable, [("b", BIAS), ("x", x)], 16,
                               CancelScope())
    outcome: dict = {}

    def frozen_send():
        try:
            outcome["out"] = send()
        except ShardFailed as exc:
            outcome["error"] = exc
    try:
        np.testing.assert_allclose(send().outputs[0], 2 * x + BIAS)  # the link works
        relay.frozen.set()
        sending = threading.Thread(target=frozen_send, daemon=True)
        sending.start()
        # Keepalive gives up after about 2 s; the bound only stops a hang (the old 10 s + 5 s fixed
        # keepalive would pass it).
        sending.join(12)
        assert not sending.is_alive(), "the shard still waits on the silent link"
        assert "error" in outcome and outcome["error"].code == grpc.StatusCode.UNAVAILABLE.name, outcome
    finally:
        relay.frozen.clear()
        workers.close()
        relay.close()
        server.stop(0)
