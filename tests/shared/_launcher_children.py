"""Fake child programs for tests/shared/test_launcher.py, and a small launcher that starts them the
way `accelmesh up` starts the mesh (a StopGuard around start_service calls, then waiting for a
child to exit). Run as `python -m _launcher_children` with this folder on PYTHONPATH:

    child NAME TAG [options]   a fake service: says it started, binds a port, prints its ready line
    launch TAG [--grace S] SPEC...   starts one child per SPEC: "name" or "name:option,option=value"

TAG (the test's temporary folder) is on every command line, so the test finds every process it
caused through /proc and cleans up after itself even when it fails.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = "_launcher_children"
NOT_UTF8 = b"\xff\xfe\xc3( not utf-8"
PR_GET_PDEATHSIG = 2  # <linux/prctl.h>


def child_env() -> dict[str, str]:
    """What start_service needs to find this module in a child process."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}


def _say(line: bytes | str) -> None:
    out = sys.stdout.buffer
    out.write(line if isinstance(line, bytes) else line.encode())
    out.write(b"\n")
    out.flush()


def _pdeathsig() -> int:
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def run_child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="child")
    parser.add_argument("name")
    parser.add_argument("tag")
    parser.add_argument("--bad", action="store_true", help="a line that is not UTF-8 before the ready line")
    parser.add_argument("--hang", action="store_true", help="never print the ready line")
    parser.add_argument("--long", type=int, default=0, help="after the ready line, one line of N bytes")
    parser.add_argument("--spam", type=int, default=0,
                        help="after the ready line, N lines of 100 bytes, then more bad bytes")
    parser.add_argument("--exit", type=int, default=None, help="after the ready line (and spam), exit with this code")
    parser.add_argument("--stubborn", action="store_true", help="answer SIGTERM with a line, not by exiting")
    args = parser.parse_args(argv)
    if args.stubborn:
        signal.signal(signal.SIGTERM, lambda *_: _say(f"{args.name} ignores SIGTERM"))
    _say(f"{args.name} started: pid {os.getpid()} pgid {os.getpgid(0)} pdeathsig {_pdeathsig()}")
    if args.bad:
        _say(NOT_UTF8)
    if args.hang:
        while True:
            signal.pause()
    listener = socket.create_server(("127.0.0.1", 0))
    _say(f"accelmesh: {args.name} listening on 127.0.0.1:{listener.getsockname()[1]}")
    if args.long:
        _say(b"x" * args.long)
    for n in range(args.spam):
        _say(f"{args.name} line {n:6d} ".ljust(99, "."))
    if args.spam:
        _say(NOT_UTF8)
        _say(f"{args.name} spam done")
    if args.exit is not None:
        _say(f"{args.name} giving up")
        return args.exit
    while True:
        signal.pause()


def run_launch(argv: list[str]) -> int:
    from accelmesh.runtime.launcher import start_service
    from accelmesh.runtime.stopping import StopGuard

    parser = argparse.ArgumentParser(prog="launch")
    parser.add_argument("tag")
    parser.add_argument("--grace", type=float, default=None, help="StopGuard grace_s")
    parser.add_argument("specs", nargs="+")
    args = parser.parse_args(argv)
    guard = StopGuard(**({"grace_s": args.grace} if args.grace is not None else {}))
    code = 0
    with guard:
        print("launch: guarded", flush=True)
        for spec in args.specs:
            name, _, options = spec.partition(":")
            flags = [part for option in options.split(",") if option
                     for part in (f"--{option.partition('=')[0]}", option.partition("=")[2]) if part]
            start_service(name, MODULE, ["child", name, args.tag, *flags], env=child_env(), echo=True)
        print("launch: all up", flush=True)
        ended = guard.children.wait_for_exit()
        print(f"launch: {ended.name} {ended.exit_status()}: stopping the others", flush=True)
        code = 1
    if guard.signum is not None:
        print(f"launch: stopped by {signal.Signals(guard.signum).name}", flush=True)
    for service in guard.children.children:
        print(f"launch: in the end {service.name} {service.exit_status()}", flush=True)
    return code

if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    sys.exit({"child": run_child, "launch": run_launch}[command](rest))
