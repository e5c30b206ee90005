"""A read-only status page, so that someone with a browser sees the pool at a glance: the devices
by node with their health and load, the running and queued jobs, and each job's shards with a
picture of where they ran. Served by the dispatcher on ACCELMESH_STATUS_LISTEN (host:port; none
when unset) at / and /jobs/<job id>.

The page is HTML made on the server, refreshed by the browser every REFRESH_S (no script), from
what the dispatcher already has: the inventory's ListDevices and the job book. It is served over
TLS with the dispatcher's certificate (plain HTTP only on an insecure, loopback-only mesh), and
asks for the caller's bearer token as HTTP Basic authentication (any user name, the token as the
password), so it shows each person what the API would: their own jobs, or everyone's to an
operator. The mesh's HTTP server (accelmesh/runtime/https.py: handshakes off the accepting thread,
timeouts, a bound on connections, browser security headers) is enough for a few read-only pages; a
web framework would be a dependency for nothing. The page styles itself inline and loads nothing,
so its Content-Security-Policy allows inline styles alone.
"""

from __future__ import annotations

import base64
import html
import logging
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.config import cannot_bind
from accelmesh.runtime.https import DEFAULT_LIMITS, HttpLimits, HttpsServer, SecureHandler, tls_context
from accelmesh.security.access import Authenticator, sees_everything
from accelmesh.security.config import Security
from accelmesh.security.identity import Principal
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook

log = logging.getLogger(__name__)

REFRESH_S = 5
MAX_JOBS = 200  # unfinished jobs a page lists at most
MIB = 1024 * 1024
# Inline <style> and style attributes (bars, state badges), the picture inline SVG; nothing else.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; "
                           "form-action 'none'")
STATE_COLOURS = {m.QUEUED: "#8e24aa", m.PLANNING: "#64b5f6", m.COMPILING: "#64b5f6", m.RUNNING: "#1e88e5",
                 m.SUCCEEDED: "#43a047", m.FAILED: "#e53935", m.CANCELLED: "#fb8c00"}


