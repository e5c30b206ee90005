"""The launcher (accelmesh/runtime/launcher.py, stopping.py) and `accelmesh up`, as real processes: a child's
output is drained whatever its bytes and only a tail is kept; a child that exits after start-up is
reported; a signal at any moment of start-up or running stops every child, leaving no process and
no listening port behind.

Fake children (_launcher_children.py) keep most cases to a second or so; a few run the real
`accelmesh up`. Every process a test causes names the test's temporary folder on its command line:
tests wait for what they can observe (a line of output, processes in /proc), never for a time,
and whatever is left is killed at teardown, also when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _launcher_children import MODULE, NOT_UTF8, child_env

from accelmesh.inventory.v1.inventory_service_pb2 import ListNodesRequest
from accelmesh.inventory.v1.inventory_service_pb2_grpc import InventoryServiceStub
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.launcher import MAX_LINE_BYTES, OUTPUT_TAIL_LINES, start_service
from accelmesh.runtime.stopping import ServiceGroup
from accelmesh.security.credentials import MeshCredentials

DEADLINE_S = 60.0  # generous: a deadline for what must happen, not a pause
# The real mesh starts four services one after another, each allowed START_TIMEOUT_S (60 s).
UP_DEADLINE_S = 300.0
POLL_S = 0.05  # between looks at /proc while waiting for processes to go
PORT = re.compile(r"listening on [\d.]+:(\d+)")
STARTED = re.compile(r"started: pid (\d+) pgid (\d+) pdeathsig (\d+)")


def processes_naming(tag: str) -> set[int]:
    """Live processes with `tag`, or a path under it, among their arguments (a zombie has none)."""
    folder, found = tag.encode(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                arguments = (entry / "cmdline").read_bytes().split(b"\0")
                if any(a == folder or a.startswith(folder + b"/") for a in arguments):
                    found.add(int(entry.name))
    return found


def wait_until_gone(tag: str) -> set[int]:
    deadline = time.monotonic() + DEADLINE_S
    while (left := processes_naming(tag)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def assert_ports_free(ports: list[int]) -> None:
    """A port still held by a listener cannot be bound again (the next `accelmesh up` would fail)."""
    assert ports, "no ready line named a port"
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
            probe.listen()


@pytest.fixture(name="tag")
def tag_fixture(tmp_path):
    yield str(tmp_path)
    for pid in processes_naming(str(tmp_path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# What a terminal gives a command it runs: the stop signals at their defaults. A test run started in
# the background (`make test &`, nohup) hands its children SIGINT and SIGHUP ignored, and a launcher
# rightly keeps an ignore it inherited (`nohup accelmesh up` outlives its terminal), so without this
# the signal tests would test how the suite was started.
DEFAULT_SIGNALS = ("import os, signal, sys\n"
                   "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)\n"
                   "os.execv(sys.argv[1], sys.argv[1:])")


class Watched:
    """A process whose merged output is collected line by line, so a test can wait for a line."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, deadline_s: float = DEADLINE_S):
        self.deadline_s = deadline_s
        argv = [sys.executable, "-c", DEFAULT_SIGNALS, *argv]  # the same process, execed: same pid, same args
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.process.stdout:
            for raw in self.process.stdout:
                with self._changed:
                    self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_line(self, text: str) -> str:
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(text in line for line in self.lines) or self._done, self.deadline_s)
            line = next((line for line in self.lines if text in line), None)
        assert found and line is not None, f"no line with {text!r}; the output:\n{self.output}"
        return line

    def finish(self) -> int:
        """Its exit code, once it exited and its output was read to the end."""
        try:
            code = self.process.wait(self.deadline_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {self.deadline_s:.0f} s; its output:\n{self.output}") from None
        with self._changed:
            assert self._changed.wait_for(lambda: self._done, self.deadline_s)
        return code

    def ports(self) -> list[int]:
        return [int(m[1]) for line in self.lines if "listening on" in line and (m := PORT.search(line))]


def launch(tag: str, *specs: str, grace_s: float | None = None) -> Watched:
    grace = ["--grace", str(grace_s)] if grace_s is not None else []
    return Watched([sys.executable, "-m", MODULE, "launch", tag, *grace, *specs], env=child_env())


def child(name: str, tag: str, *flags: str):
    return start_service(name, MODULE, ["child", name, tag, *flags], env=child_env())


def test_a_child_printing_bytes_that_are_not_utf8_is_drained_to_the_end_and_only_a_tail_kept(tag):
    # 20,000 lines (2 MB) after the bad bytes: far more than a pipe holds, so the child can only
    # finish if the launcher kept reading after them.
    service = child("noisy", tag, "--bad", "--spam", "20000", "--exit", "0")
    try:
        assert service.wait_exited(DEADLINE_S), f"still blocked writing; its last output:\n{service.tail()}"
    finally:
        service.terminate()
    assert service.process.returncode == 0 and service.address.startswith("127.0.0.1:")
    assert service.output[-3:] == [NOT_UTF8.decode("utf-8", errors="replace"), "noisy spam done", "noisy giving up"]
    assert len(service.output) == OUTPUT_TAIL_LINES


def test_a_line_longer_than_the_limit_is_kept_as_bounded_pieces(tag):
    service = child("long", tag, "--long", str(3 * MAX_LINE_BYTES + 5), "--exit", "0")
    try:
        assert service.wait_exited(DEADLINE_S)
    finally:
        service.terminate()
    assert [len(line) for line in service.output if set(line) == {"x"}] == [MAX_LINE_BYTES] * 3 + [5]
    assert service.output[-1] == "long giving up"


def test_a_child_that_exits_after_its_ready_line_is_reported_with_its_code_and_last_output(tag, caplog):
    group = ServiceGroup()
    service = child("failing", tag, "--exit", "3")
    group.add(service)
    assert group.wait_for_exit(DEADLINE_S) is service
    assert service.wait_exited(DEADLINE_S) and service.process.returncode == 3
    (message,) = [r.getMessage() for r in caplog.records if "failing (pid" in r.getMessage()]
    assert message.startswith(f"accelmesh: failing (pid {service.process.pid}) exited with code 3; its last output:\n")
    assert message.endswith("accelmesh: failing listening on " + service.address + "\nfailing giving up")


def test_a_child_the_launcher_stops_is_not_reported(tag, caplog):
    group = ServiceGroup()
    service = child("quiet", tag)
    group.add(service)
    assert service.terminate() == -signal.SIGTERM
    assert service.wait_exited(DEADLINE_S)
    assert group.wait_for_exit(timeout=0) is None
    assert [r for r in caplog.records if "quiet" in r.getMessage()] == []


def test_a_child_started_from_the_main_thread_is_set_to_die_with_the_launcher_in_a_group_of_its_own(tag):
    service = child("main", tag)
    try:
        pid, pgid, deathsig = map(int, STARTED.search(service.output[0]).groups())
    finally:
        service.terminate()
    assert (pid, pgid, deathsig) == (service.process.pid, service.process.pid, signal.SIGTERM)


def test_a_child_started_from_another_thread_outlives_that_thread_in_the_launchers_group(tag):
    # PR_SET_PDEATHSIG fires when the spawning *thread* ends: a pool thread's child must not get it.
    with ThreadPoolExecutor(max_workers=1) as pool:
        service = pool.submit(child, "pooled", tag).result()
    try:
        _, pgid, deathsig = map(int, STARTED.search(service.output[0]).groups())
        assert service.process.poll() is None
    finally:
        service.terminate()
    assert (pgid, deathsig) == (os.getpgid(0), 0)


# (signal, the line after which it is sent, the children): every moment of start-up and running.
SIGNAL_MOMENTS = [
    (signal.SIGTERM, "launch: guarded", ("a", "b")),  # before the first child exists, or as it is spawned
    (signal.SIGTERM, "[b] b started", ("a", "b:hang")),  # waiting for a ready line that never comes
    (signal.SIGINT, "[b] b started", ("a", "b:hang")),
    (signal.SIGTERM, "[a] accelmesh: a listening", ("a", "b", "c")),  # between one child and the next
    (signal.SIGHUP, "[b] accelmesh: b listening", ("a", "b", "c")),
    (signal.SIGTERM, "launch: all up", ("a", "b", "c")),  # running
    (signal.SIGINT, "launch: all up", ("a", "b", "c")),
]


@pytest.mark.parametrize(("signum", "moment", "specs"), SIGNAL_MOMENTS,
                         ids=[f"{s.name}-{m}" for s, m, _ in SIGNAL_MOMENTS])
def test_a_signal_at_any_moment_stops_every_child_and_frees_its_ports(tag, signum, moment, specs):
    signal_at(launch(tag, *specs), tag, signum, moment, f"launch: stopped by {signum.name}")


def signal_at(launcher, tag: str, signum: signal.Signals, moment: str, stopped: str) -> None:
    """Signal `launcher` once it printed `moment`: it exits 0 saying `stopped`, leaving no process
    of this test and every port it had bound free."""
    launcher.wait_for_line(moment)
    launcher.process.send_signal(signum)
    assert launcher.finish() == 0, launcher.output
    assert stopped in launcher.output
    assert processes_naming(tag) == set(), launcher.output
    if "listening" in launcher.output:
        assert_ports_free(launcher.ports())


def test_a_second_signal_kills_children_that_are_slow_to_stop(tag):
    launcher = launch(tag, "a:stubborn", grace_s=600)  # without the second signal, a 600 s wait
    launcher.wait_for_line("launch: all up")
    launcher.process.send_signal(signal.SIGTERM)
    launcher.wait_for_line("[a] a ignores SIGTERM")
    launcher.process.send_signal(signal.SIGINT)
    assert launcher.finish() == 0, launcher.output
    assert "launch: in the end a was killed by SIGKILL" in launcher.output
    assert processes_naming(tag) == set()


def test_a_child_that_exits_while_running_is_reported_and_the_others_are_stopped(tag):
    launcher = launch(tag, "a", "b:exit=3", "c")
    assert launcher.finish() == 1, launcher.output
    assert re.search(r"\naccelmesh: b \(pid \d+\) exited with code 3; its last output:\n"
                     r"b started: .*\naccelmesh: b listening on .*\nb giving up\n", launcher.output), launcher.output
    assert "launch: b exited with code 3: stopping the others" in launcher.output
    assert processes_naming(tag) == set(), launcher.output
    assert_ports_free(launcher.ports())


def test_children_do_not_outlive_a_launcher_that_is_killed(tag):
    launcher = launch(tag, "a", "b")
    launcher.wait_for_line("launch: all up")
    children = processes_naming(tag) - {launcher.process.pid}
    assert len(children) == 2
    launcher.process.kill()  # no handler runs: the kernel's PR_SET_PDEATHSIG is all that is left
    assert launcher.finish() == -signal.SIGKILL
    assert wait_until_gone(tag) == set()
    assert_ports_free(launcher.ports())


def accelmesh_up(tag: str) -> Watched:
    """`accelmesh up` on free ports with its data under `tag`, echoing its services' output.
    Secure, with the session's credentials (ACCELMESH_CREDENTIALS_DIR, set by conftest.py)."""
    return Watched([sys.executable, "-m", "accelmesh.cli", "up", "--data-dir", tag, "--devices", "1", "--emulate", "",
                    "--inventory-listen", "127.0.0.1:0", "--compile-listen", "127.0.0.1:0",
                    "--dispatch-listen", "127.0.0.1:0", "--verbose"], deadline_s=UP_DEADLINE_S)


UP_MOMENTS = [
    (signal.SIGTERM, "starting the mesh"),  # before the inventory exists, or as it is spawned
    (signal.SIGTERM, "[inventory] accelmesh: inventory listening"),  # the case: it stayed on
    (signal.SIGINT, "mesh is up"),  # the other moments are the fake launcher's cases above
]


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "moment"), UP_MOMENTS, ids=[f"{s.name}-{m}" for s, m in UP_MOMENTS])
def test_accelmesh_up_signalled_during_start_up_or_running_leaves_no_service_or_port(tag, signum, moment):
    signal_at(accelmesh_up(tag), tag, signum, moment, f"accelmesh: {signum.name}: mesh stopped")


