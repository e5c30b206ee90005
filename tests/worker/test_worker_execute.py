"""WorkerService.Execute through real gRPC, against a worker process with four CPU devices (two
emulating accelerators): shards checked against a single-device reference, tensors held between
calls, and every refusal's status code. The pieces run in this process (cancellation, device
locks, target types, artifact cache) are in test_worker_execute_pieces.py."""

from __future__ import annotations

import hashlib
import threading

import grpc
import numpy as np
import pytest
from _execute_helpers import (  # noqa: F401  (fixtures: pytest finds them in this module)
    A100,
    CALL_TIMEOUT_S,
    CPU,
    CPU_3,
    EXECUTABLE_BATCH,
    MAX_INPUT_BYTES,
    MIB,
    NODE,
    PORTABLE_BATCH,
    STAGES,
    TRANSFORMER_BATCH,
    V100,
    Outcome,
    compile_service_fixture,
    devices_fixture,
    digits,
    execute,
    header,
    kept,
    mlp_fixture,
    referring,
    requests,
    run_mlp,
    transformer_fixture,
    worker_fixture,
)

from accelmesh import errors
from accelmesh.runtime.batches import batched, unbatched
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.tensors import TensorAssembler, split
from accelmesh.worker.v1 import worker_service_pb2 as pb

from conftest import rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]


# -- results ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_id", [CPU, V100, A100])
@pytest.mark.parametrize("fmt, batch, load_kind", [("executable", EXECUTABLE_BATCH, "executable"),
                                                    ("stablehlo", PORTABLE_BATCH, "compiled")])
def test_outputs_match_the_single_device_reference(worker, mlp, device_id, fmt, batch, load_kind):
    outcome = run_mlp(worker, mlp, device_id, batch, fmt)
    assert outcome.stages == STAGES
    assert outcome.timings.load_kind == load_kind
    (logits,) = outcome.outputs
    (want,) = map(np.asarray, mlp.reference(*mlp.params, digits(batch)))
    assert logits.shape == (batch, 10) and logits.dtype == np.float32
    rule = mlp.builds[device_id].rule.build
    scale = float(np.max(np.abs(want)))
    if rule.compute_dtype == "fp32":
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        error = float(np.max(np.abs(logits - want))) / scale
        assert 0 < error <= rule.tolerance, f"{rule.compute_dtype} run is off by {error:.2e}"


def test_without_report_stages_only_outputs_and_timings_come_back(worker, mlp):
    quiet = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, report_stages=False),
                                     [*mlp.params, digits(EXECUTABLE_BATCH)]))
    loud = run_mlp(worker, mlp, CPU, EXECUTABLE_BATCH)
    assert quiet.stages == [] and quiet.timings is not None
    np.testing.assert_array_equal(quiet.outputs[0], loud.outputs[0])


def test_a_second_shard_of_the_same_shape_skips_loading(worker, mlp):
    batch = 40  # a size no other test uses: the first shard compiles it
    first = run_mlp(worker, mlp, V100, batch, "stablehlo")
    second = run_mlp(worker, mlp, V100, batch, "stablehlo")
    assert second.timings.artifact_cached and second.timings.load_kind == "compiled"
    assert second.timings.load_seconds < first.timings.load_seconds / 10
    np.testing.assert_array_equal(second.outputs[0], first.outputs[0])


