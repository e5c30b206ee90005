"""Reproducer: many SubmitJob calls of one tenant at once against its bound on queued jobs.

    .venv/bin/python bench/attacks/queue_bound.py [--bound 4] [--calls 16]

Starts the embedded mesh as real processes on loopback with mutual TLS and tokens (inventory,
compile, one worker emulating a V100, and a dispatcher whose ACCELMESH_MAX_QUEUED_PER_TENANT is
`--bound`), takes every device's free memory with an operator's reservation so that no job can
start and every accepted job waits in the queue, then sends `--calls` SubmitJob calls of one user
from as many threads, released together by a barrier. Prints one JSON document on stdout
(progress on stderr): how many were accepted (and are QUEUED), how many refused and with what
status and reason, and the bound. Exits 1 when more were accepted than the bound allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as dispatch_pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.tensors import to_proto
from accelmesh.security.identity import Role

CALL_TIMEOUT_S = 120.0
ROWS, WIDTH, BLOCK_ROWS = 512, 1024, 64  # 2 MiB of float32 inputs a job, in 8 blocks
OCCUPIER = "queue-bound-occupier"


def progress(message: str) -> None:
    print(f"[queue_bound] {message}", file=sys.stderr, flush=True)


def job_requests(index: int):
    spec = job_pb.JobSpec(program="identity", name=f"queue-bound-{index}", inputs=[common_pb2.TensorHeader(
        name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[ROWS, WIDTH])])
    yield dispatch_pb.SubmitJobRequest(spec=spec)
    block = np.full((BLOCK_ROWS, WIDTH), index, np.float32)
    for first in range(0, ROWS, BLOCK_ROWS):
        yield dispatch_pb.SubmitJobRequest(block=dispatch_pb.InputBlock(first_row=first, tensors=[to_proto(block)]))


def occupy_every_device(mesh) -> int:
    """Reserve all free memory of every device for an hour, as a dispatcher would (only one may):
    every job's reservation is refused."""
    security = mesh.credentials.service(Role.DISPATCH)
    with open_channel(mesh.inventory.address, security=security, role=Role.INVENTORY) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        devices = stub.ListDevices(inv_pb.ListDevicesRequest(), timeout=CALL_TIMEOUT_S).devices
        stub.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id=OCCUPIER, ttl_seconds=3600, claims=[
            inv_pb.DeviceClaim(device_id=d.id, memory_bytes=d.status.memory_free_bytes, compute_fraction=1.0)
            for d in devices]), timeout=CALL_TIMEOUT_S)
        return len(devices)


def submit_at_once(address: str, security, calls: int) -> list[dict]:
    barrier = threading.Barrier(calls)
    outcomes: list[dict] = [{} for _ in range(calls)]

    def one(index: int) -> None:
        with open_channel(address, security=security) as channel:
            stub = dispatch_service_pb2_grpc.DispatchServiceStub(channel)
            barrier.wait(CALL_TIMEOUT_S)
            try:
                job_id = stub.SubmitJob(job_requests(index), timeout=CALL_TIMEOUT_S).job_id
                state = stub.GetJob(dispatch_pb.GetJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S).job.state
                outcomes[index] = {"code": "OK", "state": job_pb.JobState.Name(state)}
            except grpc.RpcError as exc:
                outcomes[index] = {"code": exc.code().name, "reason": error_reason(exc),
                                   "details": (exc.details() or "")[:400]}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bound", type=int, default=4, help="ACCELMESH_MAX_QUEUED_PER_TENANT of the dispatcher")
    parser.add_argument("--calls", type=int, default=16, help="concurrent SubmitJob calls of one tenant")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    os.environ["ACCELMESH_MAX_QUEUED_PER_TENANT"] = str(args.bound)  # the dispatcher process inherits it
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, dispatch, one worker (mutual TLS)")
        with start_embedded_mesh(Path(tmp), devices=2, emulate=("v100-32gb",)) as mesh:
            devices = occupy_every_device(mesh)
            user = mesh.credentials.client(mesh.credentials.add_user("queue-bound-user"))
            progress(f"{args.calls} SubmitJob calls of one user at once, bound {args.bound}")
            outcomes = submit_at_once(mesh.dispatch.address, user, args.calls)
    accepted = [o for o in outcomes if o["code"] == "OK"]
    refused = [o for o in outcomes if o["code"] != "OK"]
    result = {
        "benchmark": "queue_bound", "bound": args.bound, "calls": args.calls, "devices_occupied": devices,
        "accepted": len(accepted), "accepted_states": dict(Counter(o["state"] for o in accepted)),
        "refused": len(refused), "refused_codes": dict(Counter(o["code"] for o in refused)),
        "refused_reasons": dict(Counter(o["reason"] for o in refused)),
        "refusal_example": refused[0]["details"] if refused else None,
        "bound_held": len(accepted) <= args.bound,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if result["bound_held"] else 1


if __name__ == "__main__":
    sys.exit(main())
