"""A job stopped while it plans stops its planning calls: the compile service's build for it is
cancelled in flight (clients/calls.py under the job's scope), and the job ends then, not once the
build is done. The runner over the fake mesh, its compiler the real gRPC client of an in-process
compile service (port 0, security on) whose Compile blocks until the test lets it go."""

from __future__ import annotations

import threading

from accelmesh import errors
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.runtime.programs import program_to_proto
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.identity import Role
from compile_svc.server import ACCESS, SERVICE_NAME
from dispatch_svc.clients.compiler import GrpcCompiler
from dispatch_svc.jobs import records as m

from conftest import CREDENTIALS
from fakes.ports import AFFINE, WAIT_S, FakeMesh, Feed, X, runner_for, spec_for


class BlockingCompileService(compile_service_pb2_grpc.CompileServiceServicer):
    """Describes AFFINE; a Compile call waits for `release` (it never builds), and `ended` says its
    call ended, which before `release` only its client's cancel can do."""

    def __init__(self):
        self.compiling, self.ended, self.release = threading.Event(), threading.Event(), threading.Event()

    def DescribeProgram(self, request, context):
        return compile_pb.DescribeProgramResponse(program=program_to_proto(AFFINE))

    def Compile(self, request, context):
        context.add_callback(self.ended.set)
        self.compiling.set()
        self.release.wait(WAIT_S * 2)  # past the test's own waits: the test fails first, saying why
        return compile_pb.CompileResponse()


def test_a_job_stopped_while_the_compile_service_builds_for_it_cancels_the_build_and_ends_then(tmp_path):
    service = BlockingCompileService()
    server = create_server([Service(SERVICE_NAME, compile_service_pb2_grpc.add_CompileServiceServicer_to_server,
                                    service)], security=CREDENTIALS.service(Role.COMPILE), access=ACCESS)
    server.start()
    compiler = GrpcCompiler(f"127.0.0.1:{server.port}", CREDENTIALS.service(Role.DISPATCH),
                            max_message_bytes=16 << 20)
    mesh = FakeMesh(AFFINE)
    mesh.compiler = compiler
    runner = runner_for(mesh, tmp_path)
    job, live = runner.start(spec_for(AFFINE, [X[:64]]))
    raised: list[BaseException] = []

    def run():
        try:
            runner.run(job, live, Feed([X[:64]]), background=False)
        except BaseException as exc:  # noqa: BLE001 - what the test asserts
            raised.append(exc)
    thread = threading.Thread(target=run, name="planning-job")
    thread.start()
    try:
        assert service.compiling.wait(WAIT_S)
        live.scope.cancel("stopped by the test")
        assert service.ended.wait(WAIT_S), "the compile call went on after its job was stopped"
        assert live.done.wait(WAIT_S), "the job did not end while its build was still under way"
        assert not service.release.is_set()
    finally:
        service.release.set()
        thread.join(WAIT_S)
        compiler.close()
        server.stop(0)
    assert len(raised) == 1 and isinstance(raised[0], errors.Cancelled), raised
    job = runner.book.get(job.job_id)
    assert (job.state, job.error, job.plan) == (m.CANCELLED, "stopped by the test", None)
    assert mesh.inventory.reserved == {}
    runner.book.close()
