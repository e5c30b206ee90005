"""Build a mesh server apart from running it: health, reflection, error mapping, tracing, limits.

    server = create_server([Service(name, add_fn, servicer)], security=..., access=ACCESS, address="127.0.0.1:0")
    server.start(); ... server.stop()

Tests bind port 0 and read `server.port`; `run_service` is the body of every service process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from accelmesh import errors
from accelmesh.runtime import health
from accelmesh.runtime.admission import Admission, AdmissionInterceptor, Pools, StreamClient, StreamCount
from accelmesh.runtime.config import DEFAULT_GRACE_S, DEFAULT_MAX_MESSAGE_BYTES, cannot_bind, channel_options
from accelmesh.runtime.errors import DecodeInterceptor, ErrorInterceptor
from accelmesh.runtime.launcher import ready_line
from accelmesh.runtime.memory import bound_heap, start_trimming
from accelmesh.runtime.metrics import Metrics
from accelmesh.runtime.reflection import enable_server_reflection
from accelmesh.runtime.telemetry import server_interceptors
from accelmesh.security.access import Access, AccessInterceptor, Authenticator
from accelmesh.security.config import Security, check_listen
from accelmesh.security.identity import SERVICE_ROLES
from accelmesh.security.tls import server_credentials

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health.SERVING, health.NOT_SERVING
DEPENDENCY_CHECK_S = 5.0  # how often readiness checks the dependencies a service names


@dataclass(frozen=True)
class Service:
    """One gRPC service to host: its full name (for health and reflection) and how to add it."""

    name: str  # e.g. "accelmesh.inventory.v1.InventoryService"
    add_to_server: Callable[[Any, grpc.Server], None]
    servicer: Any


class Page(Protocol):
    """An HTTP endpoint a server serves beside its gRPC port, stopped with it."""

    port: int

    def close(self) -> None: ...


class MeshServer:
    def __init__(
        self,
        server: grpc.Server,
        port: int,
        health_servicer: health.HealthServicer,
        services: Sequence[Service],
        tracer_provider: TracerProvider | None,
        on_stop: Sequence[Callable[[], None]],
        probe: tuple[grpc.Server, int] | None = None,
        pools: Pools | None = None,
        streams: StreamCount | None = None,
        metrics: Metrics | None = None,
        pages: Sequence[Page] = (),
    ):
        self.server = server
        self.metrics = metrics  # its /metrics endpoint (metrics.port), closed after the hooks
        self.pages = tuple(pages)  # other HTTP endpoints it serves (each .port), closed before the hooks
        self.port = port
        self.health = health_servicer
        self.services = tuple(services)
        self.tracer_provider = tracer_provider
        self._on_stop = list(on_stop)
        self._probe, self.health_port = probe if probe else (None, 0)
        self._pools, self.streams = pools, streams
        self._stopped = threading.Event()
        self._dependencies: dict[str, Callable[[], None]] = {}
        self._dependency_interval_s = DEPENDENCY_CHECK_S
        self._finished = threading.Event()  # set once stop() has run every hook and flushed

    def start(self) -> MeshServer:
        self.server.start()
        if self._probe is not None:
            self._probe.start()
        self.set_serving(True)
        if self._dependencies:
            threading.Thread(target=self._watch_dependencies, name="dependencies", daemon=True).start()
        return self

    def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        self.health.update({"": status, **{service.name: status for service in self.services}})

    def watch_dependencies(self, checks: Mapping[str, Callable[[], None]],
                           interval_s: float = DEPENDENCY_CHECK_S) -> None:
        """Readiness, from `start` on: every `interval_s` each check (a dependency the service
        cannot work without, say its database) is run; while one raises, the server itself ('')
        answers NOT_SERVING, with a log line when that changes, and each service's own name stays
        SERVING (liveness: restarting the process would not bring the dependency back)."""
        self._dependencies, self._dependency_interval_s = dict(checks), interval_s

    @property
    def dependencies(self) -> dict[str, Callable[[], None]]:
        return dict(self._dependencies)

    def _watch_dependencies(self) -> None:
        failing: str | None = None
        while True:
            reason = None
            for name, check in self._dependencies.items():
                try:
                    check()
                except Exception as exc:  # noqa: BLE001 - any failure makes the server not ready
                    reason = f"{name}: {exc}"
                    break
            if reason is None and failing is not None:
                log.warning("ready again: %s answers", failing.split(":", 1)[0])
            elif reason is not None and failing is None:
                log.warning("not ready (health NOT_SERVING): %s", reason)
            if not self._stopped.is_set():
                self.health.set("", SERVING if reason is None else NOT_SERVING)
            failing = reason
            if self._stopped.wait(self._dependency_interval_s):
                return

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Health goes NOT_SERVING, in-flight calls get `grace_s` to finish, telemetry is flushed."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        if self._probe is not None:
            self._probe.stop(0).wait()
        if self._pools is not None:
            self._pools.shutdown()
        for page in self.pages:  # before the hooks: a page reads what they close (a database)
            page.close()
        for hook in self._on_stop:
            hook()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()
            self.tracer_provider.shutdown()
        self._finished.set()

    def wait(self) -> None:
        """Until stop() has finished: gRPC stopped, hooks run, telemetry flushed."""
        self._finished.wait()


def create_server(
    services: Sequence[Service],
    *,
    security: Security,
    access: Access,
    address: str = "127.0.0.1:0",
    health_listen: str = "",
    max_workers: int = 16,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    admission: Admission | None = None,
    tracer_provider: TracerProvider | None = None,
    on_stop: Sequence[Callable[[], None]] = (),
    metrics: Metrics | None = None,
    pages: Sequence[Page] = (),
) -> MeshServer:
    """A server for ``services`` on ``address``: mutual TLS and ``access`` (method -> roles) unless
    ``security`` is insecure (loopback only). ``health_listen``, when set, also serves the health
    service alone, in plaintext, for probes that cannot speak TLS (Kubernetes' gRPC probe).
    ``admission`` (default: from the environment) sets the stream and in-flight limits and which
    pool runs which call (admission.py). ``metrics``: the service's /metrics endpoint, if it serves
    one (metrics.py), and ``pages`` any other HTTP endpoint it serves (a status page), each closed
    when the server stops."""
    check_listen(security, address)
    admission = admission or Admission.from_env()
    authenticator = Authenticator(security)
    pools, streams = Pools(admission, max_workers), StreamCount(admission)
    # Admission is outermost: the pool grpcio runs a call on is read from the handler it returns.
    # Tracing comes next so its span records the status the error interceptor chose; access
    # comes after the error interceptor, so its refusals become statuses like every other error;
    # a request that does not parse is refused innermost, once the caller has been let in.
    interceptors = [AdmissionInterceptor(pools, streams, _client_key(authenticator)),
                    *server_interceptors(tracer_provider), ErrorInterceptor(),
                    AccessInterceptor([s.name for s in services], access, authenticator),
                    DecodeInterceptor()]
    server = grpc.server(
        pools.work,
        interceptors=interceptors,
        options=channel_options(max_message_bytes),
        maximum_concurrent_rpcs=admission.maximum_concurrent_rpcs,
    )
    for service in services:
        service.add_to_server(service.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        health_servicer.set(service.name, NOT_SERVING)
    enable_server_reflection([s.name for s in services] + [health.SERVICE_NAME], server)
    try:
        if security.insecure:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(security.tls))
    except RuntimeError:  # grpcio's "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise cannot_bind(address, "--listen")
    probe = _health_only(health_servicer, health_listen) if health_listen else None
    return MeshServer(server, port, health_servicer, services, tracer_provider, on_stop, probe, pools, streams, metrics,
                      pages)


def _client_key(authenticator: Authenticator) -> Callable[[grpc.ServicerContext], StreamClient]:
    """Who a stream counts against: its principal, else (no credentials, or the insecure mode
    where everyone is the local developer) the address it comes from. A mesh service named by its
    certificate takes no share of the streams (admission.py)."""

    def key(context: grpc.ServicerContext) -> StreamClient:
        if not authenticator.insecure:
            try:
                principal = authenticator.principal(context)
            except errors.AccelmeshError:
                pass
            else:
                service = principal.role in SERVICE_ROLES and principal.via == "certificate"
                return StreamClient(principal.key, shares=not service)
        return StreamClient(f"peer:{context.peer()}")

    return key


def _health_only(health_servicer: health.HealthServicer, address: str) -> tuple[grpc.Server, int]:
    """The health service and nothing else, plaintext: what a kubelet's gRPC probe can reach."""
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="probe"))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe)
    try:
        port = probe.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise cannot_bind(address, "--health-listen")
    return probe, port


