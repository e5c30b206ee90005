"""The dispatcher's status page (dispatch_svc/api/status_page.py) in a real headless browser: Chromium
from the distribution's packages, signing in with a token as HTTP Basic credentials, over TLS.

A real mesh (an inventory, a compile service and a worker with two emulated devices as processes,
the dispatcher in this process) with one job running (its client holds back its last rows) and
one queued (its device is full). The page shows both devices by node, the running job, the queued
one with its place and why, and the running job's page its shards and their placement picture.
The screenshot is saved (ACCELMESH_TEST_ARTIFACTS, default .test-artifacts/) and checked for the
state colours of the running and queued jobs; the page asks for credentials without a token, and
another user sees none of these jobs. Fifty idle TCP connections do not keep the page from
loading, and its responses carry the browser security headers.

Without a Chromium on the machine the browser tests are skipped with one line saying how to get
one, as the PostgreSQL variants are (tests/postgres.py), unless ACCELMESH_REQUIRE_CHROMIUM=1 (CI,
which installs it), which makes that a failure."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from accelmesh.client import MeshClient, job_spec
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.runtime.batches import unbatched
from accelmesh.runtime.tensors import to_proto
from accelmesh.security.identity import Role
from compile_svc.programs.builtin import IDENTITY_WIDTH
from dispatch_svc.api.status_page import STATE_COLOURS

from conftest import CREDENTIALS, small_mesh

pytestmark = pytest.mark.slow

WAIT_S = 60.0
ROWS, FIRST_ROWS = 16, 4
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("ACCELMESH_REQUIRE_CHROMIUM") != "1":
    pytest.skip("status page browser tests skipped: no Chromium found; install it (Debian: apt-get install "
                "chromium) or set ACCELMESH_REQUIRE_CHROMIUM=1 to make this a failure", allow_module_level=True)
ARTIFACTS = Path(os.environ.get("ACCELMESH_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / ".test-artifacts"))


@dataclasses.dataclass
class Pool:
    port: int
    devices: dict  # type -> device id
    running: str  # job ids
    queued: str
    tokens: dict  # name -> token


def _job(client: MeshClient, name: str, filter: str, go: threading.Event | None = None):
    """A RunJob whose client sends its first rows, then (once `go` is set, if given) the rest. A job
    that goes to the queue has all its rows read first (they are stored), so it holds back none."""
    x = np.ones((ROWS, IDENTITY_WIDTH), np.float32)
    spec = job_spec("identity", {"x": x}, name=name, filter=filter)

    def requests():
        yield pb.RunJobRequest(spec=spec, accept_batches=True)
        yield pb.RunJobRequest(block=pb.InputBlock(first_row=0, tensors=[to_proto(x[:FIRST_ROWS])]))
        if go is not None:
            go.wait(WAIT_S)
        yield pb.RunJobRequest(block=pb.InputBlock(first_row=FIRST_ROWS, tensors=[to_proto(x[FIRST_ROWS:])]))
    return unbatched(client.stub.RunJob(requests(), timeout=4 * WAIT_S))


def _until(responses, event_type: int) -> None:
    for response in responses:
        if response.WhichOneof("part") == "event" and response.event.type == event_type:
            return
    raise AssertionError(f"RunJob ended before a {job_pb.JobEventType.Name(event_type)} event")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tokens = {name: CREDENTIALS.add_user(name).read_text().strip() for name in ("alice", "bob")}
    go = threading.Event()
    with small_mesh(tmp_path_factory.mktemp("status"), emulate=("a100-80gb", "v100-32gb"), status_listen="127.0.0.1:0",
                    queue_poll_s=0.1, max_shard_bytes=FIRST_ROWS * IDENTITY_WIDTH * 4  # shards of FIRST_ROWS rows
                    ) as (server, _, inventory):
        devices = {d.type: d for d in inventory.ListDevices(inv_pb.ListDevicesRequest()).devices}
        full = devices["v100-32gb"]
        inventory.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id="occupier", ttl_seconds=300, claims=[
            inv_pb.DeviceClaim(device_id=full.id, memory_bytes=full.status.memory_free_bytes, compute_fraction=1.0)]))
        alice = MeshClient(f"127.0.0.1:{server.port}", security=CREDENTIALS.client(CREDENTIALS.folder / "token-alice"))
        try:
            running = _job(alice, "runs", 'type = "a100-80gb"', go)
            _until(running, job_pb.JOB_EVENT_TYPE_SHARD_FINISHED)  # its first shard is done: it runs, reserved
            waiting = _job(alice, "waits", 'type = "v100-32gb"')  # kept: its call ending would cancel the job
            _until(waiting, job_pb.JOB_EVENT_TYPE_QUEUED)
            ids = {j.spec.name: j.job_id for j in alice.stub.ListJobs(pb.ListJobsRequest()).jobs}
            yield Pool(server.pages[0].port, {t: d.id for t, d in devices.items()}, ids["runs"], ids["waits"],
                       tokens)
        finally:
            go.set()
            alice.close()


def browse(pool: Pool, path: str, user: str, *, screenshot: Path | None = None) -> str:
    """The page as headless Chromium renders it (its DOM), signed in as `user`."""
    assert CHROMIUM, "ACCELMESH_REQUIRE_CHROMIUM=1 and no Chromium found: install it (apt-get install chromium)"
    url = f"https://{user}:{pool.tokens[user]}@localhost:{pool.port}{path}"
    # The mesh CA is not in Chromium's trust store; the chain is checked below with Python's ssl.
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--ignore-certificate-errors",
            "--window-size=1280,900", "--hide-scrollbars"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", url], check=True, capture_output=True, timeout=WAIT_S)
    return subprocess.run([*args, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=WAIT_S).stdout


def _has_colour(image: np.ndarray, hex_colour: str, tolerance: float = 0.02) -> bool:
    """Whether a badge's worth of pixels (a few hundred) has the colour: text never does."""
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(image[..., :3] - rgb).max(axis=-1) < tolerance).sum() >= 200)


