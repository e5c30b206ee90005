"""Typed domain errors. Domain code raises these; one server interceptor maps them to gRPC codes.

Messages name the field at fault and say what the caller should do instead. An error may also
carry a machine-readable `reason` (google.rpc.ErrorInfo, AIP-193) and the request `field` it is
about (google.rpc.BadRequest): programs branch on those, never on the message text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# ErrorInfo domain of every reason below.
DOMAIN = "accelmesh"

# ErrorInfo reasons a caller may act on (UPPER_SNAKE, stable; add, never rename).
TENSOR_NOT_HELD = "TENSOR_NOT_HELD"  # Execute: a referenced tensor is not held by this worker: send it in full
# SubmitJob/RunJob: the job could not start and its owner's places in the queue are all taken
# (ACCELMESH_MAX_QUEUED_PER_TENANT jobs, or ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT bytes of inputs)
QUEUE_FULL = "QUEUE_FULL"
# A new stream refused: the service holds as many open streams as it may, every caller together.
STREAM_LIMIT = "STREAM_LIMIT"
# A new stream refused: the caller's principal holds its share of the service's streams; close some.
STREAM_SHARE = "STREAM_SHARE"
# A request stream sent no message for the service's idle limit and was ended.
STREAM_IDLE = "STREAM_IDLE"
# A direct put or fetch at a worker refused: the dispatcher's ticket for it has expired; ask the
# dispatcher for a new one (security/tickets.py).
TICKET_EXPIRED = "TICKET_EXPIRED"
# A worker's object store is full past its wait (ACCELMESH_WORKER_STORE_BYTES): fetch or release
# earlier objects, or put them again later.
STORE_FULL = "STORE_FULL"


# How much of a client's value a message quotes: enough to recognise it, never so much that the
# status trailer outgrows gRPC's metadata limit (runtime/errors.py cuts whole messages as a backstop).
QUOTE_CHARS = 80


def quoted(value: object, limit: int = QUOTE_CHARS) -> str:
    """`value` as a message quotes it: its repr, or for a longer one the repr of its first `limit`
    characters (bytes, items) and its full size, e.g. `'abc...' (100000 chars)`.

    Use it for every value a message takes from a request (ids, names, keys, lists), so that
    neither a megabyte id nor a million-element list is echoed back in full."""
    if isinstance(value, (str, bytes, bytearray)):
        if len(value) <= limit:
            return repr(value)
        head = repr(bytes(value[:limit]) if isinstance(value, bytearray) else value[:limit])
        return f"{head[:-1]}...{head[-1]} ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
    size = f"{len(value)} items" if isinstance(value, Sequence) else ""  # lists, tuples, repeated fields
    text = repr(list(value[:limit]) if size else value)
    if len(text) <= limit and not (size and len(value) > limit):
        return text
    return f"{text[:limit]}... ({size or f'{len(text)} chars'})"


@dataclass(frozen=True)
class QuotaViolation:
    """A google.rpc.QuotaFailure violation: whose quota (`subject`, e.g. "principal:user:alice")
    and what it allows."""

    subject: str
    description: str


class AccelmeshError(Exception):
    """Base of every error that is the caller's or the environment's, not a bug."""

    def __init__(self, message: str, *, reason: str = "", field: str = "", metadata: Mapping[str, str] | None = None,
                 quota: QuotaViolation | None = None):
        super().__init__(message)
        self.reason = reason  # ErrorInfo.reason: one of the constants above, or "" for none
        self.field = field  # the request field at fault (a BadRequest field violation), or ""
        self.metadata = dict(metadata or {})  # ErrorInfo.metadata (with a reason): the limit, its variable
        self.quota = quota  # the QuotaFailure violation of a refusal past a quota, or None


class InvalidArgument(AccelmeshError):
    """The request is malformed: maps to INVALID_ARGUMENT."""


class NotFound(AccelmeshError):
    """A named thing does not exist: maps to NOT_FOUND."""


class FailedPrecondition(AccelmeshError):
    """The system is not in a state that allows the request: maps to FAILED_PRECONDITION."""


class ResourceExhausted(AccelmeshError):
    """No capacity (memory, devices, size limits): maps to RESOURCE_EXHAUSTED."""


class Unavailable(AccelmeshError):
    """A downstream service or node did not answer: maps to UNAVAILABLE."""


class AlreadyExists(AccelmeshError):
    """What the request would create exists already (and may not be replaced): maps to ALREADY_EXISTS."""


class Unauthenticated(AccelmeshError):
    """The caller did not prove who it is (no token, or one that does not verify): maps to UNAUTHENTICATED."""


class PermissionDenied(AccelmeshError):
    """The caller is known but its role may not do this: maps to PERMISSION_DENIED."""


class DeadlineExceeded(AccelmeshError):
    """The service's own time limit on the call passed (a request stream idle too long): maps to DEADLINE_EXCEEDED."""


class Cancelled(AccelmeshError):
    """The work was cancelled (CancelJob, the client's deadline or disconnect): maps to CANCELLED."""
