"""Load: 20 jobs at once from 5 client processes (4 threads each) through one dispatcher; every
result correct, the dispatcher's memory bounded by its per-job budgets rather than by the data."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import (
    EmbeddedMesh,
    start_compile,
    start_dispatch,
    start_inventory,
    start_worker,
)
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.channels import open_channel
from compile_svc.programs import default_registry

from conftest import CREDENTIALS, peak_rss_bytes

pytestmark = pytest.mark.slow

MIB = 1 << 20
PROCESSES = 5
THREADS = 4
JOBS = PROCESSES * THREADS
# Even seeds run the MLP (compute, checked against a one-device run), odd ones the identity
# (24 MiB through and back, checked byte for byte): 320 MiB of inputs, 240 MiB of results.
PROGRAMS = (("mlp_classifier", "x", "logits", (32768, 64)), ("identity", "x", "y", (6144, 1024)))
EMULATE = ("v100-32gb",) * 4  # fp32: results equal a one-device run
INFLIGHT_BYTES = 2 * MIB
SHARD_BYTES = 512 * 1024
CHUNK_BYTES = 1 * MIB  # the client's row blocks and the dispatcher's result slabs
# Only a guard against a hang: how fast the jobs run is the machine's and bench/dispatch.py's business.
CLIENT_TIMEOUT_S = 300.0
MIN_AT_ONCE = 10
# What one running job may hold in the dispatcher: its shard inputs in flight (INFLIGHT_BYTES, kept
# until their results are in, for a retry), a shard waiting for that budget, the row block it is
# cut from and a result slab on its way back: 4.5 MiB, each byte in up to 3 places at once (numpy
# array, protobuf message, gRPC transport buffer); plus ~4 MiB that does not depend on the data
# (its seven threads, two calls' gRPC and protobuf state). 17.5 MiB a job, 350 MiB for 20, where
# holding the inputs and results whole would take 560 MiB. Measured: 180-230 MiB, the same with
# 16 or 24 MiB identity jobs: it grows with the jobs at once, not with their data.
PER_JOB_DATA_BYTES = INFLIGHT_BYTES + SHARD_BYTES + 2 * CHUNK_BYTES
PER_JOB_BOUND_BYTES = 3 * PER_JOB_DATA_BYTES + 4 * MIB
GROWTH_BOUND_BYTES = JOBS * PER_JOB_BOUND_BYTES

CLIENT = f"""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
from accelmesh.client import MeshClient

PROGRAMS = {PROGRAMS!r}
address, folder, first, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with MeshClient(address, chunk_bytes={CHUNK_BYTES}) as client:
    print("ready", flush=True)
    sys.stdin.readline()  # every client starts its jobs at once, however long this one took to start
    def run(seed):
        program, name, output, _ = PROGRAMS[seed % len(PROGRAMS)]
        result = client.run(program, {{name: np.load(folder / f"in-{{seed}}.npy")}}, name=f"load-{{seed}}", timeout=120)
        np.save(folder / f"out-{{seed}}.npy", result.outputs[output])
    with ThreadPoolExecutor({THREADS}) as pool:
        list(pool.map(run, range(first, first + count)))  # re-raises a thread's error: non-zero exit
"""


def most_at_once(jobs) -> int:
    """The most jobs the dispatcher held between their creation and their end at one time."""
    edges = sorted([(j.create_time.ToNanoseconds(), 1) for j in jobs] + [(j.end_time.ToNanoseconds(), -1) for j in jobs])
    running = peak = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak



@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("load")
    inventory = start_inventory(data_dir, CREDENTIALS)
    with EmbeddedMesh(data_dir, inventory, CREDENTIALS) as running:
        running.compile = start_compile(data_dir, CREDENTIALS)
        running.workers = [start_worker(inventory.address, running.compile.address, CREDENTIALS,
                                        devices=len(EMULATE), emulate=EMULATE, artifact_dir=data_dir / "worker-artifacts")]
        running.dispatch = start_dispatch(data_dir, inventory.address, running.compile.address, CREDENTIALS, env={
            "ACCELMESH_INFLIGHT_BYTES": str(INFLIGHT_BYTES), "ACCELMESH_MAX_SHARD_BYTES": str(SHARD_BYTES)})
        yield running


def job_inputs(seed: int) -> np.ndarray:
    shape = PROGRAMS[seed % len(PROGRAMS)][3]
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_twenty_concurrent_jobs_from_five_processes_are_correct_in_bounded_memory(mesh, tmp_path):
    import jax

    assert GROWTH_BOUND_BYTES < sum(2 * job_inputs(s).nbytes for s in range(1, JOBS, 2))  # below holding data whole
    mlp = default_registry().get("mlp_classifier")
    forward, params = jax.jit(mlp.fn), mlp.init_params(0)
    for seed in range(JOBS):
        np.save(tmp_path / f"in-{seed}.npy", job_inputs(seed))
    with MeshClient(mesh.dispatch.address) as client:  # warm: artifacts built and loaded for these shard sizes
        for seed, (program, name, _, _) in enumerate(PROGRAMS):
            client.run(program, {name: job_inputs(seed)})
    before = peak_rss_bytes(mesh.dispatch.process.pid)

    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, mesh.dispatch.address, str(tmp_path),
                                 str(p * THREADS), str(THREADS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for p in range(PROCESSES)]
    for c in clients:
        if (line := c.stdout.readline()).strip() != "ready":
            raise AssertionError(f"a client did not start: {line}{c.communicate(timeout=CLIENT_TIMEOUT_S)[0]}")
    started = time.monotonic()
    for c in clients:
        c.stdin.write("go\n")
        c.stdin.flush()
    outputs = [c.communicate(timeout=CLIENT_TIMEOUT_S)[0] for c in clients]
    wall_s = time.monotonic() - started  # reported, not judged
    growth = peak_rss_bytes(mesh.dispatch.process.pid) - before

    assert [c.returncode for c in clients] == [0] * PROCESSES, "\n".join(outputs)
    for seed in range(JOBS):
        x, got = job_inputs(seed), np.load(tmp_path / f"out-{seed}.npy")
        if PROGRAMS[seed % len(PROGRAMS)][0] == "identity":
            np.testing.assert_array_equal(got, x)
        else:
            np.testing.assert_allclose(got, np.asarray(forward(*params, x)[0]), rtol=1e-5, atol=1e-6)
    with MeshClient(mesh.dispatch.address) as client:
        jobs = [j for j in client.stub.ListJobs(pb.ListJobsRequest(page_size=100)).jobs if j.spec.name.startswith("load-")]
    assert len(jobs) == JOBS and all(j.state == job_pb.JOB_STATE_SUCCEEDED for j in jobs)
    overlap = most_at_once(jobs)
    assert overlap >= MIN_AT_ONCE, f"at most {overlap} jobs ran at once"
    assert growth < GROWTH_BOUND_BYTES, f"the dispatcher grew by {growth / MIB:.0f} MiB"
    with open_channel(mesh.inventory.address) as channel:
        stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
        assert list(stub.ListReservations(inv_pb.ListReservationsRequest()).reservations) == []
    print(f"\n{JOBS} jobs in {wall_s:.1f} s, {overlap} at once; dispatcher peak grew {growth / MIB:.0f} MiB "
          f"(bound {GROWTH_BOUND_BYTES / MIB:.0f} MiB), peak {peak_rss_bytes(mesh.dispatch.process.pid) / MIB:.0f} MiB")
