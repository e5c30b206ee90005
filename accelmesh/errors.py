"""Typed domain errors. Domain code raises these; one server interceptor maps them to gRPC codes.

Messages name the field at fault and say what the caller should do instead.
"""


class AccelmeshError(Exception):
    """Base of every error that is the caller's or the environment's, not a bug."""


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
