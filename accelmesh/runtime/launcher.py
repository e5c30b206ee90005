"""Start mesh processes and wait until they serve: used by `accelmesh up`, the demo and tests.

Each service prints one ready line, `accelmesh: <name> listening on <host>:<port>`, after it
binds; binding port 0 and reading that line avoids port races between parallel test runs.

A child's output is drained for its whole life, as bytes (a line that is not UTF-8 is decoded
with replacement characters, never fatal), so a child never blocks on a full pipe; only a bounded
tail is kept, for error messages. A child that exits after its ready line without being asked to
is logged with its exit code and output tail, and the ServiceGroups holding it hear of it.

While a StopGuard (stopping.py) is active, as in `accelmesh up`, a stop signal at any moment stops
every child started meanwhile. As a backstop should the launcher itself be SIGKILLed, a child
started from the main thread gets PR_SET_PDEATHSIG (Linux), so the kernel sends it SIGTERM when
the launcher dies; such a child also runs in its own process group, so a terminal's Ctrl-C
reaches only the launcher, which stops the children in order. (PDEATHSIG fires when the *thread*
that spawned the child ends, so a child spawned from another thread gets neither and stays in the
launcher's group, where the terminal's signals still reach it.)
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
from collections import deque
from collections.abc import Callable, Sequence

from accelmesh import errors
from accelmesh.runtime.stopping import (
    STOP_GRACE_S,
    record_child,
    spawning_region,
    wait_event,
)

log = logging.getLogger(__name__)

READY = re.compile(r"accelmesh: (?P<name>[\w-]+) listening on (?P<address>\S+)")
START_TIMEOUT_S = 60.0
# Lines of a child's output kept for error messages (older ones are dropped, so a long-lived
# mesh does not grow): enough for a few tracebacks and the log lines around an incident id.
OUTPUT_TAIL_LINES = 1000
# A longer line is kept as several: bounds the tail at OUTPUT_TAIL_LINES * MAX_LINE_BYTES a child.
MAX_LINE_BYTES = 8192
ERROR_TAIL_LINES = 20  # lines of the tail an error message quotes
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ready_line(name: str, host: str, port: int) -> str:
    return f"accelmesh: {name} listening on {host}:{port}"


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
        if not wait_event(self._ready, timeout_s) or not self.address:
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
        with spawning_region():
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=proc_env,
                process_group=0 if die_with_us else None,
            )
            service = ServiceProcess(name, process, own_group=die_with_us, echo=echo)
            record_child(service)
        service._wait_ready(START_TIMEOUT_S)
    except BaseException:
        if service is not None:
            service.terminate()
        raise
    return service