@pytest.mark.slow
def test_accelmesh_up_stops_the_mesh_and_fails_when_one_of_its_services_exits(tag):
    up = accelmesh_up(tag)
    up.wait_for_line("mesh is up")
    (worker,) = processes_naming(str(Path(tag) / "worker-artifacts"))
    os.kill(worker, signal.SIGKILL)
    assert up.finish() == 1, up.output
    assert f"accelmesh: worker (pid {worker}) was killed by SIGKILL; its last output:" in up.output
    assert "accelmesh: worker was killed by SIGKILL: stopping the rest of the mesh" in up.output
    assert processes_naming(tag) == set(), up.output
    assert_ports_free(up.ports())


@pytest.mark.slow
def test_accelmesh_up_listening_on_an_address_other_than_127_0_0_1_serves_and_answers_a_client(tag):
    """The services' certificates name the hosts they listen on, so a client dialling one verifies it."""
    folder = Path(tag) / "credentials"  # its own CA: the session's certificates are not reissued
    up = Watched([sys.executable, "-m", "accelmesh.cli", "up", "--data-dir", tag, "--devices", "1", "--emulate", "",
                  "--inventory-listen", "127.0.0.2:0", "--compile-listen", "127.0.0.2:0",
                  "--dispatch-listen", "127.0.0.2:0"], env={"ACCELMESH_CREDENTIALS_DIR": str(folder)},
                 deadline_s=UP_DEADLINE_S)
    try:
        up.wait_for_line("mesh is up")
        inventory = up.wait_for_line("inventory  ").split()[1]
        assert inventory.startswith("127.0.0.2:"), up.output
        client = MeshCredentials(folder).client()
        with open_channel(inventory, security=client) as channel:
            nodes = InventoryServiceStub(channel).ListNodes(ListNodesRequest(), timeout=30).nodes
        assert [n.address.startswith("127.0.0.1:") for n in nodes] == [True], up.output
    finally:
        up.process.send_signal(signal.SIGINT)
    assert up.finish() == 0, up.output
