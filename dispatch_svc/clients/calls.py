"""One call to a control-plane service, its error as the domain's: what every client here shares.
A call to a service that may run as replicas is retried on another one (`replicated`, `asked`). A
call made while a job plans is cancelled with the job (dispatch_svc.dataplane.call_scope.cancels_calls)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from accelmesh.runtime.errors import error_from_rpc
from dispatch_svc.dataplane.call_scope import call_scope
from dispatch_svc.dataplane.device_queues import Cancelled, CancelScope

CALL_TIMEOUT_S = 120.0
# A call to replicas that every replica failed (gRPC retried it already) is asked again up to this
# many times in all, 0.5 s, 1 s, then 1.5 s later: longer than a replica back up takes to be
# dialled again (runtime/channels.py caps that backoff at a second).
REPLICA_ATTEMPTS, REPLICA_RETRY_S = 4, 0.5

T = TypeVar("T")


def call(what: str, method, request, *, replicated: bool = False, timeout_s: float = CALL_TIMEOUT_S):
    """`method(request)`, a unary call, a failure raised as the domain error of its status (`what`
    names the service in the message). `replicated`: an idempotent call to a service that may run
    as replicas, asked again as `asked` does. Made while a job plans, the job's stop cancels it."""
    scope = call_scope()

    def attempt():
        if scope is None:
            return method(request, timeout=timeout_s)
        return _cancellable(method, request, timeout_s, scope)
    return asked(what, attempt, attempts=REPLICA_ATTEMPTS if replicated else 1)


def asked(what: str, attempt: Callable[[], T], *, attempts: int = REPLICA_ATTEMPTS) -> T:
    """`attempt()`, an idempotent call to a service that may run as replicas, whole (a stream read
    to its end inside it), asked again on UNAVAILABLE up to `attempts` times in all; a failure is
    raised as the domain error of its status. gRPC retries a call on another replica at once
    (runtime/channels.py), but only until its first response: a stream whose replica goes away
    after that fails, as does any call while the channel still counts every replica as failing
    (one was just killed while another is being dialled again after a restart). So it is asked
    again here, over a few seconds; within a job's planning, its stop ends the wait."""
    scope = call_scope()
    for n in range(1, attempts + 1):
        try:
            return attempt()
        except grpc.RpcError as exc:
            if not (exc.code() == grpc.StatusCode.UNAVAILABLE and n < attempts):
                raise error_from_rpc(exc, what) from None
            if scope is None:
                time.sleep(REPLICA_RETRY_S * n)
            elif scope.cancelled.wait(REPLICA_RETRY_S * n):
                scope.check()
    raise AssertionError("unreachable")


def _cancellable(method, request, timeout_s: float, scope: CancelScope):
    """`method(request)` as a future that `scope`'s cancel cancels: a job's planning stopped while
    the compile service builds for it (call_scope.cancels_calls) ends now, not once the build is
    done, and a scope cancelled already makes no call at all."""
    scope.check()
    future = method.future(request, timeout=timeout_s)
    unregister = scope.register(future.cancel)
    try:
        return future.result()
    except grpc.FutureCancelledError:
        raise Cancelled(scope.reason) from None
    finally:
        unregister()
