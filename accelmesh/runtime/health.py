"""grpc.health.v1.Health for every mesh server: Check, List, and Watch without holding a server thread.

Written here rather than taken from grpcio-health-checking because that servicer deadlocks a
server that stops while a watcher goes away: it calls each watcher's response callback while
holding its lock, a callback waits for the server's event thread to send, and that thread may be
waiting for the same lock to run the closing watcher's callback (seen as a hung stop() in this
project's tests). Here the lock guards only the table; callbacks run outside it, on a thread
of their own that a status change waits for only so long: grpcio (1.85) can leave a send to a
watcher that was cancelled at that moment waiting for good (about one stop in fifty in this
project's tests), and a server must still stop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh.errors import quoted

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
DELIVERY_WAIT_S = 2.0  # how long a status change waits for its watchers to be sent it
# List answers RESOURCE_EXHAUSTED past this many services, as the health protocol allows and
# grpc-go's server does at the same figure; a mesh server hosts a handful.
MAX_LISTED_SERVICES = 100

Send = Callable[[health_pb2.HealthCheckResponse | None], None]


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self._lock = threading.Lock()  # guards the two tables, never held while sending
        self._sending = threading.Lock()  # one status change delivered at a time, in order
        self._status: dict[str, int] = {"": SERVING}
        self._watchers: dict[str, set[Send]] = {}

    def Check(self, request, context):
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            # Health is not behind the error interceptor, so the name is quoted short here.
            context.set_details(f"no service {quoted(request.service)} on this server; use '' for the server "
                                "itself, or List for every service's name")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def List(self, request, context):
        """Every service this server reports on ('' is the server itself) with its status now."""
        with self._lock:
            statuses = dict(self._status)
        if len(statuses) > MAX_LISTED_SERVICES:
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(f"{len(statuses)} services, over the {MAX_LISTED_SERVICES} List returns; "
                                "Check them by name")
            return health_pb2.HealthListResponse()
        response = health_pb2.HealthListResponse()
        for service, status in statuses.items():
            response.statuses[service].status = status
        return response

    def Watch(self, request, context, send_response_callback: Send | None = None):
        if send_response_callback is None:
            raise RuntimeError("this server does not call non-blocking handlers; Watch needs grpcio >= 1.28")
        service = request.service
        with self._lock:
            status = self._status.get(service, SERVICE_UNKNOWN)
            self._watchers.setdefault(service, set()).add(send_response_callback)
        context.add_callback(lambda: self._forget(service, send_response_callback))
        send_response_callback(health_pb2.HealthCheckResponse(status=status))

    Watch.experimental_non_blocking = True  # the server passes send_response_callback and frees the thread

    def set(self, service: str, status: int) -> None:
        self.update({service: status})

    def update(self, statuses: Mapping[str, int]) -> None:
        """Several services' statuses at once, their watchers sent them on one thread that this
        waits for DELIVERY_WAIT_S at most in all (not per service: a server that stops sets every
        one of its services, and its stop() must stay within one wait)."""
        with self._sending:
            sends = []
            with self._lock:
                for service, status in statuses.items():
                    self._status[service] = status
                    response = health_pb2.HealthCheckResponse(status=status)
                    sends += [(send, response) for send in self._watchers.get(service, ())]
            if not sends:
                return

            def deliver():
                for send, response in sends:  # a watcher that went away meanwhile ignores it
                    send(response)

            delivery = threading.Thread(target=deliver, name="health-watchers", daemon=True)
            delivery.start()
            delivery.join(DELIVERY_WAIT_S)

    def _forget(self, service: str, send: Send) -> None:
        with self._lock:
            watchers = self._watchers.get(service, set())
            watchers.discard(send)
            if not watchers:  # else every name ever watched (anyone may call Watch) would stay
                self._watchers.pop(service, None)
        send(None)  # ends the call
