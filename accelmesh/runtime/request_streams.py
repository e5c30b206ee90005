"""A request stream that may not go quiet: `IdleBounded` ends it once its client sends nothing for
`idle_s` while the server waits for its next message.

grpcio's request iterator blocks until a message comes, with no timeout, so a client that opens an
upload and sends nothing holds the call (its thread, its stream slot, what its job reserved)
until its own deadline, if it set one. Here a thread of the call's own reads the client's
messages one ahead into a single slot, and the handler waits on that slot with the idle limit;
past it the handler gets the error `on_idle` makes (a typed error, so the client gets that
status and the job ends as any failed job does). Time counts only while the handler waits for a
message: a handler busy elsewhere (planning, a full in-flight budget) never makes its client
idle, and a stream whose client has closed its sending side is never cut. The reading thread
ends with the call: once the handler has answered, grpcio ends the request iterator too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_EMPTY, _END = object(), object()


class IdleBounded:
    """`requests`, ended with `on_idle()` raised when the next message takes over `idle_s` to come."""

    def __init__(self, requests: Iterator, idle_s: float, on_idle: Callable[[], BaseException], *, name: str = ""):
        self._requests, self._idle_s, self._on_idle = requests, idle_s, on_idle
        self._ready = threading.Condition()
        self._slot: Any = _EMPTY  # a message, _END, or the exception that ended the stream
        self._closed = False
        self._failure: BaseException | None = None
        self._reader: threading.Thread | None = None
        self._name = name or "request-reader"

    def __iter__(self) -> IdleBounded:
        return self

    def __next__(self) -> Any:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name=self._name, daemon=True)
            self._reader.start()
        with self._ready:
            deadline = time.monotonic() + self._idle_s
            while self._slot is _EMPTY and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._failure = self._on_idle()
                    self._closed = True
                    self._ready.notify_all()
                    break
                self._ready.wait(left)
            if self._failure is not None:
                raise self._failure
            taken, self._slot = self._slot, _EMPTY
            self._ready.notify_all()
        if taken is _END:
            with self._ready:
                self._slot = _END  # every later call ends too
            raise StopIteration
        if isinstance(taken, BaseException):
            with self._ready:
                self._failure = taken
            raise taken
        return taken

    def close(self) -> None:
        """The call ended: a reader waiting for room in the slot drops what it read and ends. One
        reading from grpcio gets the call's end from it (a cancel is an RpcError) and hands that
        on, so a handler still waiting sees the stream end as it would without this wrapper."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _read(self) -> None:
        while True:
            try:
                item = next(self._requests)
            except StopIteration:
                item = _END
            except BaseException as exc:  # noqa: BLE001 - handed to the handler, whose error it is
                item = exc
            with self._ready:
                while self._slot is not _EMPTY and not self._closed:
                    self._ready.wait()
                if self._slot is not _EMPTY:  # closed, and the handler never took the last one
                    return
                self._slot = item
                self._ready.notify_all()
            if item is _END or isinstance(item, BaseException):
                return


__all__ = ["IdleBounded"]
