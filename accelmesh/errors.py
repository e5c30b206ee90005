"""Typed domain errors. Domain code raises these; one server interceptor maps them to gRPC codes.

Messages name the field at fault and say what the caller should do instead. An error may also
carry a machine-readable `reason` (google.rpc.ErrorInfo, AIP-193) and the request `field` it is
about (google.rpc.BadRequest): programs branch on those, never on the message text.
"""

# ErrorInfo domain of every reason below.
DOMAIN = "accelmesh"

# ErrorInfo reasons a caller may act on (UPPER_SNAKE, stable; add, never rename).
TENSOR_NOT_HELD = "TENSOR_NOT_HELD"  # Execute: a referenced tensor is not held by this worker: send it in full


class AccelmeshError(Exception):
    """Base of every error that is the caller's or the environment's, not a bug."""

    def __init__(self, message: str, *, reason: str = "", field: str = ""):
        super().__init__(message)
        self.reason = reason  # ErrorInfo.reason: one of the constants above, or "" for none
        self.field = field  # the request field at fault (a BadRequest field violation), or ""


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
