"""Start mesh processes and wait until they serve: used by `accelmesh up`, the demo and tests.

Each service prints one ready line, `accelmesh: <name> listening on <host>:<port>`, after it
binds; binding port 0 and reading that line avoids port races between parallel test runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from accelmesh import errors

READY = re.compile(r"accelmesh: (?P<name>[\w-]+) listening on (?P<address>\S+)")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def ready_line(name: str, host: str, port: int) -> str:
    return f"accelmesh: {name} listening on {host}:{port}"


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    address: str
    output: list[str] = field(default_factory=list)

    def terminate(self, grace_s: float = STOP_GRACE_S) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_service(
    name: str, module: str, args: Sequence[str], *, env: dict[str, str] | None = None, echo: bool = False,
    prefix: Sequence[str] = (),
) -> ServiceProcess:
    """Run `[prefix...] python -m module args...`; return once it printed its ready line.

    `prefix` runs the service through another command that execs it, e.g. `ip netns exec <ns>`.
    """
    proc_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=proc_env,
    )
    output: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def pump():
        for line in process.stdout:
            output.append(line.rstrip("\n"))
            if echo:
                print(f"[{name}] {line}", end="", file=sys.stderr)
            match = READY.search(line)
            if match and not ready.is_set():
                found["address"] = match["address"]
                ready.set()
        ready.set()  # process ended: stop waiting

    threading.Thread(target=pump, name=f"{name}-output", daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or "address" not in found:
        process.kill()
        process.wait()
        tail = "\n".join(output[-20:])
        raise errors.Unavailable(f"{name} did not start (exit code {process.returncode}); its output:\n{tail}")
    return ServiceProcess(name, process, found["address"], output)