def test_kept_parameters_serve_later_calls_of_the_job_by_reference(worker, mlp):
    keep = kept(mlp)
    full = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1", keep_tensors=keep),
                                    [*mlp.params, digits(EXECUTABLE_BATCH)]))
    for seed in (0, 1):
        by_reference = execute(worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1"), keep,
                                                 digits(EXECUTABLE_BATCH, seed)))
        in_full = full if seed == 0 else execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH),
                                                                  [*mlp.params, digits(EXECUTABLE_BATCH, seed)]))
        assert by_reference.stages == STAGES
        np.testing.assert_array_equal(by_reference.outputs[0], in_full.outputs[0])
    error = rpc_error(execute, worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-other"), keep,
                                                 digits(EXECUTABLE_BATCH)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, "held per job: another job's key is not its own"
    _, chunks = split("input_0", mlp.params[0])
    chunk_after_reference = [pb.ExecuteRequest(header=header(mlp, CPU, EXECUTABLE_BATCH, job_id="held-1")),
                             pb.ExecuteRequest(held=keep[0]), *(pb.ExecuteRequest(chunk=c) for c in chunks)]
    error = rpc_error(execute, worker, iter(chunk_after_reference))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "unexpected chunk" in error.details()


def test_the_byte_limit_evicts_the_least_recently_used_job(worker, mlp):
    keep = kept(mlp)
    for job in ("evict-a", "evict-b"):  # two jobs' parameters do not fit HELD_BYTES: b's push a's out
        execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id=job, keep_tensors=keep),
                                 [*mlp.params, digits(EXECUTABLE_BATCH)]))
    error = rpc_error(execute, worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="evict-a"), keep,
                                                 digits(EXECUTABLE_BATCH)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "input 0 ('input_0')" in error.details() and "is not held" in error.details()
    assert error_reason(error) == errors.TENSOR_NOT_HELD  # what the dispatcher acts on
    assert execute(worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="evict-b"), keep,
                                     digits(EXECUTABLE_BATCH))).stages == STAGES


def run_together(stub, shards) -> list[Outcome]:
    """Start every shard's call at once, from its own thread."""
    barrier = threading.Barrier(len(shards))
    results: list = [None] * len(shards)

    def call(index, messages):
        barrier.wait()
        results[index] = execute(stub, messages)

    threads = [threading.Thread(target=call, args=(i, iter(list(m)))) for i, m in enumerate(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert all(results), "a shard did not finish"
    return results


def test_shards_on_two_devices_match_the_reference_and_share_their_types_artifact(worker, transformer):
    tokens = np.random.default_rng(1).integers(0, 512, size=(TRANSFORMER_BATCH, 32), dtype=np.int32)

    def shard(device_id):
        return requests(header(transformer, device_id, TRANSFORMER_BATCH), [*transformer.params, tokens])

    assert {transformer.builds[d].rule.build.compute_dtype for d in (CPU, CPU_3)} == {"fp32"}
    first, other_device = execute(worker, shard(CPU)), execute(worker, shard(CPU_3))
    # The first shard fetched the artifact; the second device of the same type found it on disk.
    assert not first.timings.artifact_cached and other_device.timings.artifact_cached
    (want,) = map(np.asarray, transformer.reference(*transformer.params, tokens))
    for outcome in (first, other_device):
        np.testing.assert_allclose(outcome.outputs[0], want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))

    # Sent at once, to two devices and twice to one: each shard's stages in order, every output the
    # reference's, the artifact from memory. Who waits for whom: the executor test below.
    for pair in ([shard(CPU), shard(CPU_3)], [shard(CPU), shard(CPU)]):
        for outcome in run_together(worker, pair):
            assert outcome.stages == STAGES and outcome.timings.artifact_cached
            np.testing.assert_allclose(outcome.outputs[0], want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))


# -- refusals --------------------------------------------------------------------------------------

def _garbage_executable(model):
    portable = model.builds[CPU].portable  # StableHLO bytes announced as an executable
    return requests(header(model, CPU, EXECUTABLE_BATCH, artifact_key=portable.key,
                           artifact_digest=portable.digest), [*model.params, digits(EXECUTABLE_BATCH)])


def _stream_ends_mid_tensor(model):
    messages = list(requests(header(model, CPU, EXECUTABLE_BATCH), [*model.params, digits(EXECUTABLE_BATCH)], 1024))
    return iter(messages[:-1])


