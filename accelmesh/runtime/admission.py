"""Admission for every mesh server: which threads run a call, and how many calls it takes at once.

grpcio's sync server runs every call on one pool, and a stream holds its thread for as long as
it is open: 16 idle streams (or 16 `WatchDevices` subscribers) used to take every thread of a
service, health checks included. Here each call runs on a pool chosen by its kind, through
grpcio's per-method `experimental_thread_pool`:

- a call that streams (either way) runs on the stream pool, sized to the stream limit. An idle
  stream parks a thread there (about 20 KiB resident: 400 parked threads measured +7 MiB) and
  takes nothing from work;
- a unary call runs on the work pool (the server's own, ``max_workers`` threads), which streams
  never touch, so work always has its threads;
- health runs on a small pool of its own, so a probe is answered however busy the service is
  (reflection is a stream like any other).

Limits, refused at once with RESOURCE_EXHAUSTED naming the limit and the variable that raises
it (backpressure instead of a queue that grows): streams open at once per service and per
client (a client is its principal: certificate or token, else its peer address), and calls in
flight (running or waiting for a thread) per service, which grpcio itself enforces with
``maximum_concurrent_rpcs``.

A client's share of the streams: it may open one while it holds fewer than
``max_streams_per_client`` and fewer than the service has free. So no client holds more than
are left for the others, and the last free streams go to clients that hold few: a first client
can take half of the limit, a second half of the rest, and so on, and the service is full only
once log2(max_streams) clients (10 at the default) or more hold its streams. A client that
holds none is refused only then. The mesh's own services, named by their certificates, are
exempt from the share (their streams are the mesh's work, bounded by their own limits, and
replicas may share one name) but count toward the service's limit like any other.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc

from accelmesh import errors
from accelmesh.runtime.config import env_int
from accelmesh.runtime.errors import abort
from accelmesh.runtime.handlers import rewrapped

MAX_STREAMS_ENV = "ACCELMESH_MAX_STREAMS"
MAX_STREAMS_PER_CLIENT_ENV = "ACCELMESH_MAX_STREAMS_PER_CLIENT"
MAX_UNARY_IN_FLIGHT_ENV = "ACCELMESH_MAX_UNARY_IN_FLIGHT"
DEFAULT_MAX_STREAMS = 1024  # open streams a service holds at once: parked threads, ~20 MiB at the limit
DEFAULT_MAX_STREAMS_PER_CLIENT = 512  # so one client cannot take every stream of a service
DEFAULT_MAX_UNARY_IN_FLIGHT = 1024  # unary calls running or queued for a work thread
HEALTH_THREADS = 4  # Check answers from a table; Watch does not hold a thread (health.py)
STREAM_POOL_SPARE = 16  # threads above the stream limit, so a refusal never waits for one
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # Check answers from a table; Watch returns at once (non-blocking)


@dataclass(frozen=True)
class Admission:
    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_client: int = DEFAULT_MAX_STREAMS_PER_CLIENT
    max_unary_in_flight: int = DEFAULT_MAX_UNARY_IN_FLIGHT
    # Threads that run streams; 0: one for every stream admitted (plus spares), so none waits. A
    # worker sets fewer: its Execute calls past them wait, unread, for a thread (HTTP/2 flow
    # control holds their inputs back), so it holds the inputs of only that many calls at once.
    stream_threads: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, *, stream_threads: int = 0) -> Admission:
        """The limits the environment sets, with this service's number of stream threads."""
        return cls(stream_threads=stream_threads,
                   max_streams=env_int(MAX_STREAMS_ENV, DEFAULT_MAX_STREAMS, env, minimum=1),
                   max_streams_per_client=env_int(MAX_STREAMS_PER_CLIENT_ENV, DEFAULT_MAX_STREAMS_PER_CLIENT, env,
                                                  minimum=1),
                   max_unary_in_flight=env_int(MAX_UNARY_IN_FLIGHT_ENV, DEFAULT_MAX_UNARY_IN_FLIGHT, env, minimum=1))

    @property
    def maximum_concurrent_rpcs(self) -> int:
        """grpcio's cap on every call at once: what each kind may hold, and room for probes."""
        return self.max_streams + self.max_unary_in_flight + HEALTH_THREADS * 4


@dataclass(frozen=True)
class StreamClient:
    """Whom a stream counts against: a principal's key (or a peer address), and whether it takes a share."""

    key: str
    shares: bool = True  # False: one of the mesh's own services (see the module docstring)


