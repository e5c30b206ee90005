"""Stopping every child on a signal: the StopGuard `accelmesh up` runs its mesh in, and the
ServiceGroup of children it stops together.

While a StopGuard is active, SIGTERM, SIGINT or SIGHUP at any moment stops every child started
meanwhile: start_service (launcher.py) spawns each inside `spawning_region()` and hands it to
`record_child` the moment it exists, and a signal arriving while a child is being spawned waits
until it is recorded. The main thread waits in slices (`wait_event`), so that no signal is sat out.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # launcher.py imports this module: the type alone, to keep the imports one-way
    from accelmesh.runtime.launcher import ServiceProcess

STOP_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The longest the main thread sleeps in one go while waiting for a child. A signal can land on
# another thread, or just before the main thread goes to sleep; CPython then runs the handler only
# when the main thread next wakes, so an unbounded wait may never see it (seen under load:
# `accelmesh up` sat out a SIGINT in Event.wait()).
SIGNAL_CHECK_S = 0.2


def wait_event(event: threading.Event, timeout_s: float | None) -> bool:
    """`event.wait(timeout_s)` in slices of SIGNAL_CHECK_S, so pending signal handlers run between them."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = SIGNAL_CHECK_S if deadline is None else min(SIGNAL_CHECK_S, deadline - time.monotonic())
        if remaining <= 0:
            return event.is_set()
        if event.wait(remaining):
            return True


class ServiceGroup:
    """Children started together: stopped together (newest first), and which of them ended unasked."""

    def __init__(self):
        self._lock = threading.Lock()
        self._children: list[ServiceProcess] = []
        self._ended: list[ServiceProcess] = []
        self._ended_event = threading.Event()

    @property
    def children(self) -> list[ServiceProcess]:
        return list(self._children)

    def add(self, service: ServiceProcess) -> None:
        with self._lock:
            self._children.append(service)
        service.on_exit(self._note_exit)

    def wait_for_exit(self, timeout: float | None = None) -> ServiceProcess | None:
        """The first child that exited without being asked to; blocks until one does (or `timeout`)."""
        wait_event(self._ended_event, timeout)
        with self._lock:
            return self._ended[0] if self._ended else None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        for service in reversed(self.children):
            service.terminate(grace_s)

    def kill_now(self) -> None:
        """SIGKILL to every child, waiting for none. Takes no lock, so a signal handler may call it."""
        for service in list(self._children):
            service.kill_now()

    def _note_exit(self, service: ServiceProcess) -> None:
        if not service.stop_requested:
            with self._lock:
                self._ended.append(service)
            self._ended_event.set()


class StopSignal(BaseException):
    """Raised in the main thread by the first stop signal a StopGuard receives. A BaseException, like
    KeyboardInterrupt, so that `except Exception` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


_active_guard: StopGuard | None = None


class StopGuard:
    """While active, every child that start_service starts (from any thread) is in `children`, and
    the first SIGTERM, SIGINT or SIGHUP (unless ignored already) raises StopSignal in the main
    thread. On leaving, every child is stopped (newest first, `grace_s` each before SIGKILL),
    whatever the reason; a StopSignal is swallowed there (`signum` says which). Once stopping
    (from the first signal, or on leaving for any other reason), a signal does not raise (that
    would cut the stop short) but SIGKILLs every child at once: a second Ctrl-C means now.

    Enter it in the main thread before the first child starts (until then the default handlers
    run, and SIGTERM would end the launcher there and then); one use per guard.
    """

    def __init__(self, grace_s: float = STOP_GRACE_S):
        self.children = ServiceGroup()
        self.grace_s = grace_s  # each child's, on leaving, between SIGTERM and SIGKILL
        self.signum: int | None = None  # the signal that ended the guarded block, if one did
        self._stopping = False
        self._deferring = 0
        self._pending: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopGuard:
        global _active_guard
        if _active_guard is not None:
            raise RuntimeError("a StopGuard is active already; children would be stopped twice")
        # An ignored signal stays ignored: `nohup accelmesh up` must outlive its terminal.
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS
                          if signal.getsignal(signum) is not signal.SIG_IGN}
        _active_guard = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _active_guard
        self._stopping = True
        try:
            self.children.stop(self.grace_s)
        finally:
            _active_guard = None
            for signum, handler in self._previous.items():
                if handler is not None:  # None: set outside Python, cannot be put back
                    signal.signal(signum, handler)
        return isinstance(exc, StopSignal)

    @contextlib.contextmanager
    def deferred(self):
        """A stop signal arriving inside is raised when it ends, e.g. once a new child is recorded."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            pending = None if self._deferring else self._pending
            if pending is not None:
                self._pending = None
                if not self._stopping:
                    self._raise(pending)  # also over an exception the region raised: the stop was asked first

    def _handle(self, signum: int, _frame) -> None:
        if self._stopping:
            self.children.kill_now()
        elif self._deferring:
            self._pending = self._pending or signum
        else:
            self._raise(signum)

    def _raise(self, signum: int) -> None:
        self._stopping, self.signum = True, signum
        raise StopSignal(signum)


def spawning_region():
    """Where a new child is spawned and recorded, a stop signal must wait (else it leaks); only the
    main thread runs signal handlers, so only it needs to defer them."""
    guard = _active_guard
    if guard is None or threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()
    return guard.deferred()


def record_child(service: ServiceProcess) -> None:
    """A child that now exists joins the active StopGuard's children, if a guard is active."""
    guard = _active_guard
    if guard is not None:
        guard.children.add(service)