class StatusPage:
    def __init__(self, listen: str, security: Security, auth: Authenticator, book: JobBook,
                 devices: Callable[[], Iterable], clock: Callable[[], float] = time.time,
                 limits: HttpLimits = DEFAULT_LIMITS):
        """`devices()`: the inventory's devices (ListDevices' Device messages, lost ones too); `limits`:
        the page's timeouts and connection bound (https.py)."""
        self._auth, self._book, self._devices, self._clock = auth, book, devices, clock
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise errors.InvalidArgument(f"status page address {listen!r} is not host:port; set "
                                         "ACCELMESH_STATUS_LISTEN to e.g. 0.0.0.0:8443, or leave it empty for no page")
        page = self

        class Handler(SecureHandler):
            server_version = "accelmesh-dispatch"
            content_security_policy = CONTENT_SECURITY_POLICY

            def do_GET(self):  # the standard library's name
                page.answer(self)

        # Browsers have no mesh certificate: the page asks for a token instead.
        context = tls_context(security, client_certificate=False)
        try:
            self._server = HttpsServer("status page", host.strip("[]") or "0.0.0.0", int(port), Handler, context,
                                       limits)
        except OSError:
            raise cannot_bind(listen, "--status-listen (ACCELMESH_STATUS_LISTEN)") from None
        self.secure = self._server.secure
        self.port = self._server.port

    def start(self) -> StatusPage:
        self._server.start()
        return self

    def close(self) -> None:
        self._server.close()

    # -- requests -----------------------------------------------------------------------------

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        try:
            principal = self._caller(request)
            path = request.path.split("?", 1)[0]
            if path == "/":
                body = self.overview(principal)
            elif path.startswith("/jobs/") and path.count("/") == 2:
                body = self.job_page(principal, unquote(path[len("/jobs/"):]))
            else:
                raise errors.NotFound(f"no page {path}; the pages are / and /jobs/<job id>")
            self._send(request, HTTPStatus.OK, body)
        except errors.Unauthenticated as exc:
            self._send(request, HTTPStatus.UNAUTHORIZED, _page("Sign in", f"<p>{html.escape(str(exc))}</p>"),
                       {"WWW-Authenticate": 'Basic realm="accelmesh", charset="UTF-8"'})
        except errors.NotFound as exc:
            self._send(request, HTTPStatus.NOT_FOUND, _page("Not found", f"<p>{html.escape(str(exc))}</p>"))
        except errors.AccelmeshError as exc:  # the inventory or the book did not answer
            self._send(request, HTTPStatus.SERVICE_UNAVAILABLE, _page("Unavailable", f"<p>{html.escape(str(exc))}</p>"))
        except Exception:  # a bug shows as a 500 and is logged; the server goes on
            log.exception("status page %s failed", request.path)
            self._send(request, HTTPStatus.INTERNAL_SERVER_ERROR, _page("Error", "<p>the page failed; see the "
                                                                            "dispatcher's log</p>"))

    def _caller(self, request: BaseHTTPRequestHandler) -> Principal:
        if self._auth.insecure:
            return self._auth.from_token("")
        header = request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic" or not value:
            raise errors.Unauthenticated("sign in with your accelmesh token as the password (any user name); "
                                         "`accelmesh up` writes the local operator's to .accelmesh/credentials/token")
        try:
            _, _, token = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, UnicodeError):
            raise errors.Unauthenticated("the Authorization header is not HTTP Basic credentials") from None
        return self._auth.from_token(token.strip())

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: HTTPStatus, body: str, headers: dict | None = None) -> None:
        data = body.encode()
        request.send_response(status)
        request.send_header("Content-Type", "text/html; charset=utf-8")
        request.send_header("Content-Length", str(len(data)))
        request.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.end_headers()
        request.wfile.write(data)

    # -- pages ------------------------------------------------------------------------------

    def overview(self, principal: Principal) -> str:
        devices = list(self._devices())
        by_node: dict[str, list] = {}
        for device in devices:
            by_node.setdefault(device.node_ip, []).append(device)
        healthy = sum(d.health == common_pb2.DEVICE_HEALTH_HEALTHY for d in devices) if devices else 0
        jobs = self._book.active(None if sees_everything(principal) else principal.key, MAX_JOBS)
        running = [j for j in jobs if j.state != m.QUEUED]
        queued = sorted((j for j in jobs if j.state == m.QUEUED), key=lambda j: j.queue.position if j.queue else 0)
        parts = [f'<p class="summary">{len(devices)} devices on {len(by_node)} nodes, {healthy} healthy; '
                 f'<span id="running-count">{len(running)}</span> jobs running, '
                 f'<span id="queued-count">{len(queued)}</span> queued; signed in as {html.escape(principal.key)}</p>',
                 '<h2>Devices</h2>']
        for node, group in sorted(by_node.items()):
            parts.append(f'<h3 class="node">{html.escape(node)}</h3>')
            parts.append(_table(("device", "type", "health", "utilisation", "memory used", "reserved"), (
                (_code(d.id), html.escape(d.type + (" (emulated)" if d.emulated else "")), _health(d.health),
                 _bar(d.status.utilization), _memory(d.status.memory_used_bytes, d.status.memory_total_bytes),
                 _memory(d.status.memory_reserved_bytes, d.status.memory_total_bytes))
                for d in sorted(group, key=lambda d: d.id)), "devices"))
        parts.append("<h2>Running jobs</h2>")
        parts.append(_table(("job", "name", "program", "owner", "state", "progress", "shards"), (
            (_job_link(j), html.escape(j.spec.name), html.escape(j.spec.program), html.escape(j.owner),
             _state(j.state), _bar(j.progress), str(len(j.plan.shards) if j.plan else 0)) for j in running),
            "running", empty="no job is running"))
        parts.append("<h2>Queue</h2>")
        parts.append(_table(("position", "job", "name", "owner", "state", "priority", "waiting", "why"), (
            (str(j.queue.position if j.queue else ""), _job_link(j), html.escape(j.spec.name), html.escape(j.owner),
             _state(j.state),
             str(j.spec.priority), _since(self._clock() - j.queue.since if j.queue else 0),
             html.escape(j.queue.reason if j.queue else "")) for j in queued), "queued", empty="the queue is empty"))
        return _page("accelmesh", "".join(parts), refresh=True)

    def job_page(self, principal: Principal, job_id: str) -> str:
        job = self._book.get(job_id)  # NotFound: no such job
        if job.owner != principal.key and not sees_everything(principal):
            raise errors.NotFound(f"job {job_id} does not exist (or its results expired)")  # as the API says
        facts = [("state", _state(job.state)), ("program", html.escape(job.spec.program)),
                 ("owner", html.escape(job.owner)), ("progress", _bar(job.progress))]
        if job.state == m.QUEUED and job.queue is not None:
            facts += [("queue position", str(job.queue.position)), ("waiting because", html.escape(job.queue.reason))]
        if job.error:
            facts.append(("error", html.escape(job.error)))
        parts = ['<table class="facts">' + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts) + "</table>"]
        shards = job.shards
        if shards:
            parts.append("<h2>Placement</h2>" + _placement_svg(shards))
            parts.append("<h2>Shards</h2>")
            parts.append(_table(("shard", "device", "type", "rows", "attempts", "seconds", "done"), (
                (str(s.index), _code(s.device_id), html.escape(s.target_type), f"{s.rows:,}", str(s.attempts),
                 f"{s.total_seconds:.3f}", "yes" if s.done else "no") for s in shards), "shards"))
        return _page(f"job {job.job_id}", "".join(parts), refresh=not job.final, back=True)