def _oversized_input(model):
    big = pb.ExecuteRequest(tensor=split("x", np.zeros(0, np.float32))[0])
    big.tensor.shape[:] = [MAX_INPUT_BYTES // 4 + 1]
    big.tensor.total_bytes = (MAX_INPUT_BYTES // 4 + 1) * 4
    return iter([pb.ExecuteRequest(header=header(model, CPU, EXECUTABLE_BATCH, input_count=1)), big])


REFUSALS = {
    "unknown device": (grpc.StatusCode.NOT_FOUND, CPU, lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, device_id=f"{NODE}/cuda:7"), [*m.params, digits(EXECUTABLE_BATCH)])),
    "another target type": (grpc.StatusCode.FAILED_PRECONDITION, "a100-80gb", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, target_type=m.builds[A100].target_type),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "wrong digest": (grpc.StatusCode.FAILED_PRECONDITION, "failed verification", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_digest=hashlib.sha256(b"other").hexdigest()),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "garbage key": (grpc.StatusCode.NOT_FOUND, "not-a-key", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_key="not-a-key"), [*m.params, digits(EXECUTABLE_BATCH)])),
    "unknown key": (grpc.StatusCode.NOT_FOUND, "0" * 64, lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, artifact_key="0" * 64), [*m.params, digits(EXECUTABLE_BATCH)])),
    "artifact that does not load": (grpc.StatusCode.FAILED_PRECONDITION, "did not load", _garbage_executable),
    "header not first": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: requests(
        None, [*m.params, digits(EXECUTABLE_BATCH)])),
    "empty stream": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: iter([])),
    "stream ends early": (grpc.StatusCode.INVALID_ARGUMENT, "ended after", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), m.params)),
    "stream ends inside a tensor": (grpc.StatusCode.INVALID_ARGUMENT, "stream ended", _stream_ends_mid_tensor),
    "more tensors than announced": (grpc.StatusCode.INVALID_ARGUMENT, "more tensors", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), [*m.params, digits(EXECUTABLE_BATCH), digits(1)])),
    "input of the wrong shape": (grpc.StatusCode.INVALID_ARGUMENT, "input 6", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH), [*m.params, digits(EXECUTABLE_BATCH)[:, :63]])),
    "inputs over the worker's limit": (grpc.StatusCode.RESOURCE_EXHAUSTED, "ACCELMESH_WORKER_MAX_INPUT_BYTES",
                                       _oversized_input),
    "reference to a tensor not held": (grpc.StatusCode.FAILED_PRECONDITION, "is not held", lambda m: referring(
        header(m, CPU, EXECUTABLE_BATCH, job_id="never-kept"), kept(m), digits(EXECUTABLE_BATCH))),
    "reference before the header": (grpc.StatusCode.INVALID_ARGUMENT, "ShardHeader", lambda m: iter(
        [pb.ExecuteRequest(held=kept(m)[0])])),
    "keeping a tensor the call does not send": (grpc.StatusCode.INVALID_ARGUMENT, "'x'", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, keep_tensors=[pb.TensorRef(name="x", key="k")]),
        [*m.params, digits(EXECUTABLE_BATCH)])),
    "keeping a tensor twice": (grpc.StatusCode.INVALID_ARGUMENT, "listed twice", lambda m: requests(
        header(m, CPU, EXECUTABLE_BATCH, keep_tensors=[pb.TensorRef(name="input_0", key="a"),
                                                       pb.TensorRef(name="input_1", key="a")]),
        [*m.params, digits(EXECUTABLE_BATCH)])),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_have_their_status_and_the_worker_keeps_serving(worker, mlp, case):
    code, fragment, make = REFUSALS[case]
    error = rpc_error(execute, worker, make(mlp))
    assert error.code() == code, error.details()
    assert fragment in error.details()
    assert run_mlp(worker, mlp, CPU, EXECUTABLE_BATCH).stages == STAGES


# -- many shards on one stream (ExecuteMany) --------------------------------------------------------

def as_many(messages):
    """Execute's request messages as ExecuteMany's: the same fields, the same numbers."""
    return (pb.ExecuteManyRequest.FromString(m.SerializeToString()) for m in messages)


def answers(stub, messages, kinds: list[str] | None = None) -> list[Outcome | pb.ShardFailure]:
    """ExecuteMany's answers, one per shard in the order sent: its outcome, or its failure.
    `messages` are Execute's (the helpers make those), or ExecuteMany's. `kinds` collects the part
    of each message as it came (a batch's parts are then read one by one)."""
    done, outputs = [], []
    many = (m if isinstance(m, pb.ExecuteManyRequest) else next(as_many([m])) for m in messages)
    for part in unbatched(_noted(stub.ExecuteMany(many, timeout=CALL_TIMEOUT_S), kinds)):
        kind = part.WhichOneof("part")
        if kind == "tensor":
            outputs.append(TensorAssembler(part.tensor, "output"))
        elif kind == "chunk":
            outputs[-1].add(part.chunk)
        elif kind == "timings":
            done.append(Outcome([], [o.result() for o in outputs], part.timings))
            outputs = []
        else:
            assert kind == "failure" and not outputs, f"unexpected {kind}"
            done.append(part.failure)
    return done


