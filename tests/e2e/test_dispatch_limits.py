"""The dispatcher's limits on a real mesh on loopback: a job declaring 2**34 rows is refused at
once and never recorded, a 100 kB job id gets a short INVALID_ARGUMENT, a block that cannot fit
is refused before any device is reserved, a client gone mid-stream leaves its job CANCELLED
saying how much arrived, and listing and reading jobs keep working throughout."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.runtime.tensors import dtype_code, to_proto

from conftest import reservations, rpc_error

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 60
SHORT_MESSAGE = 400  # a refusal quoting client input stays this short, whatever the input's size


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=2, emulate=("v100-32gb", "t4")) as running:
        yield running


@pytest.fixture
def client(mesh):
    with MeshClient(mesh.dispatch.address) as c:
        yield c


def declared(rows: int, name: str) -> job_pb.JobSpec:
    """An mlp_classifier spec declaring `rows` rows of 64 float32, without making them."""
    spec = job_spec("mlp_classifier", {}, name=name)
    spec.inputs.append(common_pb2.TensorHeader(name="x", dtype=dtype_code(np.dtype(np.float32)), shape=[rows, 64],
                                               total_bytes=rows * 256))
    return spec


def names(client: MeshClient) -> list[str]:
    return [j.spec.name for j in client.stub.ListJobs(pb.ListJobsRequest(page_size=100), timeout=CALL_TIMEOUT_S).jobs]


def test_a_spec_only_job_of_2_34_rows_is_refused_and_jobs_still_list(client):
    x = np.zeros((8, 64), np.float32)
    kept = client.submit("mlp_classifier", {"x": x}, name="before-huge")
    error = rpc_error(client.stub.SubmitJob, iter([pb.SubmitJobRequest(spec=declared(2**34, "huge"))]),
                      timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ACCELMESH_MAX_JOB_ROWS" in error.details() and "17,179,869,184" in error.details()
    plan_error = rpc_error(client.stub.PlanJob, pb.PlanJobRequest(spec=declared(2**34, "huge")), timeout=CALL_TIMEOUT_S)
    assert plan_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (newest,) = client.stub.ListJobs(pb.ListJobsRequest(page_size=1), timeout=CALL_TIMEOUT_S).jobs
    assert newest.job_id == kept and "huge" not in names(client)
    assert list(client.watch(kept))[-1].type == job_pb.JOB_EVENT_TYPE_SUCCEEDED
    assert client.get(kept).state == job_pb.JOB_STATE_SUCCEEDED


def test_a_100_kb_job_id_is_invalid_with_a_short_message(client):
    for call in (lambda job_id: client.stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S),
                 lambda job_id: list(client.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S))):
        error = rpc_error(call, "j" * 100_000)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "ACCELMESH_MAX_NAME_CHARS" in error.details() and len(error.details()) < SHORT_MESSAGE


def test_a_block_that_cannot_fit_is_refused_before_any_reservation(client, mesh):
    x = np.zeros((16, 64), np.float32)
    parts = [pb.SubmitJobRequest(spec=job_spec("mlp_classifier", {"x": x}, name="bad-block")),
             pb.SubmitJobRequest(block=pb.InputBlock(first_row=0, tensors=[to_proto(x[:, :63].copy())]))]
    error = rpc_error(client.stub.SubmitJob, iter(parts), timeout=CALL_TIMEOUT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "float32[16, 63]" in error.details()
    assert "bad-block" not in names(client) and reservations(mesh) == []


def test_a_client_gone_mid_stream_leaves_its_job_cancelled_saying_how_much_arrived(client, mesh):
    x = np.zeros((512, 64), np.float32)  # 128 KiB in two blocks of 64 KiB
    parts = list(request_parts(job_spec("mlp_classifier", {"x": x}, name="gone-mid-input"), {"x": x}, None, 64 * 1024))
    gate = threading.Event()

    def stalled():
        yield from (pb.RunJobRequest(**{field: message}) for field, message in parts[:2])  # the spec, one block
        gate.wait(CALL_TIMEOUT_S)

    call = client.stub.RunJob(stalled(), timeout=CALL_TIMEOUT_S)
    try:
        for response in call:  # planned and compiled: the dispatcher now waits for the second block
            if response.WhichOneof("part") == "event" and response.event.type == job_pb.JOB_EVENT_TYPE_COMPILED:
                break
        call.cancel()
    finally:
        gate.set()
    job_id = next(j.job_id for j in client.stub.ListJobs(pb.ListJobsRequest(), timeout=CALL_TIMEOUT_S).jobs
                  if j.spec.name == "gone-mid-input")
    assert list(client.watch(job_id))[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    job = client.get(job_id)
    assert job.state == job_pb.JOB_STATE_CANCELLED
    assert job.error == f"the client disconnected while sending input (65,536 of {x.nbytes:,} bytes received)"
    assert reservations(mesh) == []
