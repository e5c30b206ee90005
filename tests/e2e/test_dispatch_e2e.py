"""Jobs through the whole mesh as real processes on loopback: inference and training across
mixed devices, every shard attributed, results equal to a single-device run, bad input refused
without leaving a reservation behind."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient, job_spec, request_parts
from accelmesh.datasets import load_digits, train_test_split
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.tensors import to_proto
from compile_svc.programs import default_registry

from conftest import peak_rss_bytes, reservations, rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

# Two bf16 devices of one type, and two fp32 devices of different speeds (uneven shards).
EMULATE = ("a100-80gb", "a100-80gb", "v100-32gb", "t4")
DEVICE_ID = re.compile(r"^\d+\.\d+\.\d+\.\d+/(cuda|cpu|rocm|tpu):\d+$")
FP32_ONLY = 'type != "a100-80gb"'  # the V100 and the T4


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=4, emulate=EMULATE) as running:
        yield running


@pytest.fixture
def client(mesh):
    with MeshClient(mesh.dispatch.address) as c:
        yield c



def reference(program_name, *inputs, seed=0):
    program = default_registry().get(program_name)
    return [np.asarray(o) for o in program.fn(*program.init_params(seed), *inputs)]


def test_inference_across_mixed_devices_matches_one_device(client, mesh):
    tokens = np.random.default_rng(1).integers(0, 512, size=(300, 32), dtype=np.int32)
    result = client.run("transformer_encoder", {"tokens": tokens})
    assert result.job.state == job_pb.JOB_STATE_SUCCEEDED
    (expected,) = reference("transformer_encoder", tokens)
    logits = result.outputs["logits"]
    assert logits.shape == (300, 16)
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 5e-2  # the bf16 rule's tolerance

    shards = result.job.shards
    assert all(DEVICE_ID.match(s.device_id) and s.done for s in shards)
    assert sum(s.rows for s in shards) == 300
    plan = result.job.plan
    a100 = [t for t in plan.targets if "a100-80gb" in t.target_type]
    assert len(a100) == 1 and len(a100[0].device_ids) == 2  # two devices of one type: one artifact
    assert {s.device_id for s in shards if "a100" in s.target_type} == set(a100[0].device_ids)
    # The A100s' bf16 build serves them; a device with under 1/16 of the pool's rate gets no unit of
    # a job that fits one shard (planner/buckets.py), and every device that got rows has its build.
    assert "cuda-bf16" in {t.rule for t in plan.targets}
    assert {s.device_id for s in shards} <= {d for t in plan.targets for d in t.device_ids}
    types = [e.type for e in result.events]
    assert types[0] == job_pb.JOB_EVENT_TYPE_PLANNED and types[-1] == job_pb.JOB_EVENT_TYPE_SUCCEEDED
    assert types.count(job_pb.JOB_EVENT_TYPE_SHARD_FINISHED) == len(shards)
    assert {e.job_id for e in result.events} == {result.job.job_id}  # RunJob's events name their job
    assert {e.job_id for e in client.watch(result.job.job_id)} == {result.job.job_id}  # and WatchJob's
    assert reservations(mesh) == []


def test_fp32_rules_reproduce_the_single_device_result(client):
    x = np.random.default_rng(2).standard_normal((333, 64)).astype(np.float32)
    result = client.run("mlp_classifier", {"x": x}, filter=FP32_ONLY)
    (expected,) = reference("mlp_classifier", x)
    assert {t.rule for t in result.job.plan.targets} <= {"cuda-fp32", "cuda-fp32-small"}
    assert len({s.device_id for s in result.job.shards}) == 2
    np.testing.assert_allclose(result.outputs["logits"], expected, rtol=1e-5, atol=1e-6)


def test_submit_watch_and_fetch_after_reconnecting(mesh):
    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    with MeshClient(mesh.dispatch.address) as first:
        job_id = first.submit("mlp_classifier", {"x": x}, name="reconnect")
    with MeshClient(mesh.dispatch.address) as second:
        events = list(second.watch(job_id))
        assert events[-1].type == job_pb.JOB_EVENT_TYPE_SUCCEEDED
        job = second.get(job_id)
        assert job.state == job_pb.JOB_STATE_SUCCEEDED and job.spec.name == "reconnect"
        (expected,) = reference("mlp_classifier", x)
        np.testing.assert_allclose(second.fetch_result(job_id)["logits"], expected, rtol=5e-2, atol=5e-2)
        listed = second.stub.ListJobs(pb.ListJobsRequest()).jobs
        assert job_id in [j.job_id for j in listed]


def test_plan_job_predicts_without_running(client, mesh):
    x = np.zeros((1000, 64), np.float32)
    plan = client.plan("mlp_classifier", {"x": x})
    assert sum(s.rows for s in plan.shards) == 1000
    assert plan.predicted_seconds > 0 and plan.equal_split_predicted_seconds >= plan.predicted_seconds * 0.999
    assert all(t.artifact_key for t in plan.targets)
    assert reservations(mesh) == []


def test_training_across_devices_learns_the_digits(client):
    x, y = load_digits()
    split = train_test_split(x, y, test_fraction=0.2, seed=0)
    options = job_pb.TrainingOptions(epochs=8, batch_size=128, learning_rate=0.1, momentum=0.9)
    trained = client.run("mlp_train_step", {"x": split.x_train, "y": split.y_train}, training=options)
    losses = list(trained.job.losses)
    assert len(losses) == 8 * 12 and np.mean(losses[-12:]) < 0.25 * np.mean(losses[:12])
    params = [(k, v) for k, v in trained.outputs.items() if k != "losses"]
    logits = client.run("mlp_classifier", {"x": split.x_test}, parameters=params).outputs["logits"]
    assert np.mean(np.argmax(logits, axis=1) == split.y_test) >= 0.93


def test_one_training_step_equals_the_single_device_update(client):
    """Shards of different sizes on two fp32 devices: only the size-weighted gradient mean gives this update."""
    import jax

    x, y = load_digits()
    x, y = x[:301], y[:301]
    options = job_pb.TrainingOptions(epochs=1, batch_size=301, learning_rate=0.5, momentum=0.0)
    trained = client.run("mlp_train_step", {"x": x, "y": y}, training=options, filter=FP32_ONLY)
    rows = [s.rows for s in trained.job.shards]
    assert len({s.device_id for s in trained.job.shards}) == 2 and len(set(rows)) > 1
    program = default_registry().get("mlp_train_step")
    params = program.init_params(0)
    outputs = jax.jit(program.fn)(*params, x, y)
    grads = [np.asarray(o) for o, spec in zip(outputs, program.outputs) if spec.name.startswith("grad/")]
    for spec, p, g in zip(program.parameters, params, grads):
        np.testing.assert_allclose(trained.outputs[spec.name], np.asarray(p) - 0.5 * g, rtol=1e-5, atol=1e-6)


def stream(*parts):
    return iter(pb.RunJobRequest(**{field: message}) for field, message in parts)


def run_raw(mesh, parts):
    with open_channel(mesh.dispatch.address) as channel:
        from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc

        return list(dispatch_service_pb2_grpc.DispatchServiceStub(channel).RunJob(stream(*parts), timeout=60))


def spec_for(program, inputs, **options):
    return ("spec", job_spec(program, inputs, **options))


X = np.zeros((10, 64), np.float32)
BAD_JOBS = [
    pytest.param([spec_for("no_such_program", {"x": X})], grpc.StatusCode.NOT_FOUND, "no_such_program",
                 id="unknown-program"),
    pytest.param([spec_for("mlp_classifier", {"x": np.zeros((10, 63), np.float32)})], grpc.StatusCode.INVALID_ARGUMENT,
                 "shape", id="signature-mismatch"),
    pytest.param([spec_for("mlp_classifier", {"x": np.zeros((10, 64), np.int32)})], grpc.StatusCode.INVALID_ARGUMENT,
                 "dtype", id="wrong-dtype"),
    pytest.param([spec_for("mlp_classifier", {"x": np.zeros((0, 64), np.float32)})], grpc.StatusCode.INVALID_ARGUMENT,
                 "empty", id="empty-batch"),
    pytest.param([spec_for("mlp_classifier", {"x": X}),
                  ("block", pb.InputBlock(first_row=0, tensors=[to_proto(X[:4])]))],
                 grpc.StatusCode.INVALID_ARGUMENT, "ended after 4 of the 10 rows", id="stream-ends-early"),
    pytest.param([spec_for("mlp_classifier", {"x": X}),
                  ("block", pb.InputBlock(first_row=0, tensors=[to_proto(np.zeros((12, 64), np.float32))]))],
                 grpc.StatusCode.INVALID_ARGUMENT, "declares 10", id="more-rows-than-declared"),
    pytest.param([spec_for("mlp_classifier", {"x": X}, platforms=["tpu"])], grpc.StatusCode.FAILED_PRECONDITION,
                 "no device can run", id="no-device"),
]


@pytest.mark.parametrize("parts, code, words", BAD_JOBS)
def test_bad_jobs_are_refused_and_leave_no_reservation(mesh, parts, code, words):
    error = rpc_error(run_raw, mesh, parts)
    assert error.code() == code and words in error.details(), error.details()
    assert reservations(mesh) == []


def test_an_oversized_message_is_resource_exhausted(mesh):
    big = np.zeros((300_000, 64), np.float32)  # 77 MB in one block, over the 16 MiB message limit
    parts = [spec_for("mlp_classifier", {"x": big}), ("block", pb.InputBlock(first_row=0, tensors=[to_proto(big)]))]
    error = rpc_error(run_raw, mesh, parts)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reservations(mesh) == []


def test_request_parts_block_inputs_under_the_chunk_size():
    x = np.zeros((1000, 64), np.float32)
    parts = list(request_parts(job_spec("mlp_classifier", {"x": x}), {"x": x}, None, 64 * 1024))
    blocks = [m for field, m in parts if field == "block"]
    assert sum(b.tensors[0].shape[0] for b in blocks) == 1000 and all(b.ByteSize() <= 64 * 1024 + 256 for b in blocks)



# 256 MiB in and 256 MiB out through a dispatcher allowed 8 MiB of shard inputs in flight. Its
# peak memory may grow by that budget, the block being read into shards, the chunks on their way
# (outputs go to their result rows as they arrive), and gRPC's transport buffers on every stream
# (measured before outputs were placed: 65-85 MiB for 96, 160 and 192 MiB alike, so it does not
# grow with the job). The bound is half the input.
STREAM_INPUT_BYTES = 256 * 1024 * 1024
DISPATCH_GROWTH_BOUND_BYTES = 128 * 1024 * 1024


def test_dispatcher_memory_stays_bounded_while_a_large_input_streams(mesh, tmp_path):
    from accelmesh.embedded import start_dispatch

    small = start_dispatch(tmp_path, mesh.inventory.address, mesh.compile.address, mesh.credentials,
                           env={"ACCELMESH_INFLIGHT_BYTES": str(8 << 20), "ACCELMESH_MAX_SHARD_BYTES": str(2 << 20)})
    try:
        x = np.random.default_rng(4).standard_normal((STREAM_INPUT_BYTES // 4096, 1024)).astype(np.float32)
        with MeshClient(small.address) as c:
            c.run("identity", {"x": x[:64]}, filter=FP32_ONLY)  # warm: artifacts built and loaded
            before = peak_rss_bytes(small.process.pid)
            result = c.run("identity", {"x": x}, filter=FP32_ONLY)
        growth = peak_rss_bytes(small.process.pid) - before
        np.testing.assert_array_equal(result.outputs["y"], x)
        assert len(result.job.shards) >= 128  # 2 MiB shards
        assert growth < DISPATCH_GROWTH_BOUND_BYTES, f"dispatcher grew by {growth / 2**20:.0f} MiB"
    finally:
        small.terminate()


def test_cancel_stops_a_running_job_and_releases_its_devices(client, mesh):
    tokens = np.random.default_rng(5).integers(0, 512, size=(6000, 32), dtype=np.int32)
    job_id = client.submit("transformer_encoder", {"tokens": tokens})
    for event in client.watch(job_id):
        if event.type == job_pb.JOB_EVENT_TYPE_SHARD_STARTED:
            break
    job = client.cancel(job_id)
    assert job.state == job_pb.JOB_STATE_CANCELLED
    assert list(client.watch(job_id))[-1].type == job_pb.JOB_EVENT_TYPE_CANCELLED
    assert reservations(mesh) == []
    error = rpc_error(client.fetch_result, job_id)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "cancelled" in error.details()
