"""A Python client for the dispatch service: numpy in, numpy out.

    with MeshClient("127.0.0.1:50071") as client:
        result = client.run("transformer_encoder", {"tokens": tokens})
        result.outputs["logits"], result.job.shards

Inputs travel as row blocks no bigger than `chunk_bytes`, so a job of any size streams with
bounded memory on both ends; results are reassembled from their chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from google.protobuf import duration_pb2

from accelmesh.common.v1 import common_pb2
from accelmesh.direct_runs import DirectRuns
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.run_stream import JobResult, follow, parameter_parts
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES
from accelmesh.runtime.devices import PLATFORM_TO_PROTO
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES, TensorCollector, dtype_code, to_proto
from accelmesh.security.config import Security

# job_spec's `data_path` -> JobSpec.data_path.
DATA_PATHS = {"": job_pb.DATA_PATH_UNSPECIFIED, "relay": job_pb.DATA_PATH_RELAY, "direct": job_pb.DATA_PATH_DIRECT}
# job_spec's `precision` -> JobConstraints.precision.
PRECISIONS = {"": common_pb2.PRECISION_UNSPECIFIED, "fp32": common_pb2.PRECISION_FP32,
              "bf16": common_pb2.PRECISION_BF16_ALLOWED, "fp16": common_pb2.PRECISION_FP16_ALLOWED}


def job_spec(
    program: str,
    inputs: Mapping[str, np.ndarray],
    *,
    version: str = "",
    training: job_pb.TrainingOptions | None = None,
    platforms: Sequence[str] = (),
    capabilities: Sequence[str] = (),
    max_devices: int = 0,
    filter: str = "",
    precision: str = "",
    parameter_seed: int = 0,
    client_parameters: bool = False,
    name: str = "",
    placement: plan_pb.PlacementOptions | None = None,
    request_id: str = "",
    priority: int = 0,
    queue_timeout_s: float | None = None,
    verify_fraction: float = 0.0,
    data_path: str = "",
) -> job_pb.JobSpec:
    """A job's spec. `request_id` (a UUID, say) makes a retried submit return the job the first created.
    `precision`: "fp32" (bit-identical results whatever the plan), "bf16" or "fp16" (inference only)
    allowed; "" lets each device's compile rules decide. `priority` (0-1000) orders the job in the
    queue when the pool is full; `queue_timeout_s` bounds its wait there (None: the dispatcher's
    limit; 0: never queue, RESOURCE_EXHAUSTED at once). `verify_fraction` (0-1) of a data-parallel
    job's shards run again on another node and compared (never below the dispatcher's own).
    `data_path`: "direct" puts the rows into the workers' stores and fetches the outputs from them
    (MeshClient.run only; data-parallel inference); "relay" or "" streams them through the dispatcher."""
    timeout = None
    if queue_timeout_s is not None:
        timeout = duration_pb2.Duration()
        timeout.FromNanoseconds(round(queue_timeout_s * 1e9))
    return job_pb.JobSpec(
        program=program,
        version=version,
        kind=job_pb.JOB_KIND_TRAINING if training is not None else job_pb.JOB_KIND_INFERENCE,
        constraints=job_pb.JobConstraints(platforms=[PLATFORM_TO_PROTO[p] for p in platforms],
                                          required_capabilities=list(capabilities), max_devices=max_devices,
                                          filter=filter, precision=PRECISIONS[precision]),
        inputs=[common_pb2.TensorHeader(name=k, dtype=dtype_code(v.dtype), shape=v.shape, total_bytes=v.nbytes)
                for k, v in inputs.items()],
        client_parameters=client_parameters,
        parameter_seed=parameter_seed,
        training=training,
        name=name,
        placement=placement,
        request_id=request_id,
        priority=priority,
        queue_timeout=timeout,
        verify_fraction=verify_fraction,
        data_path=DATA_PATHS[data_path],
    )


def request_parts(spec: job_pb.JobSpec, inputs: Mapping[str, np.ndarray],
                  parameters: Sequence[tuple[str, np.ndarray]] | None,
                  chunk_bytes: int) -> Iterator[tuple[str, object]]:
    """(field, message) pairs of a SubmitJob / RunJob stream: spec, parameters, row blocks."""
    yield "spec", spec
    yield from parameter_parts(parameters, chunk_bytes)
    arrays = [np.ascontiguousarray(v) for v in inputs.values()]
    rows = arrays[0].shape[0]
    row_bytes = max(1, sum(a.nbytes // max(1, a.shape[0]) for a in arrays))
    step = max(1, chunk_bytes // row_bytes)
    for first in range(0, rows, step):
        yield "block", pb.InputBlock(first_row=first, tensors=[to_proto(a[first: first + step]) for a in arrays])


class MeshClient:
    def __init__(self, address: str, *, security: Security | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tracer_provider=None):
        """``security`` defaults to this process's client credentials: ACCELMESH_CA_FILE, _CERT_FILE,
        _KEY_FILE and _TOKEN_FILE, or the folder ``accelmesh up`` made (.accelmesh/credentials)."""
        self._channel = open_channel(address, security=security, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)
        self.stub = dispatch_service_pb2_grpc.DispatchServiceStub(self._channel)
        self.chunk_bytes = chunk_bytes
        self._direct = DirectRuns(security, chunk_bytes=chunk_bytes, max_message_bytes=max_message_bytes,
                                  tracer_provider=tracer_provider)

    def __enter__(self) -> MeshClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        self._direct.close()

    def run(self, program: str, inputs: Mapping[str, np.ndarray], *,
            parameters: Sequence[tuple[str, np.ndarray]] | None = None,
            on_event: Callable[[job_pb.JobEvent], None] | None = None, timeout: float | None = None,
            on_interrupt: Callable[[], None] | None = None, **spec_options) -> JobResult:
        """RunJob: one call, events and results streamed back; raises grpc.RpcError on failure.
        `on_interrupt` runs on KeyboardInterrupt while the call is still open, before the interrupt
        goes on: a CancelJob it sends then reaches the job before the call's end does (which the
        dispatcher would otherwise record as the job's cause: its client went)."""
        spec = job_spec(program, inputs, client_parameters=parameters is not None, **spec_options)
        if spec.data_path == job_pb.DATA_PATH_DIRECT:
            return self._direct.run(self.stub, spec, inputs, parameters, on_event=on_event, timeout=timeout,
                                    on_interrupt=on_interrupt)
        # accept_batches: what the dispatcher has ready at once comes as one message (its first says so).
        requests = (pb.RunJobRequest(**{field: message}, accept_batches=field == "spec")
                    for field, message in request_parts(spec, inputs, parameters, self.chunk_bytes))
        events, results, job = follow(self.stub.RunJob(requests, timeout=timeout), on_event=on_event,
                                      on_interrupt=on_interrupt)
        return JobResult(job, results.results(), events)

    def submit(self, program: str, inputs: Mapping[str, np.ndarray], *,
               parameters: Sequence[tuple[str, np.ndarray]] | None = None, timeout: float | None = None,
               **spec_options) -> str:
        spec = job_spec(program, inputs, client_parameters=parameters is not None, **spec_options)
        requests = (pb.SubmitJobRequest(**{field: message})
                    for field, message in request_parts(spec, inputs, parameters, self.chunk_bytes))
        return self.stub.SubmitJob(requests, timeout=timeout).job_id

    def plan(self, program: str, inputs: Mapping[str, np.ndarray], **spec_options) -> plan_pb.Plan:
        return self.stub.PlanJob(pb.PlanJobRequest(spec=job_spec(program, inputs, **spec_options))).plan

    def watch(self, job_id: str, from_index: int = 0) -> Iterator[job_pb.JobEvent]:
        for response in self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, from_index=from_index)):
            yield response.event

    def get(self, job_id: str) -> job_pb.Job:
        return self.stub.GetJob(pb.GetJobRequest(job_id=job_id)).job

    def cancel(self, job_id: str) -> job_pb.Job:
        return self.stub.CancelJob(pb.CancelJobRequest(job_id=job_id)).job

    def fetch_result(self, job_id: str) -> dict[str, np.ndarray]:
        return TensorCollector("result").collect(self.stub.FetchResult(pb.FetchResultRequest(job_id=job_id)))


__all__ = ["JobResult", "MeshClient", "job_spec", "request_parts"]
