"""The `accelmesh` command."""

from __future__ import annotations

import argparse
import re
import sys
from urllib.parse import unquote

import grpc

from accelmesh import errors
from accelmesh.cli import compile as compile_commands
from accelmesh.cli import inventory as inventory_commands
from accelmesh.cli import jobs as jobs_commands
from accelmesh.cli import mesh as mesh_commands
from accelmesh.cli import nodes as nodes_commands
from accelmesh.cli import plan as plan_commands
from accelmesh.cli import quota as quota_commands
from accelmesh.runtime.errors import STATUS_BY_ERROR
from accelmesh.security.identity import address_host

# The address gRPC names in a failed connection's details (`ipv4:10.0.0.5:50051:`, `ipv6:%5B::1%5D:50051:`).
_DIALLED = re.compile(r"(?:ipv4|ipv6):(?P<address>\S+?:\d+):")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelmesh",
                                     description="run deep-learning jobs on a pool of mixed accelerators")
    sub = parser.add_subparsers(dest="command", required=True)
    mesh_commands.add_commands(sub)
    inventory_commands.add_commands(sub)
    nodes_commands.add_commands(sub)
    compile_commands.add_commands(sub)
    plan_commands.add_commands(sub)
    jobs_commands.add_commands(sub)
    quota_commands.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        print(f"accelmesh: {exc.code().name}: {exc.details()}{_hint(exc)}", file=sys.stderr)
        return 1
    except errors.AccelmeshError as exc:  # refused here, with the status a service would have answered
        code = next((STATUS_BY_ERROR[t] for t in type(exc).__mro__ if t in STATUS_BY_ERROR), None)
        print(f"accelmesh: {code.name + ': ' if code else ''}{exc}", file=sys.stderr)
        return 1


def _hint(exc: grpc.RpcError) -> str:
    """What to do about a status whose own words do not say it."""
    details = (exc.details() or "").lower()
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "hostname verification" in details:
        found = _DIALLED.search(exc.details() or "")
        host = address_host(unquote(found["address"])) if found else "HOST"
        return (f"\naccelmesh: the server's certificate does not name {host}, the host this command dialled: "
                f"connect at an address its certificate names (`accelmesh up` prints them; loopback always is), or "
                f"have the certificate name it: `accelmesh up --advertise {host}` (or --*-listen {host}:PORT), "
                f"`python -m accelmesh.security.credentials DIR --host {host}`, or add it to the service's "
                f"Certificate in Kubernetes (docs/security.md)")
    refused = "connection refused" in details or "failed to connect" in details
    if exc.code() == grpc.StatusCode.UNAVAILABLE and refused:
        return ("\naccelmesh: nothing answers at that address: start the mesh with `accelmesh up`, or point the "
                "command at yours (--inventory / --dispatch / --compile HOST:PORT)")
    return ""
