"""The cancel scope of the control-plane calls made in a context: a job's planning runs under its
own, so a job stopped while the compile service builds for it ends then (clients/calls.py)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from dispatch_svc.dataplane.device_queues import CancelScope

# The scope whose cancel stops the control-plane calls made in this context (clients/calls.py): a job's
# planning runs under its own (`cancels_calls`), so a job stopped while the compile service builds for it
# (CancelJob, its client gone, its input refused) ends then, not once the build is done.
_CALL_SCOPE: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar("call_scope", default=None)


def call_scope() -> CancelScope | None:
    """The scope the control-plane calls made now are cancelled with, if any (`cancels_calls`)."""
    return _CALL_SCOPE.get()


@contextlib.contextmanager
def cancels_calls(scope: CancelScope) -> Iterator[None]:
    """Within the block, `scope`'s cancel cancels the control-plane call in flight and refuses the
    next ones (clients/calls.py). Only around a job's planning: its end's own calls (the release of its
    reservations, after its scope was cancelled) must still go out."""
    token = _CALL_SCOPE.set(scope)
    try:
        yield
    finally:
        _CALL_SCOPE.reset(token)
