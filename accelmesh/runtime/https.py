"""The mesh's HTTP endpoints (every service's /metrics, the dispatcher's status page): the standard
library's threading HTTP server, with each TLS handshake in the connection's own thread.

The standard library's recipe, wrapping the listening socket in TLS, runs every handshake inside
accept() on the one thread that serves the port: a client that connects and sends nothing holds
that thread, and no one else is answered for as long as it stays. Here accept() takes plain TCP and
hands the socket to a thread of its own, which completes the handshake within `handshake_timeout_s`
(a deadline for the whole handshake) and then has `read_timeout_s` to read the whole request,
however it is sent: a client trickling a byte at a time gains nothing by it. At most
`max_connections` connections are served at once; one beyond that is closed as soon as it is
accepted, so a flood of idle sockets costs a bounded number of threads, each of them gone after its
timeout, while callers that send a request are answered.

Every response says what a browser may do with it (`SecureHandler`): nothing framed, nothing
sniffed, no referrer, HTTPS only once seen over TLS, and a Server header without versions.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from accelmesh.runtime.config import env_float, env_int
from accelmesh.security.config import Security

log = logging.getLogger(__name__)

HSTS_MAX_AGE_S = 365 * 24 * 3600
ACCEPT_BACKLOG = 128  # connections the kernel queues while the accepting thread hands one over


@dataclass(frozen=True)
class HttpLimits:
    # ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S: a connection that has not completed its TLS handshake
    # within this is closed (browsers and Prometheus take milliseconds)
    handshake_timeout_s: float = 5.0
    # ACCELMESH_HTTP_READ_TIMEOUT_S: a connection that has not sent its whole request this long
    # after its handshake, or that takes none of the answer for this long, is closed
    read_timeout_s: float = 10.0
    # ACCELMESH_HTTP_MAX_CONNECTIONS: connections served at once, per endpoint; more are closed at once
    max_connections: int = 128


DEFAULT_LIMITS = HttpLimits()


def http_limits_from_env(env: Mapping[str, str] = os.environ) -> HttpLimits:
    d = HttpLimits
    return HttpLimits(
        handshake_timeout_s=env_float("ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S", d.handshake_timeout_s, env, minimum=0.1),
        read_timeout_s=env_float("ACCELMESH_HTTP_READ_TIMEOUT_S", d.read_timeout_s, env, minimum=0.1),
        max_connections=env_int("ACCELMESH_HTTP_MAX_CONNECTIONS", d.max_connections, env, minimum=1))


def tls_context(security: Security | None, *, client_certificate: bool) -> ssl.SSLContext | None:
    """The server side of TLS with the service's own certificate; None on an insecure mesh (plain
    HTTP). `client_certificate`: only a client with a certificate of the mesh CA gets through."""
    if security is None or security.insecure:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(security.tls.cert_file), str(security.tls.key_file))
    if client_certificate:
        context.load_verify_locations(cafile=str(security.tls.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _RequestReader(socket.SocketIO):
    """Reads a request within one deadline: each read waits at most what is left of it."""

    def __init__(self, sock: socket.socket, deadline: float, write_timeout_s: float):
        super().__init__(sock, "rb")
        self._deadline, self._write_timeout_s = deadline, write_timeout_s

    def readinto(self, b):
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within ACCELMESH_HTTP_READ_TIMEOUT_S")
        self._sock.settimeout(left)
        try:
            return super().readinto(b)
        finally:
            self._sock.settimeout(self._write_timeout_s)  # what the answer's writes wait, at most


class SecureHandler(BaseHTTPRequestHandler):
    """A request handler whose every response, errors included, carries the browser security headers,
    and that reads its request within the server's read timeout (HttpsServer serves these alone)."""

    server_version = "accelmesh"
    # Nothing is loaded by what the endpoints serve; a page that styles itself widens this.
    content_security_policy = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the standard library's reader, replaced by one with a deadline
        timeout_s = self.server.limits.read_timeout_s
        self.rfile = io.BufferedReader(_RequestReader(self.connection, time.monotonic() + timeout_s, timeout_s))

    def version_string(self) -> str:  # the standard library's name; its default names the Python version
        return self.server_version

    def end_headers(self) -> None:
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Content-Security-Policy", self.content_security_policy)
        self.send_header("Referrer-Policy", "no-referrer")
        if self.server.secure:
            self.send_header("Strict-Transport-Security", f"max-age={HSTS_MAX_AGE_S}")
        super().end_headers()

    def log_message(self, format, *args):  # the standard library's signature
        log.debug("%s: " + format, self.server.name, *args)


class HttpsServer(ThreadingHTTPServer):
    """Serves `handler` on host:port, over TLS with `context` (plain HTTP when None), from its own thread.
    Raises OSError when the address cannot be had."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = ACCEPT_BACKLOG

    def __init__(self, name: str, host: str, port: int, handler: type[SecureHandler],
                 context: ssl.SSLContext | None, limits: HttpLimits):
        self.name, self.secure, self.limits = name, context is not None, limits
        self._context = context
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        super().__init__((host, port), handler)
        self.port = self.server_address[1]
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)

    def start(self) -> HttpsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()

    def verify_request(self, request, client_address) -> bool:
        """On the accepting thread: a connection beyond the bound is refused (closed) without waiting."""
        if self._slots.acquire(blocking=False):
            return True
        log.warning("%s: %d connections are being served; closed one more from %s (ACCELMESH_HTTP_MAX_CONNECTIONS)",
                    self.name, self.limits.max_connections, client_address[0])
        return False

    def process_request_thread(self, request, client_address):
        try:
            if self._context is not None:
                request.settimeout(self.limits.handshake_timeout_s)
                request = self._context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                request.do_handshake()
            request.settimeout(self.limits.read_timeout_s)
            self.finish_request(request, client_address)
        except OSError as exc:  # a handshake refused or timed out, a client gone or silent: its loss alone
            log.debug("%s: connection from %s ended: %s", self.name, client_address[0], exc)
        except Exception:  # noqa: BLE001 - a handler's bug fails its request alone; logged with its traceback
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request, client_address):
        log.exception("%s: the request from %s failed", self.name, client_address[0])
