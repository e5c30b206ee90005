"""Start mesh processes and wait until they serve: used by `accelmesh up`, the demo and tests.

Each service prints one ready line, `accelmesh: <name> listening on <host>:<port>`, after it
binds; binding port 0 and reading that line avoids port races between parallel test runs.

A child's output is drained for its whole life, as bytes (a line that is not UTF-8 is decoded
with replacement characters, never fatal), so a child never blocks on a full pipe; only a bounded
tail is kept, for error messages. A child that exits after its ready line without being asked to
is logged with its exit code and output tail, and the ServiceGroups holding it hear of it.

While a StopGuard is active (`accelmesh up`), SIGTERM, SIGINT or SIGHUP at any moment stops every
child started meanwhile: each is recorded the moment it exists, and a signal arriving while a
child is being spawned waits until it is recorded. As a backstop should the launcher itself be
SIGKILLed, a child started from the main thread gets PR_SET_PDEATHSIG (Linux), so the kernel sends
it SIGTERM when the launcher dies; such a child also runs in its own process group, so a terminal's
Ctrl-C reaches only the launcher, which stops the children in order. (PDEATHSIG fires when the
*thread* that spawned the child ends, so a child spawned from another thread gets neither and stays
in the launcher's group, where the terminal's signals still reach it.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from accelmesh import errors

log = logging.getLogger(__name__)

READY = re.compile(r"accelmesh: (?P<name>[\w-]+) listening on (?P<address>\S+)")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# Lines of a child's output kept for error messages (older ones are dropped, so a long-lived
# mesh does not grow): enough for a few tracebacks and the log lines around an incident id.
OUTPUT_TAIL_LINES = 1000
# A longer line is kept as several: bounds the tail at OUTPUT_TAIL_LINES * MAX_LINE_BYTES a child.
MAX_LINE_BYTES = 8192
ERROR_TAIL_LINES = 20  # lines of the tail an error message quotes
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The longest the main thread sleeps in one go while waiting for a child. A signal can land on
# another thread, or just before the main thread goes to sleep; CPython then runs the handler only
# when the main thread next wakes, so an unbounded wait may never see it (seen under load:
# `accelmesh up` sat out a SIGINT in Event.wait()).
SIGNAL_CHECK_S = 0.2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ready_line(name: str, host: str, port: int) -> str:
    return f"accelmesh: {name} listening on {host}:{port}"


def _wait(event: threading.Event, timeout_s: float | None) -> bool:
    """`event.wait(timeout_s)` in slices of SIGNAL_CHECK_S, so pending signal handlers run between them."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = SIGNAL_CHECK_S if deadline is None else min(SIGNAL_CHECK_S, deadline - time.monotonic())
        if remaining <= 0:
            return event.is_set()
        if event.wait(remaining):
            return True


