"""Idle streams of two principals against a third: does the dispatcher still serve the third?

    .venv/bin/python bench/attacks/stream_share.py [--streams-each N] [--max-streams N] [--idle-s S]

(From a checkout the virtualenv was not installed from, put it first: PYTHONPATH=$PWD.)

Starts the embedded mesh (processes on loopback, mutual TLS and tokens, as bench/abuse.py does),
then, as the users `share-alice` and `share-bob` in turn, opens `--streams-each` idle SubmitJob
uploads (a spec, then nothing: 600 each by default, 1,200 against the dispatcher's limit of
1,024 streams). A third user, `share-carol`, submits a small job and watches it to its end
before the streams are opened (the baseline, which also compiles the program) and while they
are held. Past the idle limit (`ACCELMESH_STREAM_IDLE_S`, the dispatcher's default unless
`--idle-s`) the dispatcher ends the held uploads; the run waits for that and reports how they
ended. Prints one JSON document (progress on stderr); exits 1 when the third user is refused
or a principal held more than its share.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# Run as a script from bench/attacks: the shared bench modules (common, abuse) live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import numpy as np
from abuse import status_of
from common import progress, ratio
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh.client import job_spec, request_parts
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.runtime.admission import DEFAULT_MAX_STREAMS, DEFAULT_MAX_STREAMS_PER_CLIENT, MAX_STREAMS_ENV
from accelmesh.runtime.channels import open_channel
from dispatch_svc.api.servicer import DEFAULT_STREAM_IDLE_S, STREAM_IDLE_ENV

CALL_TIMEOUT_S = 300.0  # the baseline job compiles its program
SETTLE_S = 2.0  # refusals come in milliseconds: a count unchanged this long is final


class Principal:
    """A user of its own (a token), with one channel to the dispatcher and the uploads it opened."""

    def __init__(self, mesh, name: str):
        self.name = name
        self.channel = open_channel(mesh.dispatch.address, security=mesh.credentials.client(
            mesh.credentials.add_user(name)))
        self.stub = dispatch_service_pb2_grpc.DispatchServiceStub(self.channel)
        self.calls: list = []
        self._ends: list[queue.Queue] = []

    def open_idle(self, count: int, timeout_s: float) -> None:
        spec = job_pb.JobSpec(program="identity", name=f"{self.name}-idle", inputs=[common_pb2.TensorHeader(
            name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[8, 1024])])
        for _ in range(count):
            requests: queue.Queue = queue.Queue()
            requests.put(pb.SubmitJobRequest(spec=spec))
            self._ends.append(requests)
            self.calls.append(self.stub.SubmitJob.future(iter(requests.get, None), timeout=timeout_s))

    def settled_refusals(self) -> list:
        """The calls refused, once no more refusals come."""
        last, since = -1, time.monotonic()
        while True:
            done = [c for c in self.calls if c.done()]
            if len(done) != last:
                last, since = len(done), time.monotonic()
            elif time.monotonic() - since > SETTLE_S:
                return done
            time.sleep(0.1)

    def close(self) -> None:
        for requests in self._ends:
            requests.put(None)
        for call in self.calls:
            call.cancel()
        self.channel.close()


def refusal(call) -> dict:
    exc = call.exception()
    out = {"code": exc.code().name, "details": exc.details()}
    for detail in rpc_status.from_call(exc).details:
        info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
        if detail.Unpack(info):
            out["error_info"] = {"reason": info.reason, "metadata": dict(info.metadata)}
        elif detail.Unpack(quota):
            out["quota_failure"] = [{"subject": v.subject, "description": v.description} for v in quota.violations]
    return out


def served(user: Principal) -> dict:
    """A small job of `user`'s submitted and watched to its end: each call's status, and the time of both."""
    x = np.ones((64, 1024), np.float32)
    started = time.perf_counter()
    submitted: dict = {}
    submit = status_of(lambda: submitted.setdefault("job", user.stub.SubmitJob(
        (pb.SubmitJobRequest(**{f: m}) for f, m in request_parts(job_spec("identity", {"x": x}), {"x": x}, None,
                                                                   1 << 20)), timeout=CALL_TIMEOUT_S)))
    events: list = []
    watch = {"code": "NOT_RUN"}
    if "job" in submitted:
        watch = status_of(lambda: events.extend(user.stub.WatchJob(
            pb.WatchJobRequest(job_id=submitted["job"].job_id), timeout=CALL_TIMEOUT_S)))
    return {"submit_job": submit, "watch_job": watch, "events": len(events),
            "last_event": job_pb.JobEventType.Name(events[-1].event.type) if events else None,
            "seconds": round(time.perf_counter() - started, 3)}


def ended_idle(users: list[Principal], idle_s: float) -> dict:
    """How the held uploads ended: each status code, and the idle reason among them."""
    held = [c for user in users for c in user.calls if not c.done()]
    deadline = time.monotonic() + idle_s * 3 + 60
    while any(not c.done() for c in held) and time.monotonic() < deadline:
        time.sleep(0.2)
    codes, reasons = Counter(), Counter()
    for call in held:
        if not call.done():
            codes["STILL_OPEN"] += 1
            continue
        exc = call.exception()
        codes[exc.code().name if exc is not None else "OK"] += 1
        for detail in rpc_status.from_call(exc).details if exc is not None else ():
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reasons[info.reason] += 1
    example = next((c.exception().details() for c in held if c.done() and c.exception() is not None), "")
    return {"held": len(held), "codes": dict(codes), "reasons": dict(reasons), "example_details": example}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams-each", type=int, default=600, help="idle uploads each of the two opens")
    parser.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
                        help=f"the mesh's {MAX_STREAMS_ENV} (default: the services' own default)")
    parser.add_argument("--idle-s", type=float, default=DEFAULT_STREAM_IDLE_S,
                        help=f"the dispatcher's {STREAM_IDLE_ENV}")
    args = parser.parse_args(argv)
    os.environ[MAX_STREAMS_ENV] = str(args.max_streams)  # the services inherit this process's environment
    os.environ[STREAM_IDLE_ENV] = str(args.idle_s)
    started = time.perf_counter()
    result: dict = {"benchmark": "attacks/stream_share", "max_streams": args.max_streams,
                    "max_streams_per_client": DEFAULT_MAX_STREAMS_PER_CLIENT, "stream_idle_s": args.idle_s,
                    "streams_each": args.streams_each}
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, dispatch, one worker (mutual TLS, tokens)")
        with start_embedded_mesh(Path(tmp), devices=1, emulate=("v100-32gb",)) as mesh:
            alice, bob, carol = (Principal(mesh, f"share-{n}") for n in ("alice", "bob", "carol"))
            try:
                progress("the third user's job before any idle stream (the baseline; it compiles the program)")
                result["third_principal_before"] = served(carol)
                for user in (alice, bob):
                    progress(f"{user.name}: {args.streams_each} idle SubmitJob uploads")
                    user.open_idle(args.streams_each, args.idle_s + CALL_TIMEOUT_S)
                    refused = user.settled_refusals()
                    result[user.name] = {"opened": len(user.calls), "held": len(user.calls) - len(refused),
                                         "refused": len(refused),
                                         "first_refusal": refusal(refused[0]) if refused else None}
                result["held_together"] = result[alice.name]["held"] + result[bob.name]["held"]
                progress("the third user's job while both hold their streams")
                result["third_principal_during"] = served(carol)
                result["during_over_before_seconds"] = ratio(result["third_principal_during"]["seconds"],
                                                             result["third_principal_before"]["seconds"])
                progress(f"waiting for the dispatcher to end the idle uploads ({STREAM_IDLE_ENV}={args.idle_s:g})")
                result["idle_uploads_ended"] = ended_idle([alice, bob], args.idle_s)
            finally:
                for user in (alice, bob, carol):
                    user.close()
    during = result["third_principal_during"]
    result["third_principal_served"] = during["submit_job"]["code"] == "OK" and during["watch_job"]["code"] == "OK"
    result["no_principal_over_half"] = all(result[n]["held"] <= args.max_streams // 2
                                           for n in ("share-alice", "share-bob"))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if result["third_principal_served"] and result["no_principal_over_half"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as exc:
        print(f"stream_share: {exc.code().name}: {exc.details()}", file=sys.stderr)
        sys.exit(1)
