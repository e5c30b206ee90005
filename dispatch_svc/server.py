"""Build, serve and shut down the dispatch service."""

from __future__ import annotations

import logging
from pathlib import Path

from accelmesh import errors
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.runtime import database
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.server import MeshServer, Service, create_server
from accelmesh.runtime.telemetry import configure_telemetry, tracer
from accelmesh.security.access import PEOPLE, Access, Authenticator, roles
from accelmesh.security.identity import Role
from accelmesh.security.tickets import TicketSigner, expiring_ticket
from dispatch_svc.admission.admission import AdmissionGate
from dispatch_svc.admission.queue import JobQueue, QueueSignals
from dispatch_svc.admission.quotas import Quotas
from dispatch_svc.admission.releases import RetriedReleases
from dispatch_svc.admission.scheduling.rounds import Round, load_throughputs
from dispatch_svc.api.servicer import DispatchServicer
from dispatch_svc.api.status_page import StatusPage
from dispatch_svc.clients.compiler import GrpcCompiler
from dispatch_svc.clients.inventory import GrpcInventory
from dispatch_svc.config import DispatchConfig
from dispatch_svc.dataplane.workers import GrpcWorkers
from dispatch_svc.execution.runner import JobRunner
from dispatch_svc.execution.takeover import Takeover
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.limits import Limits
from dispatch_svc.metrics import DispatchMetrics
from dispatch_svc.planner import ThroughputModel
from dispatch_svc.ports import LiveJobs

SERVICE_NAME = "accelmesh.dispatch.v1.DispatchService"
# People only; what each may see of the jobs (their own, or an operator's everyone's) is the servicer's.
ACCESS: Access = {**{method: PEOPLE for method in (
    "PlanJob", "SubmitJob", "RunJob", "WatchJob", "GetJob", "ListJobs", "CancelJob", "FetchResult", "ListQuotas")},
    "SetQuota": roles(Role.OPERATOR)}

log = logging.getLogger(__name__)


def dependencies(book: JobBook) -> dict:
    """What dispatch cannot work without: readiness is NOT_SERVING while one of these fails."""
    return {"job book": lambda: database.ping(book.engine)}


def ticket_signer(security):
    """DATA_PATH_DIRECT jobs' tickets, signed with this dispatcher's own certificate (tickets.py)."""
    signer = TicketSigner(security)

    def sign(owner: str, job_id: str, direction: str, host: str, prefix: str, ttl_s: float) -> bytes:
        return signer.sign(expiring_ticket(owner, job_id, host, direction, prefix=prefix, lifetime_s=ttl_s))
    return sign


def inventory_port(config: DispatchConfig, security, channels: dict) -> RetriedReleases:
    """The inventory as every part here reaches it: a release it did not answer is sent again."""
    return RetriedReleases(GrpcInventory(config.inventory, security, **channels), ttl_s=config.reservation_ttl_s)


def build_dispatch(config: DispatchConfig, *, tracer_provider=None) -> tuple[MeshServer, JobRunner]:
    """Every part built whole, each from the parts it uses, in the order they depend on each other."""
    if tracer_provider is None:
        tracer_provider = configure_telemetry("accelmesh-dispatch")
    security = config.security.without_token()
    channels = {"tracer_provider": tracer_provider, "max_message_bytes": config.max_message_bytes}
    inventory = inventory_port(config, security, channels)
    compiler = GrpcCompiler(config.compile, security, **channels)
    workers = GrpcWorkers(security, chunk_bytes=config.chunk_bytes, **channels)
    book = JobBook(Path(config.data_dir), retention_s=config.result_retention_s, database_url=config.db,
                   lease_s=config.lease_s)
    for job_id in book.interrupted:  # a crashed dispatcher left them holding devices
        try:
            inventory.release(job_id)
        except errors.AccelmeshError as exc:  # inventory down: the leases lapse on their own
            log.warning("could not release the devices of interrupted job %s: %s", job_id, exc)
    throughput = ThroughputModel(calibrate_stages=config.calibrate_stages)
    metrics = Metrics("dispatch", config.metrics_listen, config.security, config.http)
    live = LiveJobs()
    dispatch_metrics = DispatchMetrics(metrics, book, live.count)
    quotas = Quotas(book.engine)
    gate = AdmissionGate(inventory, reservation_ttl_s=config.reservation_ttl_s, quotas=quotas,
                         queue_timeout_s=config.queue_timeout_s, max_queued=config.max_queued_per_tenant,
                         max_queued_bytes=config.max_queued_bytes_per_tenant, metrics=dispatch_metrics)
    signals = QueueSignals(lambda: (inventory.pool_state(), quotas.all()))
    runner = JobRunner(inventory, compiler, workers, book, throughput,
                       limits=Limits(config.max_shard_bytes, config.inflight_bytes, config.reservation_ttl_s,
                                     verify_fraction=config.verify_fraction, device_watch_s=config.device_watch_s),
                       gate=gate, job_limits=config.limits, live=live, signals=signals,
                       tracer=tracer(tracer_provider, "accelmesh.dispatch"), metrics=dispatch_metrics,
                       sign_ticket=ticket_signer(config.security))
    servicer = DispatchServicer(runner, Authenticator(config.security), chunk_bytes=config.chunk_bytes,
                                max_parameter_bytes=config.max_client_parameter_bytes,
                                max_message_bytes=config.max_message_bytes, stream_idle_s=config.stream_idle_s)

    takeover = Takeover(runner).start() if config.lease_s else None
    table = load_throughputs(config.scheduling_throughputs) if config.scheduling_throughputs else None
    scheduling = Round(config.scheduling_policy, inventory, throughput, inventory.reserved_device_ids, table)
    queue = JobQueue(book, runner.start_queued, runner.expire_queued, signals, poll_s=config.queue_poll_s,
                     scheduling=scheduling).start()

    status = None
    if config.status_listen:
        status = StatusPage(config.status_listen, config.security, Authenticator(config.security), book,
                            inventory.all_devices, limits=config.http).start()

    def shutdown():
        queue.stop()
        if takeover is not None:
            takeover.stop()
        for client in (workers, compiler, inventory):
            client.close()
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
        pages=(status,) if status is not None else (),
    )
    server.watch_dependencies(dependencies(book))
    return server, runner
