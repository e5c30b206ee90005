"""One job is one trace across real processes: inventory, compile, a worker and dispatch each export
their spans over OTLP (configured from the OTEL_* environment only) to a collector in this test,
and the job's spans from all four services share the client's trace id."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.runtime import attributes as attr
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.launcher import ServiceProcess, start_service
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import ANYONE
from accelmesh.security.config import INSECURE
from accelmesh.security.identity import Role

from conftest import CREDENTIALS

pytestmark = pytest.mark.slow

SERVICES = ("accelmesh-inventory", "accelmesh-compile", "accelmesh-worker", "accelmesh-dispatch")
CLIENT_SERVICE = "accelmesh-test-client"
EMULATE = ("a100-80gb", "v100-32gb")
ROWS = 64
EXECUTE_MANY = "/accelmesh.worker.v1.WorkerService/ExecuteMany"
FETCH_ARTIFACT = "/accelmesh.compile.v1.CompileService/FetchArtifact"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
SHARD_ATTRIBUTES = (attr.DEVICE_ID, attr.RULE, attr.SHARD_INDEX, attr.SHARD_ATTEMPT, attr.SHARD_BYTES)
JOB_TIMEOUT_S = 60.0
EXPORT_WAIT_S = 10.0
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict = field(hash=False)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An in-process OTLP trace receiver that keeps every span of every ResourceSpans it is sent."""

    def __init__(self):
        self.spans: list[CollectedSpan] = []
        self.exported = bytearray()  # every request as sent, to search for what must never be in it
        self._changed = threading.Condition()

    def Export(self, request, context):
        self.exported += request.SerializeToString()
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                received += [CollectedSpan(resource.get("service.name", ""), s.name, s.kind, s.trace_id.hex(),
                                           s.span_id.hex(), s.parent_span_id.hex(),
                                           {a.key: _value(a.value) for a in s.attributes})
                             for s in scope_spans.spans]
        with self._changed:
            self.spans += received
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float) -> list[CollectedSpan]:
        """The spans so far, once `predicate(spans)` holds or the timeout passed."""
        with self._changed:
            self._changed.wait_for(lambda: predicate(self.spans), timeout_s)
            return list(self.spans)


@dataclass
class TracedJob:
    job: job_pb.Job
    trace_id: str
    spans: list[CollectedSpan]  # everything every process exported, the job's trace and the rest
    exit_codes: dict[str, int]
    placed: job_pb.Job  # the same model placed on the devices, run as a pipeline (its own trace)
    exported: bytes = b""  # the raw export requests

    @property
    def in_trace(self) -> list[CollectedSpan]:
        return [s for s in self.spans if s.trace_id == self.trace_id]

    def named(self, name: str, service: str | None = None) -> list[CollectedSpan]:
        return [s for s in self.in_trace if s.name == name and (service is None or s.service == service)]


def health_check(address: str, provider: TracerProvider) -> None:
    """A health check through a traced channel: neither its client nor its server side may become a span."""
    with open_channel(address, tracer_provider=provider) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def job_trace_id(spans: list[CollectedSpan], job_id: str) -> str | None:
    """The trace of the dispatch.job span that names this job."""
    return next((s.trace_id for s in spans if s.name == "dispatch.job" and s.attributes.get(attr.JOB_ID) == job_id),
                None)


def start_mesh(data, env: dict[str, str]) -> list[ServiceProcess]:
    """Inventory, compile, one worker and dispatch as real processes, with the arguments
    accelmesh.embedded passes (not all its helpers take an env), each with its role's credentials."""
    started: list[ServiceProcess] = []

    def start(role: Role, module: str, args: list[str]) -> ServiceProcess:
        started.append(start_service(role.value, module, args, env={**env, **CREDENTIALS.env(role)}))
        return started[-1]

    try:
        inventory = start(Role.INVENTORY, "inventory_svc", [
            "--listen", "127.0.0.1:0", "--db", str(data / "inventory.db"), "--poll-interval", "5.0",
            "--lost-after", "3"])
        compile_ = start(Role.COMPILE, "compile_svc", [
            "--listen", "127.0.0.1:0", "--cache-dir", str(data / "artifacts"),
            "--programs-dir", str(data / "programs")])
        start(Role.WORKER, "worker_svc", [
            "--listen", "127.0.0.1:0", "--devices", str(len(EMULATE)), "--inventory", inventory.address,
            "--compile", compile_.address, "--artifact-dir", str(data / "worker-artifacts"),
            "--emulate", ",".join(EMULATE)])
        start(Role.DISPATCH, "dispatch_svc", [
            "--listen", "127.0.0.1:0", "--inventory", inventory.address, "--compile", compile_.address,
            "--data-dir", str(data / "dispatch")])
    except BaseException:
        stop(started)
        raise
    return started


