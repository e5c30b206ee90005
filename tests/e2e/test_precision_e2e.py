"""Precision as a job constraint through the whole mesh (real processes, gRPC and JAX): with fp32
required, identical jobs give byte-identical results whatever the plan; with bf16 allowed, the
A100s' bf16 builds change them; the plan names the rule each type got; bad precisions refused."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from accelmesh.client import MeshClient, job_spec
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import (
    EmbeddedMesh,
    start_compile,
    start_dispatch,
    start_embedded_mesh,
    start_inventory,
    start_worker,
)

from conftest import CREDENTIALS, reservations, rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

# bf16 devices of one type, and fp32 devices of two more: three rules in one job.
EMULATE = ("a100-80gb", "a100-80gb", "v100-32gb", "t4")
NOT_A100, ONLY_A100 = 'type != "a100-80gb"', 'type = "a100-80gb"'


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_embedded_mesh(tmp_path_factory.mktemp("mesh"), devices=4, emulate=EMULATE) as running:
        yield running


@pytest.fixture
def client(mesh):
    with MeshClient(mesh.dispatch.address) as c:
        yield c


def split(job: job_pb.Job) -> set[tuple[str, int, int]]:
    return {(s.target_type.split(":")[1].split("[")[0], s.first_row, s.rows) for s in job.shards}


def rules(job: job_pb.Job) -> dict[str, tuple[str, str]]:
    return {t.target_type.split(":")[1].split("[")[0]: (t.rule, t.compute_dtype) for t in job.plan.targets}


def _three_plans(client, program, inputs):
    """The same fp32 job on all four devices, on the V100 and T4 only, and on the A100s only."""
    results = (client.run(program, inputs, precision="fp32"),
               client.run(program, inputs, precision="fp32", filter=NOT_A100),
               client.run(program, inputs, precision="fp32", filter=ONLY_A100))
    jobs = [r.job for r in results]
    assert all(j.state == job_pb.JOB_STATE_SUCCEEDED for j in jobs)
    assert len({frozenset(split(j)) for j in jobs}) == 3  # three different plans
    assert rules(jobs[2]) == {"a100-80gb": ("default-fp32", "fp32")}  # the A100s' fp32 build
    assert {dtype for j in jobs for _, dtype in rules(j).values()} == {"fp32"}
    assert all(j.spec.constraints.precision == common_pb2.PRECISION_FP32 for j in jobs)
    return results


def test_fp32_jobs_give_byte_identical_results_whatever_the_plan(client, mesh):
    x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    results = _three_plans(client, "identity", {"x": x})
    assert all(r.outputs["y"].tobytes() == x.tobytes() for r in results)
    assert reservations(mesh) == []


def test_fp32_transformer_jobs_agree_to_fp32_rounding_whatever_the_plan(client):
    """Not bit for bit: CPU XLA's fp32 matmuls round differently at different batch sizes (a shard
    of 128 rows and one of 600 differ in a few ulps in one process, under one rule), so a plan's
    shard sizes show in the last bits; the rules themselves add nothing to that."""
    tokens = np.random.default_rng(1).integers(0, 512, (600, 32), dtype=np.int32)
    first, *others = (r.outputs["logits"] for r in _three_plans(client, "transformer_encoder", {"tokens": tokens}))
    for other in others:
        assert np.max(np.abs(other - first)) <= 1e-5 * np.max(np.abs(first))
    bf16 = client.run("transformer_encoder", {"tokens": tokens}, filter=ONLY_A100).outputs["logits"]
    assert np.max(np.abs(bf16 - first)) > 1e-3 * np.max(np.abs(first))  # the A100's bf16 build, for contrast


def test_with_bf16_allowed_the_a100s_change_the_identity_so_the_fp32_test_could_fail(client):
    x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    for precision in ("", "bf16"):
        # On the A100s alone: measured rates may leave a mixed plan's A100s without rows.
        result = client.run("identity", {"x": x}, precision=precision, filter=ONLY_A100)
        assert rules(result.job)["a100-80gb"] == ("cuda-bf16", "bf16")
        on_a100 = [(s.first_row, s.rows) for s in result.job.shards if "a100-80gb" in s.target_type]
        assert on_a100
        for first, rows in on_a100:
            got, want = result.outputs["y"][first:first + rows], x[first:first + rows]
            assert np.mean(np.any(got != want, axis=1)) > 0.5  # most rows rounded to bf16
            np.testing.assert_allclose(got, want, rtol=2 ** -8)  # but only by bf16's rounding


def test_fp16_allowed_runs_the_v100_and_t4_on_their_fp16_rules_within_tolerance(client):
    tokens = np.random.default_rng(2).integers(0, 512, (256, 32), dtype=np.int32)
    half = client.run("transformer_encoder", {"tokens": tokens}, precision="fp16", filter=NOT_A100)
    exact = client.run("transformer_encoder", {"tokens": tokens}, precision="fp32", filter=NOT_A100)
    assert rules(half.job) == {"v100-32gb": ("cuda-fp16-volta", "fp16"), "t4": ("cuda-fp16-turing", "fp16")}
    assert {s.rule for s in half.job.shards} == {"cuda-fp16-volta", "cuda-fp16-turing"}
    want = exact.outputs["logits"]
    error = np.max(np.abs(half.outputs["logits"] - want)) / np.max(np.abs(want))
    assert 0 < error <= 1e-2  # the fp16 rules' tolerance


def test_bad_precisions_are_invalid_argument_naming_the_field(mesh, client):
    x = np.zeros((8, 64), np.float32)
    training = job_pb.TrainingOptions(epochs=1, batch_size=8, learning_rate=0.1)
    cases = [
        (job_spec("mlp_train_step", {"x": x, "y": np.zeros(8, np.int32)}, training=training, precision="fp16"),
         "spec.constraints.precision PRECISION_FP16_ALLOWED is for inference only"),
        (job_spec("mlp_classifier", {"x": x}), "spec.constraints.precision 42 is not a Precision"),
    ]
    cases[1][0].constraints.precision = 42
    for spec, message in cases:
        error = rpc_error(client.stub.PlanJob, pb.PlanJobRequest(spec=spec))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
        # run at once, within this iteration; the default only makes the binding explicit
        error = rpc_error(lambda spec=spec: list(client.stub.RunJob(iter([pb.RunJobRequest(spec=spec)]))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
    assert reservations(mesh) == []


def test_a_precision_no_device_can_meet_fails_the_plan_naming_the_devices_and_their_rules(tmp_path):
    # An operator's rules that build everything but CPUs in bf16 only: a job requiring fp32 on the
    # A100 cannot be planned, and says which devices and rules stand in the way, reserving nothing.
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "cpu-fp32"\ndescription = "CPUs in fp32"\n[rule.match]\nplatform = "cpu"\n'
                     '[rule.build]\ncompute_dtype = "fp32"\n\n[[rule]]\nname = "everything-bf16"\n'
                     'description = "every other device in bf16"\n[rule.build]\ncompute_dtype = "bf16"\n'
                     'tolerance = 5e-2\n')
    inventory = start_inventory(tmp_path, CREDENTIALS)
    with EmbeddedMesh(tmp_path, inventory, CREDENTIALS) as small:
        small.compile = start_compile(tmp_path, CREDENTIALS, rules=rules)
        small.workers.append(start_worker(inventory.address, small.compile.address, CREDENTIALS, devices=2,
                                          emulate=("a100-80gb",), artifact_dir=tmp_path / "worker-artifacts"))
        small.dispatch = start_dispatch(tmp_path, inventory.address, small.compile.address, CREDENTIALS)
        with MeshClient(small.dispatch.address) as client:
            x = np.zeros((8, 64), np.float32)
            spec = job_spec("mlp_classifier", {"x": x}, precision="fp32", filter=ONLY_A100)
            error = rpc_error(client.stub.PlanJob, pb.PlanJobRequest(spec=spec))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
            assert "precision fp32" in error.details() and "everything-bf16 (bf16)" in error.details()
            assert "/cuda:0" in error.details()
            # bf16 allowed, the same job plans on the A100's bf16 rule
            plan = client.stub.PlanJob(pb.PlanJobRequest(spec=job_spec("mlp_classifier", {"x": x}, filter=ONLY_A100)))
            assert {t.rule for t in plan.plan.targets} == {"everything-bf16"}
            assert reservations(small) == []
