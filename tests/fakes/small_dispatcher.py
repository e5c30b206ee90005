"""What tests/dispatch/api/test_limits.py and test_job_footprint.py share: a dispatcher with small
limits served on port 0 over a fake mesh that records every call that plans, compiles, reserves
or fetches for a job, and the calls that stream a job's request parts to it."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.runtime.admission import Admission
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import Authenticator
from accelmesh.security.identity import Role
from dispatch_svc.api.servicer import DEFAULT_STREAM_IDLE_S, DispatchServicer
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import JobLimits, Limits
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.server import ACCESS, SERVICE_NAME, dependencies

from conftest import CREDENTIALS
from fakes.ports import AFFINE, WAIT_S, FakeCompiler, FakeInventory, FakeMesh

LIMITS = JobLimits(max_rows=1000, max_bytes=64 * 1024, max_shards=8, max_training_bytes=4096, max_training_steps=50,
                   max_layers=4, max_spec_entries=4, max_parameter_tensors=2, max_name_chars=40, max_filter_chars=100)
MAX_SHARD_BYTES = 1024  # 64 rows of AFFINE's 4 float32 a shard: 1000 rows need 16


class RecordingInventory(FakeInventory):
    """Notes the calls that look for devices or reserve them in `calls` (shared with the compiler)."""

    calls: list[str]

    def __init__(self, devices):
        super().__init__(devices)
        self.reserving = threading.Event()

    def candidate_devices(self, constraints):
        self.calls.append("candidate_devices")
        return super().candidate_devices(constraints)

    def reserve(self, job_id, claims, ttl_s):
        self.calls.append("reserve")
        super().reserve(job_id, claims, ttl_s)
        self.reserving.set()


class RecordingCompiler(FakeCompiler):
    """Notes the calls that describe or build a program in `calls`."""

    calls: list[str]

    def describe_program(self, name, version):
        self.calls.append("describe_program")
        return super().describe_program(name, version)

    def compile(self, program, devices, batch_sizes, precision=""):
        self.calls.append("compile")
        return super().compile(program, devices, batch_sizes, precision)


class RecordingMesh(FakeMesh):
    """The fake mesh, noting every call that plans, compiles, reserves or fetches for a job, in order."""

    def __init__(self):
        super().__init__(AFFINE, inventory=RecordingInventory, compiler=RecordingCompiler)
        self.calls: list[str] = []
        self.inventory.calls = self.compiler.calls = self.calls
        self.reserving = self.inventory.reserving


class Dispatcher:
    """`admission`: the server's stream limits (default: the environment's); `gate`: the runner's
    admission gate, made from the job book (default: none, a job that finds no devices fails)."""

    def __init__(self, tmp_path, limits=LIMITS, max_message_bytes=16 << 20, max_parameter_bytes=1 << 20,
                 database_url="", readiness_interval_s=None, admission: Admission | None = None,
                 stream_idle_s: float = DEFAULT_STREAM_IDLE_S, mesh: RecordingMesh | None = None, gate=None):
        self.mesh = mesh or RecordingMesh()
        book = JobBook(tmp_path, retention_s=3600, database_url=database_url)
        self.runner = JobRunner(self.mesh.inventory, self.mesh.compiler, self.mesh.workers, book, ThroughputModel(),
                                limits=Limits(MAX_SHARD_BYTES, 1 << 20), job_limits=limits,
                                gate=gate(book) if gate is not None else None)
        security = CREDENTIALS.service(Role.DISPATCH)
        servicer = DispatchServicer(self.runner, Authenticator(security), chunk_bytes=1 << 16,
                                    max_parameter_bytes=max_parameter_bytes, max_message_bytes=max_message_bytes,
                                    stream_idle_s=stream_idle_s)
        service = Service(SERVICE_NAME, dispatch_service_pb2_grpc.add_DispatchServiceServicer_to_server, servicer)
        self.server = create_server([service], security=security, access=ACCESS,
                                    max_message_bytes=max_message_bytes, admission=admission)
        if readiness_interval_s is not None:  # what build_dispatch watches, looked at this often
            self.server.watch_dependencies(dependencies(self.runner.book), readiness_interval_s)
        self.server.start()
        self._max_message_bytes = max_message_bytes
        self._channels = []
        self.channel = self._open(CREDENTIALS.client())
        self.stub = dispatch_service_pb2_grpc.DispatchServiceStub(self.channel)

    def _open(self, security):
        channel = open_channel(f"127.0.0.1:{self.server.port}", security=security,
                               max_message_bytes=self._max_message_bytes)
        self._channels.append(channel)
        return channel

    def stub_as(self, user: str):
        """A stub calling as the user `user` (a token of its own: a principal apart from the operator's)."""
        return dispatch_service_pb2_grpc.DispatchServiceStub(self._open(CREDENTIALS.client(CREDENTIALS.add_user(user))))

    def close(self):
        for channel in self._channels:
            channel.close()
        self.server.stop(0)
        self.runner.wait_idle(WAIT_S)  # a job still ending writes to the book
        self.runner.book.close()


@contextmanager
def serving(tmp_path, **kwargs):
    dispatcher = Dispatcher(tmp_path, **kwargs)
    try:
        yield dispatcher
    finally:
        dispatcher.close()


def requests(parts, kind=pb.SubmitJobRequest):
    return (kind(**{field: message}) for field, message in parts)


def submit(stub, parts):
    return stub.SubmitJob(requests(parts), timeout=WAIT_S)


def run_job(stub, parts):
    return list(stub.RunJob(requests(parts, pb.RunJobRequest), timeout=WAIT_S))