class StreamCount:
    """Streams open now, per service and per client; `enter` refuses past the limit or the client's share."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self._lock = threading.Lock()
        self._clients: Counter[str] = Counter()
        self.open = 0

    def held(self, key: str) -> int:
        with self._lock:
            return self._clients[key]

    def _admits(self, client: StreamClient) -> bool:
        free = self.admission.max_streams - self.open
        if free <= 0:
            return False
        held = self._clients[client.key]
        return not client.shares or (held < self.admission.max_streams_per_client and held < free)

    def enter(self, client: StreamClient) -> Callable[[], None] | None:
        """A release function for an admitted stream, or None when a limit is reached."""
        with self._lock:
            if not self._admits(client):
                return None
            self.open += 1
            self._clients[client.key] += 1
        released = False  # guarded by the lock: the call's end and its callback both release

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self.open -= 1
                self._clients[client.key] -= 1
                if not self._clients[client.key]:
                    del self._clients[client.key]

        return release

    def refusal(self, client: StreamClient) -> errors.ResourceExhausted:
        """Why `enter` refused `client`, as the status a program can read: an ErrorInfo reason
        (STREAM_LIMIT or STREAM_SHARE) with the limit and its variable, and a QuotaFailure."""
        a = self.admission
        with self._lock:
            held, open_ = self._clients[client.key], self.open
        free = a.max_streams - open_
        who = errors.quoted(client.key)
        if free <= 0:
            message = (f"this service holds its limit of {a.max_streams} open streams ({MAX_STREAMS_ENV}); retry "
                       f"once some close, or ask an operator to raise {MAX_STREAMS_ENV} on the server")
            return errors.ResourceExhausted(message, reason=errors.STREAM_LIMIT, metadata={
                "limit": str(a.max_streams), "open": str(open_), "variable": MAX_STREAMS_ENV},
                quota=errors.QuotaViolation("service", f"{a.max_streams} open streams, every client together"))
        if held >= a.max_streams_per_client:
            share, variable = a.max_streams_per_client, MAX_STREAMS_PER_CLIENT_ENV
            message = (f"{who} holds {held} open streams on this service, the most one principal may "
                       f"({MAX_STREAMS_PER_CLIENT_ENV}={share}); close some of them first, or ask an operator "
                       f"to raise {MAX_STREAMS_PER_CLIENT_ENV} on the server")
        else:
            share, variable = free, MAX_STREAMS_ENV
            message = (f"{who} holds {held} open streams on this service and only {free} of its {a.max_streams} "
                       f"({MAX_STREAMS_ENV}) are free: no principal may hold more streams than are left for the "
                       f"others; close some of them first, or ask an operator to raise {MAX_STREAMS_ENV} on the server")
        return errors.ResourceExhausted(message, reason=errors.STREAM_SHARE, metadata={
            "limit": str(share), "held": str(held), "variable": variable},
            quota=errors.QuotaViolation(f"principal:{client.key}", f"at most {share} open streams now ({variable})"))


class Pools:
    """The three pools of one server (see the module docstring)."""

    def __init__(self, admission: Admission, max_workers: int):
        self.work = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
        threads = admission.stream_threads or admission.max_streams + STREAM_POOL_SPARE
        self.stream = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc-stream")
        self.health = futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="grpc-health")

    def shutdown(self) -> None:
        for pool in (self.work, self.stream, self.health):
            pool.shutdown(wait=False, cancel_futures=True)


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Outermost of a server's interceptors: the handler it returns is the one grpcio runs, and
    the pool grpcio picks is an attribute of that handler's behaviour."""

    def __init__(self, pools: Pools, streams: StreamCount,
                 client_of: Callable[[grpc.ServicerContext], StreamClient]):
        self.pools, self.streams, self.client_of = pools, streams, client_of

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        own_pool = handler_call_details.method.startswith(HEALTH_PREFIX)

        def wrap(behavior, client_streams: bool, server_streams: bool):
            if own_pool or not (client_streams or server_streams):
                pool = self.pools.health if own_pool else self.pools.work
                return _on_pool(behavior, pool)
            return _on_pool(self._counted(behavior, server_streams), self.pools.stream)

        return rewrapped(handler, wrap)

    def _counted(self, behavior, server_streams: bool):
        def admit(context):
            client = self.client_of(context)
            release = self.streams.enter(client)
            if release is None:
                abort(context, self.streams.refusal(client))
            context.add_callback(release)  # however the call ends, cancelled included
            return release

        if server_streams:
            def streaming(request, context):
                release = admit(context)
                try:
                    yield from behavior(request, context)
                finally:
                    release()
            return streaming

        def unary_response(request, context):
            release = admit(context)
            try:
                return behavior(request, context)
            finally:
                release()
        return unary_response


def _on_pool(behavior, pool: futures.ThreadPoolExecutor):
    """``behavior`` as a fresh function (a servicer's bound method takes no attributes) that
    grpcio runs on ``pool``; a non-blocking one (health's Watch) stays non-blocking."""

    def run(*args):
        return behavior(*args)

    run.experimental_thread_pool = pool
    run.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)
    return run


__all__ = ["Admission", "AdmissionInterceptor", "Pools", "StreamClient", "StreamCount"]
