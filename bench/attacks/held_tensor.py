"""Reproducer: refused Execute calls that ask a worker to keep other values under a job's keys.

    .venv/bin/python bench/attacks/held_tensor.py [--forged-calls 3]

Starts the embedded mesh as real processes on loopback with mutual TLS (inventory, compile, one
worker with two CPU devices), compiles mlp_classifier for one device, and calls the worker with
the dispatcher's certificate as a dispatcher does: one call sends the parameters in full and asks
the worker to keep them under the job's keys; then `--forged-calls` calls send the same keys with
every parameter 1000 higher; then a call refers to the held keys, and its logits are compared
with a call that sends the true parameters in full. Prints one JSON document on stdout (progress
on stderr): each forged call's status, and how many rows of the by-reference answer differ.
Exits 1 when any forged call was accepted or any row differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from one folder down: bench/ (common, fuzzing) and the checkout this file is in.
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import fuzzing
import grpc
import numpy as np
from common import progress

from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.embedded import start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.tensors import TensorAssembler, split
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.programs import default_registry

CALL_TIMEOUT_S = 300.0
BATCH = 32
JOB = "held-tensor-victim"


def run(worker, head: pb.ShardHeader, params, x, refs=None) -> list[np.ndarray]:
    def messages():
        yield pb.ExecuteRequest(header=head)
        for index, array in enumerate(params):
            if refs:
                yield pb.ExecuteRequest(held=refs[index])
                continue
            tensor, chunks = split(f"input_{index}", array)
            yield pb.ExecuteRequest(tensor=tensor)
            yield from (pb.ExecuteRequest(chunk=c) for c in chunks)
        tensor, chunks = split(f"input_{len(params)}", x)
        yield pb.ExecuteRequest(tensor=tensor)
        yield from (pb.ExecuteRequest(chunk=c) for c in chunks)

    outputs: list[TensorAssembler] = []
    for part in worker.Execute(messages(), timeout=CALL_TIMEOUT_S):
        kind = part.WhichOneof("part")
        if kind == "tensor":
            outputs.append(TensorAssembler(part.tensor, "output"))
        elif kind == "chunk":
            outputs[-1].add(part.chunk)
    return [o.result() for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forged-calls", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    program = default_registry().get("mlp_classifier")
    params = [np.asarray(p) for p in program.init_params(0)]
    refs = [pb.TensorRef(name=f"input_{i}", key=f"params:{i}") for i in range(len(params))]
    rng = np.random.default_rng(0)
    x, x_later = (rng.normal(size=(BATCH, 64)).astype(np.float32) for _ in range(2))
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, one worker (mutual TLS)")
        with start_embedded_mesh(Path(tmp), devices=2, emulate=()) as mesh:
            callers = fuzzing.Callers(mesh, mesh.credentials)
            try:
                inventory = inventory_service_pb2_grpc.InventoryServiceStub(callers.channel("inventory", Role.OPERATOR))
                compiler = compile_service_pb2_grpc.CompileServiceStub(callers.channel("compile", Role.OPERATOR))
                worker = worker_service_pb2_grpc.WorkerServiceStub(callers.channel("worker", Role.DISPATCH))
                device = inventory.ListDevices(inv_pb.ListDevicesRequest(), timeout=CALL_TIMEOUT_S).devices[0]
                (build,) = compiler.Compile(compile_pb.CompileRequest(
                    program=program.name, targets=[device], batch_sizes=[BATCH]), timeout=CALL_TIMEOUT_S).builds
                artifact = build.executables[0]

                def head(job_id: str, keep: bool) -> pb.ShardHeader:
                    return pb.ShardHeader(job_id=job_id, shard_index=0, attempt=1, device_id=device.id,
                                          target_type=build.target_type, artifact_key=artifact.key,
                                          artifact_digest=artifact.digest, artifact_format=artifact.format,
                                          rule=build.rule, input_count=len(params) + 1, batch_size=BATCH,
                                          keep_tensors=refs if keep else [])

                progress("the job's parameters sent in full and kept")
                run(worker, head(JOB, True), params, x)
                forged = [p + 1000 for p in params]
                statuses = []
                for _ in range(args.forged_calls):
                    try:
                        run(worker, head(JOB, True), forged, x)
                        statuses.append({"code": "OK"})
                    except grpc.RpcError as exc:
                        statuses.append({"code": exc.code().name, "details": (exc.details() or "")[:200]})
                progress(f"{args.forged_calls} forged calls: {[s['code'] for s in statuses]}")
                (later,) = run(worker, head(JOB, False), params, x_later, refs=refs)
                (truth,) = run(worker, head("held-tensor-reference", False), params, x_later)
            finally:
                callers.close()
    rows_off = int(np.count_nonzero(np.any(later != truth, axis=tuple(range(1, later.ndim)))))
    accepted = sum(s["code"] == "OK" for s in statuses)
    result = {
        "benchmark": "held_tensor",
        "program": program.name,
        "forged_calls": statuses,
        "forged_calls_accepted": accepted,
        "rows_compared": int(later.shape[0]),
        "rows_off_after_forged_calls": rows_off,
        "passed": accepted == 0 and rows_off == 0,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