def stop_on_signals(server: MeshServer, grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGTERM or SIGINT stops the server gracefully (on a thread: a handler must not block)."""

    def shutdown(signum, _frame):
        log.info("signal %s: stopping with %.1f s grace", signal.Signals(signum).name, grace_s)
        threading.Thread(target=server.stop, args=(grace_s,), daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)


def run_service(name: str, parse_args: Callable[[list[str] | None], Any], build: Callable[[Any], MeshServer],
                argv: list[str] | None = None, *, after_start: Callable[[Any, MeshServer], None] | None = None,
                host: Callable[[Any], str] = lambda config: config.listen.rsplit(":", 1)[0],
                malloc_arenas: int | None = None, fixed_mmap_threshold: bool = True) -> int:
    """The body of every service's `__main__`: configure, build, announce the port, serve until a signal.

    A bad configuration exits with status 2 and one line naming what to fix, not a traceback.
    `after_start` runs before the ready line (a worker registers there, so whoever waits for the
    line finds its devices listed). `malloc_arenas`: at most that many glibc malloc arenas;
    `fixed_mmap_threshold`: large blocks always mapped (memory.py says which services and why).
    """
    bound_heap(malloc_arenas, fixed_mmap_threshold)  # memory.py: first, before the threads start
    logging.basicConfig(level=os.environ.get("ACCELMESH_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its plugin and migration lines at every start
    try:
        config = parse_args(argv)
        server = build(config)
    except errors.AccelmeshError as exc:
        print(f"accelmesh-{name}: {exc}", file=sys.stderr)
        return 2
    stop_on_signals(server)  # before the ready line: whoever reads it may send SIGTERM at once
    trimming = start_trimming()  # freed memory back to the system (memory.py)
    server.start()
    if after_start is not None:
        after_start(config, server)
    print(ready_line(name, host(config), server.port), flush=True)
    server.wait()
    if trimming is not None:
        trimming.set()
    return 0