def test_execute_many_runs_shards_in_order_and_a_failed_one_does_not_end_the_stream(worker, mlp):
    keep = kept(mlp)
    xs = [digits(EXECUTABLE_BATCH, seed) for seed in range(3)]
    wrong_batch = digits(EXECUTABLE_BATCH + 1)  # the executable is built for EXECUTABLE_BATCH rows
    shards = [
        requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="many-1", keep_tensors=keep), [*mlp.params, xs[0]]),
        referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="many-1", shard_index=1), keep, xs[1]),  # kept just before
        requests(header(mlp, CPU, EXECUTABLE_BATCH, shard_index=2), [*mlp.params, wrong_batch]),
        referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="many-1", shard_index=3), keep, xs[2]),
        requests(header(mlp, CPU, EXECUTABLE_BATCH, shard_index=4, input_count=0, batch_size=0), []),
    ]
    got = answers(worker, (message for shard in shards for message in shard))
    assert len(got) == 5
    for outcome, x in zip((got[0], got[1], got[3]), xs):
        assert outcome.stages == []  # ExecuteMany reports no stages
        alone = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH), [*mlp.params, x]))  # one Execute
        np.testing.assert_array_equal(outcome.outputs[0], alone.outputs[0])
    for failure in (got[2], got[4]):
        assert isinstance(failure, pb.ShardFailure)
        assert failure.code in (grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0])
        assert "input" in failure.message


def _noted(messages, kinds: list[str] | None):
    for message in messages:
        if kinds is not None:
            kinds.append(message.WhichOneof("part"))
        yield message


def batch_of(messages) -> pb.ExecuteManyRequest:
    """Execute's request messages as one ExecuteMany message carrying them all as a batch."""
    (batch,) = batched(as_many(messages), pb.ExecuteManyRequest, limit=2 * MIB)
    return pb.ExecuteManyRequest.FromString(batch)


def test_execute_many_reads_batched_shards_and_batches_its_answers_where_the_header_accepts_them(worker, mlp):
    """A shard's header, held references and inputs in one batch read as they would have one by
    one; a header with accept_batches is answered with its outputs and timings in one message, one
    without it part by part (a caller from before batches), on the same stream."""
    keep = kept(mlp)
    xs = [digits(EXECUTABLE_BATCH, seed) for seed in range(3)]
    shards = [
        batch_of(requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="batched", keep_tensors=keep,
                                 accept_batches=True), [*mlp.params, xs[0]])),
        batch_of(referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="batched", shard_index=1,
                                  accept_batches=True), keep, xs[1])),
        *as_many(referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="batched", shard_index=2), keep, xs[2])),
    ]
    kinds: list[str] = []
    got = answers(worker, shards, kinds)
    assert kinds == ["batch", "batch", "tensor", "chunk", "timings"]
    for outcome, x in zip(got, xs):
        alone = execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH), [*mlp.params, x]))
        np.testing.assert_array_equal(outcome.outputs[0], alone.outputs[0])


def test_execute_many_refuses_a_batch_inside_a_batch(worker, mlp):
    inner = batch_of(requests(header(mlp, CPU, EXECUTABLE_BATCH), [*mlp.params, digits(EXECUTABLE_BATCH)]))
    outer = pb.ExecuteManyRequest(batch=pb.ExecuteManyRequestBatch(parts=[inner]))
    error = rpc_error(answers, worker, iter([outer]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not nest" in error.details()


def test_execute_many_ends_the_call_on_a_reference_to_a_tensor_not_held_with_its_reason(worker, mlp):
    # The shard's inputs cannot be read, so the call ends with the status Execute would give.
    error = rpc_error(answers, worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id="many-unheld"), kept(mlp),
                                                 digits(EXECUTABLE_BATCH)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and error_reason(error) == errors.TENSOR_NOT_HELD


def test_execute_many_ends_the_call_when_a_shard_does_not_begin_with_a_header(worker, mlp):
    first = list(requests(header(mlp, CPU, EXECUTABLE_BATCH), [*mlp.params, digits(EXECUTABLE_BATCH)]))
    stray = list(requests(None, [digits(EXECUTABLE_BATCH)]))
    error = rpc_error(answers, worker, iter(first + stray))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "ShardHeader" in error.details()
