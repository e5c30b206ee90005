"""The mesh's HTTP endpoints (accelmesh/runtime/https.py) as their callers meet them: a /metrics
endpoint with the mesh's mutual TLS and the dispatcher's status page with server TLS and a token,
each in this process on port 0. Idle TCP connections (connected, sending nothing) do not keep a
scrape or a page load from being answered; a connection that does not handshake, or handshakes and
sends nothing, is closed, as is one that trickles its request past the read timeout; connections
beyond the bound are closed at once; every response carries the browser security headers and a
Server header without versions; the limits come from the environment. (The endpoints in a whole
mesh: tests/e2e/test_metrics_e2e.py, test_status_page.py.)"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import select
import socket
import ssl
import urllib.error
import urllib.request

import pytest

from accelmesh import errors
from accelmesh.runtime.https import HttpLimits, HttpsServer, SecureHandler, http_limits_from_env, tls_context
from accelmesh.runtime.metrics import Metrics
from accelmesh.security.access import Authenticator
from accelmesh.security.identity import Role
from dispatch_svc.api.status_page import StatusPage
from dispatch_svc.jobs.book import JobBook
from inventory_svc.config import parse_args

from conftest import CREDENTIALS, scraper_context

IDLE_SOCKETS = 50
# A loaded machine answers well within this; an endpoint held by an idle socket never does.
ANSWER_TIMEOUT_S = 5.0
WAIT_S = 30.0  # only bounds a hang
TRICKLE_S = 0.05  # a slow client's pace, a tenth of the read timeout it is given
BROWSER_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


@pytest.fixture
def metrics():
    served = Metrics("inventory", "127.0.0.1:0", CREDENTIALS.service(Role.INVENTORY))
    served.gauge("accelmesh_devices", "devices", lambda: [(3, {})])
    yield served
    served.close()


@pytest.fixture
def page(tmp_path):
    security = CREDENTIALS.service(Role.DISPATCH)
    book = JobBook(tmp_path, retention_s=60)
    served = StatusPage("127.0.0.1:0", security, Authenticator(security), book, lambda: []).start()
    yield served
    served.close()
    book.close()


@contextlib.contextmanager
def idle_sockets(port: int, count: int = IDLE_SOCKETS):
    """`count` TCP connections to the port that send nothing, open until the block ends."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S))
               for _ in range(count)]


def scrape(metrics: Metrics):
    return urllib.request.urlopen(f"https://localhost:{metrics.port}/metrics", context=scraper_context(),
                                  timeout=ANSWER_TIMEOUT_S)


def load_page(page: StatusPage, token: str | None = None):
    token = token if token is not None else CREDENTIALS.token_file.read_text().strip()
    credentials = base64.b64encode(f"operator:{token}".encode()).decode()
    request = urllib.request.Request(f"https://localhost:{page.port}/",
                                     headers={"Authorization": f"Basic {credentials}"})
    context = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.DISPATCH).tls.ca_file))
    return urllib.request.urlopen(request, context=context, timeout=ANSWER_TIMEOUT_S)


def test_idle_sockets_do_not_keep_a_scrape_from_being_answered(metrics):
    """Fifty connections that never handshake used to hold the one thread that accepted and handshook."""
    with idle_sockets(metrics.port), scrape(metrics) as response:
        assert response.status == 200
        assert re.search(r"^accelmesh_devices\{.*\} 3.0$", response.read().decode(), re.M)


def test_idle_sockets_do_not_keep_the_status_page_from_loading(page):
    with idle_sockets(page.port), load_page(page) as response:
        assert response.status == 200
        assert "0 devices on 0 nodes" in response.read().decode()


def test_a_scrape_still_needs_a_mesh_certificate(metrics):
    anonymous = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.OPERATOR).tls.ca_file))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(f"https://localhost:{metrics.port}/metrics", context=anonymous, timeout=WAIT_S).read()


