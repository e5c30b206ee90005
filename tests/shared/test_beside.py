"""runtime/beside.py: a call made beside the caller's runs in the caller's context and hands back
its answer or its error."""

from __future__ import annotations

import contextvars
import threading

import pytest

from accelmesh import errors
from accelmesh.runtime.beside import beside

SCOPE = contextvars.ContextVar("scope", default="none")


def test_a_call_beside_sees_the_callers_context_on_another_thread():
    token = SCOPE.set("job-7")
    try:
        seen = beside(lambda: (SCOPE.get(), threading.current_thread().name)).result(timeout=10)
    finally:
        SCOPE.reset(token)
    assert seen[0] == "job-7"
    assert seen[1] != threading.current_thread().name and seen[1].startswith("beside")


def test_a_call_beside_that_fails_raises_its_own_error_at_result():
    def refuse(name: str):
        raise errors.NotFound(f"program {name!r} is not registered")
    future = beside(refuse, "nope")
    with pytest.raises(errors.NotFound, match="'nope' is not registered"):
        future.result(timeout=10)
