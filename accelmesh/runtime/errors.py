"""One server interceptor that turns typed domain errors into gRPC status codes.

Servicers stay free of status-code plumbing: they raise accelmesh.errors types (or let a bug
escape) and this maps them. Anything untyped is a bug: the caller gets INTERNAL with a generic
message and an incident id, the log gets the traceback under the same id.

Every status carries google.rpc details (AIP-193, through grpcio-status) in its trailers: an
ErrorInfo with the error's reason (domain "accelmesh") when it has one, and a BadRequest field
violation when it names the request field at fault. `error_reason` reads the reason back.
Whatever a message quotes, the trailers stay within gRPC's metadata limit (see `bounded`).
"""

from __future__ import annotations

import logging
import traceback
import uuid

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from accelmesh import errors
from accelmesh.runtime.handlers import rewrapped
from accelmesh.runtime.tensors import serialized_or

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[errors.AccelmeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


# A downstream service refusing this service's own credentials is a fault of the mesh, not of the
# caller: it stays UNAVAILABLE with the reason, rather than telling the caller it was denied. A
# downstream deadline is this service's wait running out, not the caller's: also UNAVAILABLE.
_NOT_PASSED_ON = (errors.Unavailable, errors.Unauthenticated, errors.PermissionDenied, errors.DeadlineExceeded)
_DOWNSTREAM_KEPT = {code: error_type for error_type, code in STATUS_BY_ERROR.items()
                    if error_type not in _NOT_PASSED_ON}


def error_from_rpc(exc: grpc.RpcError, what: str) -> errors.AccelmeshError:
    """A downstream service's status as the typed error it stands for, so its meaning carries on
    (its INVALID_ARGUMENT is the caller's too). Any other status (the service down, a deadline,
    its own bug) means `what` is unavailable; the message then names `what` and the status."""
    kind = _DOWNSTREAM_KEPT.get(exc.code())
    if kind is None:
        return errors.Unavailable(f"{what}: {exc.code().name}: {exc.details()}")
    return kind(exc.details(), reason=error_reason(exc))


def error_reason(exc: grpc.RpcError) -> str:
    """The ErrorInfo reason a failed call carries (accelmesh.errors constants), or ""."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, ValueError):  # not a call, or trailers that disagree with the status
        return ""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


# The backstop behind accelmesh.errors.quoted: a status whose message quotes a request's values
# in full (a 100 kB id) would make the trailers bigger than any client accepts (gRPC's metadata
# limit is 8 KiB by default, 16 KiB at most) and the caller would get RESOURCE_EXHAUSTED
# "metadata size exceeds" instead of this status. Every message, field and handler-chosen detail
# is cut to these many bytes of UTF-8, with a note of what was cut. The worst case then fits in
# the default 8 KiB: grpc-message (percent-encoded: <= 3 x 1 KiB) plus the google.rpc.Status
# in grpc-status-details-bin (base64 of the message, the field and its violation description:
# <= 4/3 x 2.3 KiB).
MAX_MESSAGE_BYTES = 1024
MAX_FIELD_BYTES = 256  # a BadRequest field path (it may hold a client's key, "held[<key>].key")


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, or its first bytes and how many more there were when it is over `limit`."""
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= limit:
        return message
    kept = encoded[: max(limit - 40, 0)].decode("utf-8", "ignore")
    return f"{kept}... ({len(encoded) - len(kept.encode())} more bytes)"


def status_details(code: grpc.StatusCode, message: str, exc: BaseException) -> status_pb2.Status:
    """The google.rpc.Status sent for `exc`: its code and message, its reason (and the reason's
    metadata), its field and its quota violation."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    reason, field = getattr(exc, "reason", ""), bounded(getattr(exc, "field", ""), MAX_FIELD_BYTES)
    if reason:
        metadata = {key: bounded(value, MAX_FIELD_BYTES) for key, value in getattr(exc, "metadata", {}).items()}
        status.details.append(_packed(error_details_pb2.ErrorInfo(reason=reason, domain=errors.DOMAIN,
                                                                  metadata=metadata)))
    quota = getattr(exc, "quota", None)
    if quota is not None:
        violation = error_details_pb2.QuotaFailure.Violation(subject=bounded(quota.subject, MAX_FIELD_BYTES),
                                                             description=bounded(quota.description, MAX_FIELD_BYTES))
        status.details.append(_packed(error_details_pb2.QuotaFailure(violations=[violation])))
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        status.details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    return status


def _packed(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for error_type, code in STATUS_BY_ERROR.items():
        if isinstance(exc, error_type):
            return code, str(exc)
    incident = uuid.uuid4().hex[:12]
    log.error("unexpected error (incident %s)", incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); the service log has the details"


def abort(context: grpc.ServicerContext, exc: Exception) -> None:
    """End the call with the status `exc` stands for (raises): for refusals made outside this
    interceptor (admission, which runs before it)."""
    _abort(context, exc)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    if context.code() is not None:
        # The handler already chose a status with context.abort(); keep it, within the bound.
        details = context.details() or b""
        if len(details) > MAX_MESSAGE_BYTES:
            text = details.decode("utf-8", "replace") if isinstance(details, bytes) else details
            context.set_details(bounded(text))
        raise exc
    code, message = status_for(exc)
    message = bounded(message)
    # The error's frames hold what the handler was working on (a job's input blocks, a shard's
    # tensors), and an error that reaches a reference cycle (grpcio keeps a call's errors in its
    # state, which its frames reference: the worker's 550 MB to 7.7 GB) keeps them until a full
    # garbage collection. The status is made; the traceback's locals go (running frames stay).
    traceback.clear_frames(exc.__traceback__)
    # abort_with_status alone bypasses the tracing interceptor's record of the status; these
    # two calls let the server span carry the code and message the caller gets.
    context.set_code(code)
    context.set_details(message)
    context.abort_with_status(rpc_status.to_status(status_details(code, message, exc)))


def _wrap_unary(behavior):
    def handle(request, context):
        try:
            return behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            _abort(context, exc)

    return handle


def _wrap_streaming(behavior):
    def handle(request, context):
        try:
            yield from behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            _abort(context, exc)

    return handle


# The library's health servicer raises no domain errors, and its Watch is non-blocking only when
# the server calls it with a response callback, which a wrapper would take away: each watcher
# would then hold a server thread for as long as it watches.
_UNWRAPPED_PREFIXES = ("/grpc.health.v1.Health/",)


class ErrorInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNWRAPPED_PREFIXES):
            return handler
        return rewrapped(handler, lambda behavior, _, server_streams:
                         _wrap_streaming(behavior) if server_streams else _wrap_unary(behavior))


class _Undecodable:
    """A request message that did not parse, handed on in place of the message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - the parser's error types vary with its implementation
            return _Undecodable(exc)

    return deserialize


def _refuse(method: str, deserializer, undecodable: _Undecodable) -> errors.InvalidArgument:
    owner = getattr(deserializer, "__self__", None)  # X.FromString: the message class
    kind = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "") or f"the request of {method}"
    error = undecodable.error
    return errors.InvalidArgument(f"the request bytes are not a valid {kind}: {type(error).__name__}: {error}")


