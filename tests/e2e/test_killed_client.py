"""A RunJob client killed with SIGKILL mid-upload: its job ends CANCELLED saying the client went
away, never FAILED for input that ended short (gRPC may end the request stream before it marks
the call cancelled). A subprocess client against an in-process dispatcher over the fake mesh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from accelmesh.security.identity import Role
from dispatch_svc.jobs import records as m

from conftest import CREDENTIALS
from fakes.ports import WAIT_S
from fakes.small_dispatcher import serving

pytestmark = pytest.mark.slow

CLIENT = r'''
import sys, time, numpy as np
from accelmesh.client import job_spec
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb, dispatch_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.tensors import to_proto
x = np.zeros((512, 4), np.float32)
stub = dispatch_service_pb2_grpc.DispatchServiceStub(open_channel(sys.argv[1]))
def parts():
    yield pb.RunJobRequest(spec=job_spec("affine", {"x": x}))
    print("sending", flush=True)
    for i in range(0, 512, 16):
        yield pb.RunJobRequest(block=pb.InputBlock(first_row=i, tensors=[to_proto(x[i:i + 16])]))
        time.sleep(0.02)
for response in stub.RunJob(parts(), timeout=600):
    pass
'''


@pytest.mark.parametrize("trial", range(4))
def test_a_sigkilled_run_job_client_leaves_its_job_cancelled_not_failed(tmp_path, trial):
    with serving(tmp_path) as dispatcher:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{dispatcher.server.port}"],
                                  env={**os.environ, **CREDENTIALS.env(Role.CLIENT)}, stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().strip() == "sending"
            assert dispatcher.mesh.reserving.wait(WAIT_S)  # planned and reserved: its blocks are being read
            shards_ran = threading.Event()
            original = dispatcher.mesh.workers.execute

            def execute(*args, **kwargs):
                shards_ran.set()  # the job is taking its blocks and running shards
                return original(*args, **kwargs)
            dispatcher.mesh.workers.execute = execute
            assert shards_ran.wait(WAIT_S)
        finally:
            client.send_signal(signal.SIGKILL)
            client.wait(WAIT_S)
        assert dispatcher.runner.wait_idle(WAIT_S)
        (job,) = dispatcher.runner.book.list(1)
        assert job.state == m.CANCELLED, job.error
        assert "client disconnected" in job.error