class ServiceProcess:
    """One child service: its process, the address its ready line named, the tail of its output."""

    def __init__(self, name: str, process: subprocess.Popen, *, own_group: bool = False, echo: bool = False):
        self.name = name
        self.process = process
        self.address = ""  # from the ready line; "" until it came
        self._own_group = own_group
        self._echo = echo
        self._tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self._ready = threading.Event()  # the ready line came, or the output ended
        self._ended = False  # the output ended and the exit code is known (callbacks run from then)
        self._exited = threading.Event()  # ... and the exit was reported
        self._stop_requested = False
        self._lock = threading.Lock()
        self._on_exit: list[Callable[[ServiceProcess], None]] = []
        threading.Thread(target=self._drain, name=f"{name}-output", daemon=True).start()

    @property
    def output(self) -> list[str]:
        """The kept tail of the output (the last OUTPUT_TAIL_LINES lines), oldest first."""
        return list(self._tail)

    @property
    def stop_requested(self) -> bool:
        """Whether this launcher asked it to stop (terminate, kill): its exit is then no news."""
        return self._stop_requested

    def tail(self, lines: int = ERROR_TAIL_LINES) -> str:
        return "\n".join(list(self._tail)[-lines:])

    def wait_exited(self, timeout: float | None = None) -> bool:
        """Whether, within `timeout`, the child exited, its output was drained to the end and its
        exit was reported (logged if unasked, and told to its groups)."""
        return self._exited.wait(timeout)

    def exit_status(self) -> str:
        """'exited with code 3', 'was killed by SIGKILL' or 'is running'."""
        code = self.process.returncode
        if code is None:
            return "is running"
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"

    def exit_message(self) -> str:
        tail = self.tail()
        return (f"{self.name} (pid {self.process.pid}) {self.exit_status()}; "
                + (f"its last output:\n{tail}" if tail else "it printed nothing"))

    def on_exit(self, callback: Callable[[ServiceProcess], None]) -> None:
        """Call `callback(self)` once the child has exited (at once if it has)."""
        with self._lock:
            if not self._ended:
                self._on_exit.append(callback)
                return
        callback(self)

    def terminate(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, then SIGKILL (to its whole group) if it is still running after `grace_s`."""
        self._stop_requested = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        self.kill_now()
        self.process.wait()

    def kill_now(self) -> None:
        """SIGKILL without waiting. Takes no lock, so a signal handler may call it."""
        self._stop_requested = True
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if self._own_group:
                    os.killpg(self.process.pid, signal.SIGKILL)
                else:
                    os.kill(self.process.pid, signal.SIGKILL)

    def _wait_ready(self, timeout_s: float) -> None:
        if not _wait(self._ready, timeout_s) or not self.address:
            self.kill()
            raise errors.Unavailable(f"{self.name} did not start (exit code {self.process.returncode}); "
                                     f"its output:\n{self.tail()}")

    def _drain(self) -> None:
        try:
            while raw := self.process.stdout.readline(MAX_LINE_BYTES):
                self._take(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        finally:
            self.process.stdout.close()
            self.process.wait()
            was_ready = self._ready.is_set()
            self._ready.set()  # ended before its ready line: stop waiting
            with self._lock:
                self._ended = True
                callbacks, self._on_exit = self._on_exit, []
            if was_ready and not self._stop_requested:  # before the ready line, start_service raises instead
                log.warning("accelmesh: %s", self.exit_message())
            for callback in callbacks:
                callback(self)
            self._exited.set()  # last: whoever waits for it finds the exit reported

    def _take(self, line: str) -> None:
        self._tail.append(line)
        if self._echo:
            try:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # our stderr is gone (a closed pipe): keep draining, stop echoing
                self._echo = False
        match = READY.search(line)
        if match and not self._ready.is_set():
            self.address = match["address"]
            self._ready.set()


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
        _wait(self._ended_event, timeout)
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


def _spawning_region():
    """Where a new child is spawned and recorded, a stop signal must wait (else it leaks); only the
    main thread runs signal handlers, so only it needs to defer them."""
    guard = _active_guard
    if guard is None or threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()
    return guard.deferred()


# Run as `python -I -S -c _DIE_WITH_PARENT <parent pid> <command...>`: asks the kernel for SIGTERM
# when the parent dies (PR_SET_PDEATHSIG, kept across exec), then execs the command in place, so
# the pid is the service's. A separate step, not a preexec_fn: that would fork the launcher without
# exec'ing, which is unsafe (and warned about) in a multithreaded process such as one that runs JAX.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the parent died before prctl took effect\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def start_service(
    name: str, module: str, args: Sequence[str], *, env: dict[str, str] | None = None, echo: bool = False,
    prefix: Sequence[str] = (),
) -> ServiceProcess:
    """Run `[prefix...] python -m module args...`; return once it printed its ready line.

    `prefix` runs the service through another command that execs it, e.g. `ip netns exec <ns>`.
    The child is killed if it does not start in START_TIMEOUT_S, and stopped if anything (a
    StopSignal, KeyboardInterrupt) interrupts the wait.
    """
    proc_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    command = [*prefix, sys.executable, "-m", module, *args]
    # PDEATHSIG fires when the spawning *thread* ends: only a child of the main thread may have it.
    die_with_us = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
    if die_with_us:
        command = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
    service = None
    try:
        with _spawning_region():
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=proc_env,
                process_group=0 if die_with_us else None,
            )
            service = ServiceProcess(name, process, own_group=die_with_us, echo=echo)
            guard = _active_guard
            if guard is not None:
                guard.children.add(service)
        service._wait_ready(START_TIMEOUT_S)
    except BaseException:
        if service is not None:
            service.terminate()
        raise
    return service