def test_the_status_page_sends_the_browser_security_headers(page):
    with load_page(page) as response:
        headers = response.headers
    for name, expected in BROWSER_HEADERS.items():
        assert headers[name] == expected
    policy = {part.split()[0]: part.split()[1:] for part in headers["Content-Security-Policy"].split("; ")}
    assert policy["frame-ancestors"] == ["'none'"] and policy["default-src"] == ["'none'"]
    assert policy["style-src"] == ["'unsafe-inline'"]  # the page's inline styles, and nothing loaded
    assert headers["Strict-Transport-Security"].startswith("max-age=")
    assert headers["Server"] == "accelmesh-dispatch"
    with pytest.raises(urllib.error.HTTPError) as refused:  # a refusal carries them as well
        load_page(page, token="not-a-token")
    assert refused.value.code == 401 and refused.value.headers["X-Frame-Options"] == "DENY"


def test_a_scrape_sends_the_security_headers_and_no_python_version(metrics):
    with scrape(metrics) as response:
        headers = response.headers
    for name, expected in BROWSER_HEADERS.items():
        assert headers[name] == expected
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["Strict-Transport-Security"].startswith("max-age=")
    assert headers["Server"] == "accelmesh" and "Python" not in headers["Server"]


class Hello(SecureHandler):
    def do_GET(self):  # the standard library's name
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")


@contextlib.contextmanager
def hello_server(limits: HttpLimits, tls: bool):
    context = tls_context(CREDENTIALS.service(Role.INVENTORY), client_certificate=False) if tls else None
    server = HttpsServer("hello", "127.0.0.1", 0, Hello, context, limits).start()
    try:
        yield server
    finally:
        server.close()


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_that_never_handshakes_is_closed():
    with hello_server(HttpLimits(handshake_timeout_s=0.1), tls=True) as server, idle_sockets(server.port, 1) as (idle,):
        assert closed_by_server(idle)


def test_a_connection_that_handshakes_and_sends_nothing_is_closed():
    context = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.INVENTORY).tls.ca_file))
    with hello_server(HttpLimits(read_timeout_s=0.1), tls=True) as server, \
            context.wrap_socket(socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S),
                                server_hostname="localhost") as quiet:
        assert quiet.recv(1) == b""  # the server's close, after the handshake this call completed


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_the_read_timeout():
    """Each byte comes well within the read timeout of the last; the whole request must come within it."""
    with hello_server(HttpLimits(read_timeout_s=0.5), tls=False) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as slow:
        try:
            for _ in range(int(WAIT_S / TRICKLE_S)):
                if select.select([slow], [], [], TRICKLE_S)[0]:  # the server closed it (or answered)
                    break
                slow.sendall(b"G")
            else:
                pytest.fail(f"the server still read a request trickled for {WAIT_S:.0f} s")
            assert slow.recv(1) == b""
        except ConnectionError:  # closed while a byte was on its way: reset
            pass


def test_connections_beyond_the_bound_are_closed_at_once_and_the_held_ones_kept():
    with hello_server(HttpLimits(max_connections=2, read_timeout_s=WAIT_S * 10), tls=False) as server, \
            idle_sockets(server.port, 2) as held, idle_sockets(server.port, 1) as (beyond,):
        assert closed_by_server(beyond)
        held[0].sendall(b"GET / HTTP/1.0\r\n\r\n")  # a held connection is still served
        held[0].settimeout(WAIT_S)
        with held[0].makefile("rb") as answer:
            assert answer.readline().startswith(b"HTTP/1.0 200") and answer.read().endswith(b"hello")


def test_the_limits_come_from_the_environment_and_a_bad_one_is_named():
    env = {"ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S": "2.5", "ACCELMESH_HTTP_READ_TIMEOUT_S": "7",
           "ACCELMESH_HTTP_MAX_CONNECTIONS": "16"}
    assert http_limits_from_env(env) == HttpLimits(handshake_timeout_s=2.5, read_timeout_s=7.0, max_connections=16)
    assert http_limits_from_env({}) == HttpLimits()
    assert parse_args([], {**os.environ, **env}).http.max_connections == 16
    with pytest.raises(errors.InvalidArgument, match="ACCELMESH_HTTP_MAX_CONNECTIONS=0 is below the minimum 1"):
        http_limits_from_env({"ACCELMESH_HTTP_MAX_CONNECTIONS": "0"})
