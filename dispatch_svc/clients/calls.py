"""One unary call to a control-plane service, its error as the domain's: what every client here
shares. A call to a service that may run as replicas is retried on another one (`replicated`). A
call made while a job plans is cancelled with the job (dispatch_svc.dataplane.device_queues.cancels_calls)."""

from __future__ import annotations

import time

import grpc

from accelmesh.runtime.errors import error_from_rpc
from dispatch_svc.dataplane.device_queues import Cancelled, CancelScope, call_scope

CALL_TIMEOUT_S = 120.0
# A call to replicas that every replica failed (gRPC retried it already) is asked again up to this
# many times in all, 0.5 s, 1 s, then 1.5 s later: longer than a replica back up takes to be
# dialled again (runtime/channels.py caps that backoff at a second).
REPLICA_ATTEMPTS, REPLICA_RETRY_S = 4, 0.5


def call(what: str, method, request, *, replicated: bool = False, timeout_s: float = CALL_TIMEOUT_S):
    """`method(request)`, a failure raised as the domain error of its status (`what` names the
    service in the message). `replicated`: an idempotent call to a service that may run as
    replicas. gRPC retries it on another replica at once (runtime/channels.py); while the channel
    still counts every replica as failing (one was just killed while another is being dialled
    again after a restart), it is asked again here, over a few seconds."""
    scope = call_scope()
    for attempt in range(1, REPLICA_ATTEMPTS + 1):
        try:
            return method(request, timeout=timeout_s) if scope is None else _cancellable(method, request, timeout_s,
                                                                                         scope)
        except grpc.RpcError as exc:
            if not (replicated and exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < REPLICA_ATTEMPTS):
                raise error_from_rpc(exc, what) from None
            if scope is None:
                time.sleep(REPLICA_RETRY_S * attempt)
            elif scope.cancelled.wait(REPLICA_RETRY_S * attempt):
                scope.check()
    raise AssertionError("unreachable")


def _cancellable(method, request, timeout_s: float, scope: CancelScope):
    """`method(request)` as a future that `scope`'s cancel cancels: a job's planning stopped while
    the compile service builds for it (device_queues.cancels_calls) ends now, not once the build is
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