def test_the_pool_at_a_glance_in_a_real_browser(pool):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    dom = browse(pool, "/", "alice", screenshot=shot)
    assert '<h3 class="node">127.0.0.1</h3>' in dom
    for device in pool.devices.values():
        assert device in dom
    assert "a100-80gb (emulated)" in dom
    running = dom[dom.index('id="running"'):dom.index('id="queued"')]
    assert pool.running in running and pool.queued not in running
    queued = dom[dom.index('id="queued"'):]
    assert pool.queued in queued and "free after other jobs' reservations" in queued
    assert '<span id="running-count">1</span>' in dom and '<span id="queued-count">1</span>' in dom

    image = matplotlib.image.imread(shot)
    assert image.shape[:2] == (900, 1280)
    assert _has_colour(image, STATE_COLOURS["running"]), "no running-state badge in the screenshot"
    assert _has_colour(image, STATE_COLOURS["queued"]), "no queued-state badge in the screenshot"


def test_a_jobs_page_shows_its_shards_and_where_they_ran(pool):
    dom = browse(pool, f"/jobs/{pool.running}", "alice", screenshot=ARTIFACTS / "status-job.png")
    assert 'id="shards"' in dom and '<svg id="placement"' in dom
    assert pool.devices["a100-80gb"] in dom
    assert "shard 0:" in dom  # the picture's cell titles


def test_without_a_token_the_page_asks_for_one_over_the_mesh_tls(pool):
    context = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.OPERATOR).tls.ca_file))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"https://localhost:{pool.port}/", context=context, timeout=WAIT_S)
    assert refused.value.code == 401
    assert refused.value.headers["WWW-Authenticate"].startswith('Basic realm="accelmesh"')
    wrong = base64.b64encode(b"alice:not-a-token").decode()
    request = urllib.request.Request(f"https://localhost:{pool.port}/", headers={"Authorization": f"Basic {wrong}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, context=context, timeout=WAIT_S)
    assert refused.value.code == 401


def test_another_user_sees_none_of_these_jobs(pool):
    dom = browse(pool, "/", "bob")
    assert pool.running not in dom and pool.queued not in dom
    assert "no job is running" in dom and "the queue is empty" in dom
    assert "Not found" in browse(pool, f"/jobs/{pool.running}", "bob")



def test_idle_sockets_do_not_keep_the_page_from_loading_and_it_sends_security_headers(pool):
    """Fifty connections that never handshake used to hold the page's one accepting thread."""
    context = ssl.create_default_context(cafile=str(CREDENTIALS.service(Role.OPERATOR).tls.ca_file))
    signed_in = base64.b64encode(f"alice:{pool.tokens['alice']}".encode()).decode()
    request = urllib.request.Request(f"https://localhost:{pool.port}/", headers={"Authorization": f"Basic {signed_in}"})
    with contextlib.ExitStack() as idle:
        for _ in range(50):
            idle.enter_context(socket.create_connection(("127.0.0.1", pool.port), timeout=5))
        with urllib.request.urlopen(request, context=context, timeout=5) as response:  # a loaded CI machine meets 5 s
            page, headers = response.read().decode(), response.headers
    assert pool.running in page and '<span id="queued-count">1</span>' in page
    assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["Referrer-Policy"] == "no-referrer" and headers["Strict-Transport-Security"].startswith("max-age=")
    assert "Python" not in headers["Server"]