def stop(processes: list[ServiceProcess]) -> dict[str, int]:
    """SIGTERM, last started first: a graceful stop leaves no unexported span behind (MeshServer.stop
    force-flushes the provider; the SDK's exit hook shuts it down as well)."""
    return {p.name: p.terminate() for p in reversed(processes)}


@pytest.fixture(scope="module")
def traced_job(tmp_path_factory) -> TracedJob:
    collector = Collector()
    # Not a mesh service: the processes' OTLP exporters reach it in plaintext (OTEL_EXPORTER_OTLP_INSECURE).
    receiver = create_server([Service("opentelemetry.proto.collector.trace.v1.TraceService",
                                      trace_service_pb2_grpc.add_TraceServiceServicer_to_server, collector)],
                             security=INSECURE, access={"Export": ANYONE}).start()
    endpoint = f"http://127.0.0.1:{receiver.port}"
    # Only the standard variables: OTEL_EXPORTER_OTLP_ENDPOINT turns the OTLP exporter on (telemetry.py),
    # OTEL_EXPORTER_OTLP_INSECURE is read by the gRPC exporter, OTEL_BSP_SCHEDULE_DELAY (ms) by the
    # BatchSpanProcessor, so spans leave each process while it runs rather than only at its exit.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    client_provider = TracerProvider(resource=Resource.create({"service.name": CLIENT_SERVICE}))
    client_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    try:
        processes = start_mesh(tmp_path_factory.mktemp("traced-mesh"), env)
        try:
            x = np.random.default_rng(7).standard_normal((ROWS, 64)).astype(np.float32)
            dispatch = processes[-1]
            with MeshClient(dispatch.address, tracer_provider=client_provider) as client:
                result = client.run("mlp_classifier", {"x": x}, timeout=JOB_TIMEOUT_S)
                placed = client.run("mlp_classifier", {"x": x}, timeout=JOB_TIMEOUT_S,
                                    placement=plan_pb.PlacementOptions(strategy=plan_pb.PLACEMENT_STRATEGY_RANKED,
                                                                       device_count=2, micro_batch_rows=16))
            for process in processes:
                health_check(process.address, client_provider)
        finally:
            exit_codes = stop(processes)
            client_provider.shutdown()

        def complete(spans):
            trace_id = job_trace_id(spans, result.job.job_id)
            return (trace_id is not None and set(SERVICES) <= {s.service for s in spans if s.trace_id == trace_id}
                    and job_trace_id(spans, placed.job.job_id) is not None)

        spans = collector.wait_for(complete, EXPORT_WAIT_S)
    finally:
        receiver.stop(0)
    trace_id = job_trace_id(spans, result.job.job_id)
    assert trace_id is not None, f"no dispatch.job span for {result.job.job_id}: {sorted({s.name for s in spans})}"
    return TracedJob(result.job, trace_id, spans, exit_codes, placed.job, bytes(collector.exported))


def test_the_job_ran_and_every_service_stopped_gracefully(traced_job):
    assert traced_job.job.state == job_pb.JOB_STATE_SUCCEEDED
    assert {s.device_id for s in traced_job.job.shards} and sum(s.rows for s in traced_job.job.shards) == ROWS
    assert traced_job.exit_codes == {"dispatch": 0, "worker": 0, "compile": 0, "inventory": 0}


def test_the_jobs_trace_spans_all_four_services_and_the_client(traced_job):
    services = {s.service for s in traced_job.in_trace}
    assert set(SERVICES) <= services, f"missing from the job's trace: {sorted(set(SERVICES) - services)}"
    (run_job,) = traced_job.named("/accelmesh.dispatch.v1.DispatchService/RunJob", CLIENT_SERVICE)
    assert run_job.parent_span_id == ""  # the client's call is the trace's root
    (job_span,) = traced_job.named("dispatch.job", "accelmesh-dispatch")
    assert job_span.attributes[attr.PROGRAM] == "mlp_classifier"