def _placement_svg(shards) -> str:
    """A row per device, a cell per shard in index order: where each shard ran, and whether it is done."""
    devices = sorted({s.device_id for s in shards})
    cell, label = 14, 190
    width = label + cell * (max(s.index for s in shards) + 1)
    rows = [f'<text x="4" y="{(i + 1) * cell * 1.5 - 3}" class="label">{html.escape(d)}</text>'
            for i, d in enumerate(devices)]
    for s in shards:
        y = devices.index(s.device_id) * cell * 1.5 + cell * 0.5
        colour = STATE_COLOURS[m.SUCCEEDED] if s.done else "#bdbdbd"  # done, or not yet
        rows.append(f'<rect x="{label + s.index * cell}" y="{y}" width="{cell - 2}" height="{cell}" fill="{colour}">'
                    f'<title>shard {s.index}: {s.rows} rows on {html.escape(s.device_id)}</title></rect>')
    height = len(devices) * cell * 1.5 + cell
    return (f'<svg id="placement" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="shards by device">{"".join(rows)}</svg>')


def _page(title: str, body: str, refresh: bool = False, back: bool = False) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    nav = '<p><a href="/">&larr; the pool</a></p>' if back else ""
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{html.escape(title)}</title>
<style>body{{font:14px system-ui,sans-serif;margin:1.5em;color:#222}}h1{{font-size:1.4em}}
table{{border-collapse:collapse;
margin:.5em 0 1.2em}}th,td{{padding:.25em .7em;border-bottom:1px solid #ddd;text-align:left}}th{{background:#f4f4f4}}
code{{font-size:.95em}}.bar{{display:inline-block;width:80px;height:.7em;background:#eee;vertical-align:middle}}
.bar i{{display:block;height:100%;background:#1e88e5}}.state{{padding:0 .4em;border-radius:3px;color:#fff}}
.label{{font:11px monospace}}.lost{{color:#e53935;font-weight:bold}}</style></head>
<body><h1>{html.escape(title)}</h1>{nav}{body}</body></html>"""


def _table(heads, rows, table_id: str, empty: str = "none") -> str:
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    if not body:
        return f'<p id="{table_id}" class="empty">{html.escape(empty)}</p>'
    return (f'<table id="{table_id}"><tr>' + "".join(f"<th>{h}</th>" for h in heads) + f"</tr>{body}</table>")


def _bar(fraction: float) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    return f'<span class="bar"><i style="width:{100 * fraction:.0f}%"></i></span> {100 * fraction:.0f}%'


def _memory(used: int, total: int) -> str:
    return f"{used / MIB:,.0f} / {total / MIB:,.0f} MiB" if total else f"{used / MIB:,.0f} MiB"


def _health(health: int) -> str:
    return "healthy" if health == common_pb2.DEVICE_HEALTH_HEALTHY else '<span class="lost">lost</span>'


def _state(state: str) -> str:
    return f'<span class="state" style="background:{STATE_COLOURS.get(state, "#777")}">{html.escape(state)}</span>'


def _job_link(job: m.JobRecord) -> str:
    return f'<a href="/jobs/{html.escape(job.job_id)}"><code>{html.escape(job.job_id)}</code></a>'


def _code(text: str) -> str:
    return f"<code>{html.escape(text)}</code>"


def _since(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h {seconds % 3600 // 60}m" if seconds >= 3600 else f"{seconds // 60}m {seconds % 60}s"