class DecodeInterceptor(grpc.ServerInterceptor):
    """Requests that do not parse become INVALID_ARGUMENT, raised where the handler takes the
    message (so after the access check), instead of failing in gRPC's own deserializing code:
    that answers INTERNAL, and grpcio (1.85) then keeps the call's state for good, about 16 KiB
    for each such request. Innermost, so every interceptor outside sees the same deserializer.
    A response a handler made already serialized (tensor chunks, tensors.split_frames) is sent
    as it is (tensors.serialized_or)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or method.startswith(_UNWRAPPED_PREFIXES):
            return handler
        deserializer = handler.request_deserializer

        def checked(request):
            if isinstance(request, _Undecodable):
                raise _refuse(method, deserializer, request)
            return request

        def each(requests):
            for request in requests:
                yield checked(request)

        def wrap(behavior, client_streams: bool, server_streams: bool):
            take = each if client_streams else checked
            if server_streams:
                def wrapped(request, context):
                    yield from behavior(take(request), context)
            else:
                def wrapped(request, context):
                    return behavior(take(request), context)
            return wrapped

        serializer = handler.response_serializer
        return rewrapped(handler, wrap, request_deserializer=_tolerant(deserializer),
                         response_serializer=serialized_or(serializer) if serializer is not None else None)