def test_shard_spans_carry_the_shard_attributes(traced_job):
    shards = traced_job.named("dispatch.shard", "accelmesh-dispatch")
    (job_span,) = traced_job.named("dispatch.job")
    assert len(shards) == len(traced_job.job.shards)  # one attempt each: nothing failed
    for span in shards:
        missing = [a for a in SHARD_ATTRIBUTES if a not in span.attributes]
        assert not missing, f"dispatch.shard {span.attributes} lacks {missing}"
        assert span.parent_span_id == job_span.span_id
        assert span.attributes[attr.JOB_ID] == traced_job.job.job_id
        assert span.attributes[attr.SHARD_ATTEMPT] == 1 and span.attributes[attr.SHARD_BYTES] > 0
    by_index = {s.attributes[attr.SHARD_INDEX]: s for s in shards}
    assert sorted(by_index) == [s.index for s in traced_job.job.shards]
    for record in traced_job.job.shards:
        assert by_index[record.index].attributes[attr.DEVICE_ID] == record.device_id
        assert by_index[record.index].attributes[attr.RULE] == record.rule


def test_the_workers_span_of_each_shard_is_a_child_of_its_shard_span(traced_job):
    shards = {s.span_id: s for s in traced_job.named("dispatch.shard")}
    # dispatch.shard -> worker.shard (in the worker): one ExecuteMany call carries many shards, and
    # each shard's header says where in the trace it belongs.
    workers = [s for s in traced_job.named("worker.shard", "accelmesh-worker")]
    assert len(workers) == len(shards)
    for span in workers:
        assert span.parent_span_id in shards, f"worker span {span.span_id} is not a child of a dispatch.shard span"
        parent = shards[span.parent_span_id]
        assert span.attributes[attr.SHARD_INDEX] == parent.attributes[attr.SHARD_INDEX]
        assert span.attributes[attr.DEVICE_ID] == parent.attributes[attr.DEVICE_ID]
    calls = [s for s in traced_job.named(EXECUTE_MANY, "accelmesh-worker") if s.kind == SERVER]
    assert 1 <= len(calls) <= len(shards)  # streams, not a call per shard


def test_the_refresh_reaches_the_worker_inside_the_jobs_trace(traced_job):
    polls = traced_job.named("inventory.poll_node", "accelmesh-inventory")
    assert polls and all(p.attributes[attr.POLL_OUTCOME] == "ok" for p in polls)
    describe = traced_job.named("/accelmesh.worker.v1.WorkerService/DescribeNode", "accelmesh-worker")
    assert describe, "the real-time refresh's DescribeNode on the worker is not in the job's trace"


def test_no_token_or_key_is_in_any_span(traced_job):
    """The client sent its bearer token on every call and each process holds its key: spans carry neither."""
    token = CREDENTIALS.token_file.read_text().strip().encode()
    keys = [b"".join(path.read_bytes().splitlines()[1:-1]) for path in CREDENTIALS.folder.glob("*.key")]
    assert len(traced_job.exported) > 10_000 and token and keys
    assert token not in traced_job.exported
    assert not [k[:16] for k in keys if k[:32] in traced_job.exported]
    assert b"authorization" not in traced_job.exported.lower()


def test_no_span_is_a_health_check(traced_job):
    health = [(s.service, s.name) for s in traced_job.spans if s.name.startswith(HEALTH_PREFIX)]
    assert health == []


def test_the_workers_artifact_fetch_is_part_of_the_jobs_trace(traced_job):
    fetches = [s for s in traced_job.spans if s.name == FETCH_ARTIFACT and s.service == "accelmesh-worker"]
    assert fetches, "the worker fetched no artifact: nothing to check"
    jobs = {traced_job.trace_id, job_trace_id(traced_job.spans, traced_job.placed.job_id)}
    assert all(s.trace_id in jobs for s in fetches), \
        f"{sum(s.trace_id not in jobs for s in fetches)} of {len(fetches)} fetches left the jobs' traces"


def test_a_pipelines_shard_spans_name_their_stage_and_micro_batch(traced_job):
    placed = traced_job.placed
    assert placed.state == job_pb.JOB_STATE_SUCCEEDED
    trace_id = job_trace_id(traced_job.spans, placed.job_id)
    (job_span,) = [s for s in traced_job.spans if s.trace_id == trace_id and s.name == "dispatch.job"]
    assert job_span.attributes[attr.PLACEMENT_STRATEGY] == "ranked"
    shards = [s for s in traced_job.spans if s.trace_id == trace_id and s.name == "dispatch.shard"]
    stages = placed.plan.placement.stages
    assert len(shards) == placed.plan.placement.micro_batches * len(stages)
    seen = {(s.attributes[attr.PIPELINE_STAGE], s.attributes[attr.MICRO_BATCH]) for s in shards}
    assert seen == {(st.index, k) for st in stages for k in range(placed.plan.placement.micro_batches)}
    for span in shards:
        assert span.attributes[attr.DEVICE_ID] == stages[span.attributes[attr.PIPELINE_STAGE]].device_id
