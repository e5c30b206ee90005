"""Build, serve and shut down the dispatch service."""

from __future__ import annotations

import logging
from pathlib import Path

from accelmesh import errors
from accelmesh.runtime import database

from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.server import MeshServer, Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry, tracer
from accelmesh.security.access import PEOPLE, Access, Authenticator, roles
from accelmesh.security.identity import Role
from dispatch_svc.config import DispatchConfig
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.clients.mesh import GrpcMesh
from dispatch_svc.metrics import DispatchMetrics
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.admission.queue import Admission, JobQueue
from dispatch_svc.admission.quotas import Quotas
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.admission.scheduling.rounds import Round, load_throughputs
from dispatch_svc.api.servicer import DispatchServicer
from dispatch_svc.api.status_page import StatusPage
from dispatch_svc.execution.takeover import Takeover

SERVICE_NAME = "accelmesh.dispatch.v1.DispatchService"
# People only; what each may see of the jobs (their own, or an operator's everyone's) is the servicer's.
ACCESS: Access = {**{method: PEOPLE for method in (
    "PlanJob", "SubmitJob", "RunJob", "WatchJob", "GetJob", "ListJobs", "CancelJob", "FetchResult", "ListQuotas")},
    "SetQuota": roles(Role.OPERATOR)}

log = logging.getLogger(__name__)


def dependencies(book: JobBook) -> dict:
    """What dispatch cannot work without: readiness is NOT_SERVING while one of these fails."""
    return {"job book": lambda: database.ping(book.engine)}


def build_dispatch(config: DispatchConfig, *, tracer_provider=None) -> tuple[MeshServer, JobRunner]:
    if tracer_provider is None:
        tracer_provider = configure_telemetry("accelmesh-dispatch")
    mesh = GrpcMesh(config.inventory, config.compile, config.security.without_token(), tracer_provider=tracer_provider,
                    max_message_bytes=config.max_message_bytes, chunk_bytes=config.chunk_bytes)
    book = JobBook(Path(config.data_dir), retention_s=config.result_retention_s, database_url=config.db,
                   lease_s=config.lease_s)
    for job_id in book.interrupted:  # a crashed dispatcher left them holding devices
        try:
            mesh.release(job_id)
        except errors.AccelmeshError as exc:  # inventory down: the leases lapse on their own
            log.warning("could not release the devices of interrupted job %s: %s", job_id, exc)
    throughput = ThroughputModel()
    if not config.calibrate_stages:
        throughput.stages = None
    metrics = Metrics("dispatch", config.metrics_listen, config.security)
    runner = JobRunner(mesh, book, throughput, max_shard_bytes=config.max_shard_bytes,
                       inflight_bytes=config.inflight_bytes, reservation_ttl_s=config.reservation_ttl_s,
                       job_limits=config.limits, tracer=tracer(tracer_provider, "accelmesh.dispatch"),
                       admission=Admission(Quotas(book.engine), config.queue_timeout_s, config.max_queued_per_tenant))
    runner.metrics = DispatchMetrics(metrics, book, lambda: runner.running)
    servicer = DispatchServicer(runner, Authenticator(config.security), chunk_bytes=config.chunk_bytes,
                                max_parameter_bytes=config.max_client_parameter_bytes,
                                max_message_bytes=config.max_message_bytes)

    takeover = Takeover(runner).start() if config.lease_s else None
    quotas = runner.admission.quotas
    table = load_throughputs(config.scheduling_throughputs) if config.scheduling_throughputs else None
    scheduling = Round(config.scheduling_policy, mesh, throughput, mesh.reserved_device_ids, table)
    queue = JobQueue(book, runner.start_queued, runner.expire_queued, poll_s=config.queue_poll_s,
                     pool_state=lambda: (mesh.pool_state(), quotas.all()), scheduling=scheduling).start()
    runner.on_ended, runner.on_queued = queue.wake, queue.note

    status = None
    if config.status_listen:
        status = StatusPage(config.status_listen, config.security, Authenticator(config.security), book,
                            mesh.all_devices).start()

    def shutdown():
        if status is not None:
            status.close()
        queue.stop()
        if takeover is not None:
            takeover.stop()
        mesh.close()
        book.close()

    server = create_server(
        [Service(SERVICE_NAME, dispatch_service_pb2_grpc.add_DispatchServiceServicer_to_server, servicer)],
        security=config.security,
        access=ACCESS,
        address=config.listen,
        health_listen=config.health_listen,
        max_message_bytes=config.max_message_bytes,
        tracer_provider=tracer_provider,
        on_stop=[shutdown],
        metrics=metrics,
    )
    server.watch_dependencies(dependencies(book))
    server.status_page = status  # its port, for tests and `accelmesh up`
    return server, runner
