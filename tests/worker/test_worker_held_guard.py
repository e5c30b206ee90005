"""Held tensors a failed call cannot change: a call that is refused or fails keeps nothing it asked
to keep, and a key once held takes no other content, so no call answered with an error changes
what a job's later shards compute with (worker_svc/inputs.py Kept, held_tensors.py hold). Through
a real worker process, called with the dispatcher's certificate, as the dispatcher calls it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from _execute_helpers import (  # noqa: F401  (fixtures: pytest finds them in this module)
    CALL_TIMEOUT_S,
    CPU,
    EXECUTABLE_BATCH,
    STAGES,
    compile_service_fixture,
    devices_fixture,
    digits,
    execute,
    header,
    kept,
    mlp_fixture,
    referring,
    requests,
    worker_fixture,
)

from accelmesh import errors
from accelmesh.runtime.errors import error_reason
from accelmesh.worker.v1 import worker_service_pb2 as pb

from conftest import rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]


def wrong_rows(batch: int) -> np.ndarray:
    """A data input the artifact refuses (63 features where the program takes 64)."""
    return np.zeros((batch, 63), np.float32)


def by_reference(worker, mlp, job_id: str, seed: int = 0):
    return execute(worker, referring(header(mlp, CPU, EXECUTABLE_BATCH, job_id=job_id), kept(mlp),
                                     digits(EXECUTABLE_BATCH, seed)))


def in_full(worker, mlp, seed: int = 0):
    return execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH), [*mlp.params, digits(EXECUTABLE_BATCH, seed)]))


@pytest.mark.parametrize("data", ["refused rows", "valid rows"])
def test_calls_answered_with_an_error_cannot_overwrite_a_running_jobs_held_parameters(worker, mlp, data):
    job = f"guarded-{data.split()[0]}"
    execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id=job, keep_tensors=kept(mlp)),
                             [*mlp.params, digits(EXECUTABLE_BATCH)]))
    forged = [p + 1000 for p in mlp.params]
    x = wrong_rows(EXECUTABLE_BATCH) if data == "refused rows" else digits(EXECUTABLE_BATCH)
    for _ in range(3):
        error = rpc_error(execute, worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id=job,
                                                           keep_tensors=kept(mlp)), [*forged, x]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "params:" in error.details() and "new key" in error.details()
    later = by_reference(worker, mlp, job, seed=1)
    assert later.stages == STAGES
    np.testing.assert_array_equal(later.outputs[0], in_full(worker, mlp, seed=1).outputs[0])


def test_a_refused_call_keeps_none_of_the_tensors_it_asked_to_keep(worker, mlp):
    error = rpc_error(execute, worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="refused-keep",
                                                       keep_tensors=kept(mlp)),
                                                [*mlp.params, wrong_rows(EXECUTABLE_BATCH)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    missing = rpc_error(by_reference, worker, mlp, "refused-keep")
    assert missing.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(missing) == errors.TENSOR_NOT_HELD, "the refused call held its parameters"


def test_a_shard_refused_on_execute_many_keeps_nothing_and_the_stream_goes_on(worker, mlp):
    def shards():
        bad = requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="many-keep", keep_tensors=kept(mlp)),
                       [*mlp.params, wrong_rows(EXECUTABLE_BATCH)])
        return (pb.ExecuteManyRequest.FromString(m.SerializeToString()) for m in bad)

    answers = list(worker.ExecuteMany(shards(), timeout=CALL_TIMEOUT_S))
    assert [a.WhichOneof("part") for a in answers] == ["failure"]
    missing = rpc_error(by_reference, worker, mlp, "many-keep")
    assert error_reason(missing) == errors.TENSOR_NOT_HELD


def test_keeping_the_same_content_again_is_no_error(worker, mlp):
    for _ in range(2):
        execute(worker, requests(header(mlp, CPU, EXECUTABLE_BATCH, job_id="same-again", keep_tensors=kept(mlp)),
                                 [*mlp.params, digits(EXECUTABLE_BATCH)]))
    assert by_reference(worker, mlp, "same-again").stages == STAGES
