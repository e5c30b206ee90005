"""Idle sockets against the mesh's HTTP endpoints: do a scrape and a page load still answer?

    .venv/bin/python bench/attacks/idle_socket.py [--idle 50] [--bound-s 1.0]

Starts the embedded mesh's four services as real processes on loopback with security on (mutual
TLS, tokens), each serving /metrics and the dispatcher its status page. Times a scrape of every
/metrics (with a certificate of the mesh CA, as Prometheus scrapes) and a page load (the local
operator's token as HTTP Basic credentials) first with nothing else connected, then with `--idle`
TCP connections to each endpoint that connect and send nothing. Prints one JSON document on
stdout (progress on stderr): each latency, its ratio to the same request without the idle
sockets, and `passed` when every request under idle sockets answered within `--bound-s`; exits 1
otherwise. A request that does not answer within CLIENT_TIMEOUT_S counts as that timeout, failed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import socket
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Run as a script from one folder down: bench/ (common) and the checkout this file is in, whose
# packages the services it starts (`python -m`, from the working directory) run as well.
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from common import progress, ratio

from accelmesh.embedded import mesh_credentials, start_compile, start_dispatch, start_inventory, start_worker
from accelmesh.security.identity import Role

CLIENT_TIMEOUT_S = 10.0  # beyond the bound: how long a request that does not answer is waited for
CONNECT_WAIT_S = 2.0  # how long the idle sockets' connections are given to be accepted by the kernel
SERVICES = ("inventory", "compile", "worker", "dispatch")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def environment(**variables: str):
    """The services that take no `env` read these from this process's environment, which they inherit."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_mesh(root: Path, credentials, ports: dict[str, int], stack: contextlib.ExitStack) -> None:
    def metrics(service: str) -> dict[str, str]:
        return {"ACCELMESH_METRICS_LISTEN": f"127.0.0.1:{ports[service]}"}

    with environment(**metrics("inventory")):
        inventory = stack.enter_context(contextlib.closing(_Stopping(start_inventory(root, credentials))))
    with environment(**metrics("compile")):
        compile_ = stack.enter_context(contextlib.closing(_Stopping(start_compile(root, credentials))))
    stack.enter_context(contextlib.closing(_Stopping(start_worker(
        inventory.address, compile_.address, credentials, devices=1, emulate=("v100-32gb",), nvml=False,
        artifact_dir=root / "worker-artifacts", env=metrics("worker")))))
    stack.enter_context(contextlib.closing(_Stopping(start_dispatch(
        root, inventory.address, compile_.address, credentials,
        env={**metrics("dispatch"), "ACCELMESH_STATUS_LISTEN": f"127.0.0.1:{ports['status']}"}))))


class _Stopping:
    def __init__(self, process):
        self.process, self.address = process, process.address

    def close(self) -> None:
        self.process.terminate()


@contextlib.contextmanager
def idle_sockets(ports: list[int], count: int):
    """`count` connections to each port that send nothing; connected without blocking, since a server
    that stops accepting leaves later connections waiting in the kernel."""
    sockets = []
    try:
        for port in ports:
            for _ in range(count):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                sockets.append(sock)
        deadline, pending = time.monotonic() + CONNECT_WAIT_S, list(sockets)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], pending, [], max(0.0, deadline - time.monotonic()))
            pending = [s for s in pending if s not in writable]
        yield len(sockets) - len(pending)
    finally:
        for sock in sockets:
            sock.close()


def timed(request, context) -> dict:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, context=context, timeout=CLIENT_TIMEOUT_S) as response:
            status, size = response.status, len(response.read())
    except OSError as exc:  # timed out, refused, reset
        return {"ms": round((time.perf_counter() - start) * 1000, 1), "error": f"{type(exc).__name__}: {exc}"}
    return {"ms": round((time.perf_counter() - start) * 1000, 1), "status": status, "bytes": size}


def requests(credentials, ports: dict[str, int]) -> dict[str, tuple]:
    """Every endpoint's request and the TLS context it is made with."""
    scraper = credentials.issue(Role.OPERATOR, "prometheus").tls
    scrape = ssl.create_default_context(cafile=str(scraper.ca_file))
    scrape.load_cert_chain(str(scraper.cert_file), str(scraper.key_file))
    browser = ssl.create_default_context(cafile=str(scraper.ca_file))
    token = credentials.token_file.read_text().strip()
    signed_in = base64.b64encode(f"operator:{token}".encode()).decode()
    made = {f"{service}_metrics": (f"https://localhost:{ports[service]}/metrics", scrape) for service in SERVICES}
    made["status_page"] = (urllib.request.Request(f"https://localhost:{ports['status']}/",
                                                  headers={"Authorization": f"Basic {signed_in}"}), browser)
    return made


def measure(made: dict[str, tuple]) -> dict[str, dict]:
    return {name: timed(request, context) for name, (request, context) in made.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=50, help="idle connections to each endpoint")
    parser.add_argument("--bound-s", type=float, default=1.0, help="each answer under idle sockets must come within")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    ports = {name: free_port() for name in (*SERVICES, "status")}
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        credentials = mesh_credentials(root, env={})
        progress("starting the mesh: inventory, compile, one worker, dispatch (mutual TLS), each serving /metrics")
        start_mesh(root, credentials, ports, stack)
        made = requests(credentials, ports)
        progress("timing every endpoint without idle sockets")
        measure(made)  # warm-up: the first scrape of a registry makes its collectors
        baseline = measure(made)
        progress(f"opening {args.idle} idle sockets to each of {len(ports)} endpoints, then timing them again")
        with idle_sockets(list(ports.values()), args.idle) as connected:
            under_idle = measure(made)
    endpoints = {}
    for name, answer in under_idle.items():
        answered = "error" not in answer and answer["status"] == 200
        endpoints[name] = {"baseline": baseline[name], "under_idle_sockets": answer,
                           "ratio_idle_over_baseline": ratio(answer["ms"], baseline[name]["ms"]),
                           "passed": answered and answer["ms"] <= args.bound_s * 1000}
    result = {"benchmark": "attacks/idle_socket", "idle_sockets_per_endpoint": args.idle,
              "idle_sockets_connected": connected, "bound_s": args.bound_s, "client_timeout_s": CLIENT_TIMEOUT_S,
              "endpoints": endpoints, "passed": all(e["passed"] for e in endpoints.values()),
              "wall_s": round(time.perf_counter() - started, 1)}
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
