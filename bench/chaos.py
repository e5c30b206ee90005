"""Chaos soak: the replica mesh under a steady stream of mixed jobs while its processes are killed.

    .venv/bin/python bench/chaos.py [--minutes N] [--quick] [--seed S] [--clients C] [--logs DIR]

Prints one JSON document on stdout (progress on stderr). The mesh is the replica test's
(tests/replicas.py) with a third worker: two inventories, two compile services, two dispatchers
and three workers (each emulating two V100s, so every device runs the fp32 rule), one PostgreSQL
server started for the run as its own user (tests/postgres.py), mutual TLS and tokens on every
hop. A few client threads submit jobs as a user would, through `MeshClient`: half by RunJob, half
by SubmitJob then WatchJob and FetchResult, each with a request id, moving to the other dispatch
replica when theirs fails and asking again with the same request id (which returns the job the
first attempt created). The jobs: transformer inference split data-parallel over shards, mlp
training, transformer inference placed as a two-stage pipeline, and small one-device mlp
inference; more jobs at once than the six devices hold, so some queue.

Every 30-60 s (seeded: `--seed`) one process is SIGKILLed and, a few seconds later, started again
on its address: a worker, an inventory, compile or dispatch replica, or the PostgreSQL server
(postmaster and backends; it recovers from its log on start). Kinds come in a shuffled order, each
once before any comes again, so any five kills in a row cover every kind.

Correctness is against a fault-free run of each job kind made once before the first kill. The
inference kinds (data-parallel and pipelined) must be bit-identical to it: fp32 everywhere, each
row computed apart from the others, by the same executables. Training must agree within rtol 1e-5,
atol 1e-6 (the data-parallel test's tolerance): its gradient is a size-weighted mean over shards,
and a plan with another device count sums in another order.

Reported: jobs submitted, run, correct, failed with a message that says to submit again (and the
distinct messages), failed otherwise, lost (no end state after the run and a drain), stuck (ended,
but later than `--stuck-after` after submission), leaked reservations (after the drain, any whose
job ended more than one reservation lease earlier, or that the job book does not know), each
process's resident memory at the end over its figure after warm-up (bar 1.2x; a restarted
process's warm-up figure is the larger of its own after RESTART_WARMUP_S and its first
incarnation's after the warm-up: one restarted into a quiet spell, before it served every job
kind, has not yet loaded what they need; both figures are reported), the kills done, and `pass`
with the reasons for a fail. Evidence for each job that broke a rule (events, the kill before it, log lines naming it)
is under `problems`; every process's output is kept in `--logs`. Exits 1 when `pass` is false.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test harness: postgres.py and replicas.py

from common import progress, ratio  # noqa: E402

from accelmesh.client import MeshClient  # noqa: E402
from accelmesh.dispatch.v1 import dispatch_service_pb2 as dispatch_pb  # noqa: E402
from accelmesh.dispatch.v1 import job_pb2 as job_pb  # noqa: E402
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb  # noqa: E402
from accelmesh.embedded import mesh_credentials, start_worker  # noqa: E402
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb  # noqa: E402
from accelmesh.inventory.v1 import inventory_service_pb2_grpc  # noqa: E402
from accelmesh.runtime.channels import open_channel  # noqa: E402
from accelmesh.runtime.memory import TRIM_INTERVAL_S  # noqa: E402
from accelmesh.security.identity import Role  # noqa: E402

import postgres  # noqa: E402
import replicas  # noqa: E402

NODE_IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
RESERVATION_TTL_S = 10  # short, so a reservation a killed dispatcher left lapses within the drain
DISPATCH_ENV = {**replicas.DISPATCH_ENV, "ACCELMESH_RESERVATION_TTL_S": str(RESERVATION_TTL_S),
                "ACCELMESH_STAGE_CALIBRATION": "0"}  # a pipeline's stages the same in every run
KILL_GAP_S = (30.0, 60.0)
RESTART_AFTER_S = (1.0, 5.0)
KINDS = ("worker", "inventory", "compile", "dispatch", "postgres")
RSS_BAR = 1.2
USER = "soak"  # every client thread is this one user, so they share its quota
RESTART_WARMUP_S = 45.0
STALL_AFTER_S = 30.0  # jobs in flight and none ended this long: evidence is written (StallWatch)
RESUBMIT = re.compile(r"submit\b.*\bagain|resubmit", re.IGNORECASE)
TRAINING_RTOL, TRAINING_ATOL = 1e-5, 1e-6
FINAL = {job_pb.JOB_STATE_SUCCEEDED, job_pb.JOB_STATE_FAILED, job_pb.JOB_STATE_CANCELLED}

rng_inputs = np.random.default_rng(20261207)
TOKENS = rng_inputs.integers(0, 512, size=(256, 32), dtype=np.int32)  # 8 shards of 32 rows
PIPE_TOKENS = rng_inputs.integers(0, 512, size=(48, 32), dtype=np.int32)
TRAIN_X = rng_inputs.standard_normal((256, 64), dtype=np.float32)
TRAIN_Y = rng_inputs.integers(0, 10, size=256, dtype=np.int32)
SMALL_X = rng_inputs.standard_normal((64, 64), dtype=np.float32)

# kind -> (program, inputs, spec options, bit-identical)
JOBS = {
    "inference": ("transformer_encoder", {"tokens": TOKENS}, {}, True),
    "training": ("mlp_train_step", {"x": TRAIN_X, "y": TRAIN_Y},
                 {"training": job_pb.TrainingOptions(epochs=1, batch_size=64, learning_rate=0.1, momentum=0.9)},
                 False),
    "pipeline": ("transformer_encoder", {"tokens": PIPE_TOKENS},
                 {"placement": plan_pb.PlacementOptions(strategy=plan_pb.PLACEMENT_STRATEGY_BALANCED, device_count=2,
                                                        micro_batch_rows=8)}, True),
    "small": ("mlp_classifier", {"x": SMALL_X}, {"max_devices": 1}, True),
}


# ---- the pure rules: schedule, comparison, leaks, verdict ----------------------------------------

@dataclass(frozen=True)
class Kill:
    at_s: float  # seconds after the soak began
    kind: str
    target: str  # a process name, or "postgres"
    restart_after_s: float


def kill_schedule(seed: int, duration_s: float, targets: dict[str, list[str]],
                  gap_s: tuple[float, float] = KILL_GAP_S,
                  restart_after_s: tuple[float, float] = RESTART_AFTER_S) -> list[Kill]:
    """Kills every `gap_s` (uniform) within `duration_s`; kinds in shuffled rounds, each kind once a
    round, so every kind is hit by any len(targets) kills in a row; the target within a kind at random."""
    rng = random.Random(seed)
    kills, round_, at = [], [], rng.uniform(*gap_s)
    while at < duration_s:
        if not round_:
            round_ = sorted(targets)
            rng.shuffle(round_)
        kind = round_.pop()
        kills.append(Kill(round(at, 3), kind, rng.choice(targets[kind]), round(rng.uniform(*restart_after_s), 3)))
        at += rng.uniform(*gap_s)
    return kills


def compare(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], exact: bool) -> tuple[bool, float]:
    """Whether `outputs` equal the reference (bit for bit, or within the training tolerance), and the
    largest difference relative to the reference's largest magnitude."""
    if set(outputs) != set(reference):
        return False, float("inf")
    worst, ok = 0.0, True
    for name, want in reference.items():
        got = outputs[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            return False, float("inf")
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        worst = max(worst, float(np.max(diff)) / scale if diff.size and scale > 0 else float(np.max(diff, initial=0)))
        ok = ok and (np.array_equal(got, want) if exact
                     else bool(np.allclose(got, want, rtol=TRAINING_RTOL, atol=TRAINING_ATOL)))
    return ok, worst


def leaked_reservations(reservations: list[dict], job_ends: dict[str, float | None], now: float,
                        lease_s: float) -> list[dict]:
    """Reservations that outlive their job by more than one lease: the job ended (at the time
    `job_ends` gives) more than `lease_s` before `now`, or the book does not know the job. A job
    still running (None) holds its reservations rightly; it is counted as lost or stuck instead."""
    leaked = []
    for reservation in reservations:
        job_id = reservation["job_id"]
        if job_id not in job_ends:
            leaked.append({**reservation, "why": "the job book has no such job"})
        elif job_ends[job_id] is not None and now - job_ends[job_id] > lease_s:
            leaked.append({**reservation, "why": f"its job ended {now - job_ends[job_id]:.1f} s earlier"})
    return leaked


def verdict(counts: dict, memory: dict[str, dict], leaked: int, rss_bar: float = RSS_BAR) -> tuple[bool, list[str]]:
    """`pass`, and a reason for each rule broken: every job submitted ends, SUCCEEDED and correct or
    FAILED saying to submit again; none lost, stuck or unsubmittable; no reservation leaked; no
    process's memory above the bar."""
    reasons = []
    for key, what in (("lost", "lost (never ended)"), ("stuck", "stuck (ended past the bound)"),
                      ("wrong", "succeeded with results unlike the fault-free run"),
                      ("failed_unclear", "failed without saying to submit again"),
                      ("cancelled", "cancelled, though nobody cancelled them"),
                      ("not_submitted", "could never be submitted")):
        if counts.get(key):
            reasons.append(f"{counts[key]} jobs {what}")
    if counts.get("submitted", 0) and not counts.get("correct"):
        reasons.append("no job succeeded")
    if leaked:
        reasons.append(f"{leaked} reservations leaked")
    for name, figure in sorted(memory.items()):
        if figure.get("ratio") is not None and figure["ratio"] > rss_bar:
            reasons.append(f"{name}: resident memory {figure['ratio']}x its warm-up figure (bar {rss_bar}x)")
    return not reasons, reasons


# ---- the mesh ------------------------------------------------------------------------------------

class SoakMesh(replicas.Replicas):
    """tests/replicas.py's mesh with three workers, each restartable on its address."""

    def __init__(self, data_dir: Path, credentials, server: postgres.PostgresServer, log_dir: Path):
        self.server, self.log_dir = server, log_dir
        self.incarnations: dict[str, int] = {}
        self.started_at: dict[str, float] = {}
        import sqlalchemy as sa

        self.data_dir, self.credentials = data_dir, credentials
        self.inventory_db, self.dispatch_db = server.database(), server.database()
        self.inventories, self.compiles, self.workers, self.dispatchers = [], [], [], []
        self._inventory_engine = sa.create_engine(self.inventory_db.replace("postgresql://", "postgresql+psycopg://"))
        try:
            self.inventories = [self._started(self.start_inventory(i)) for i in range(2)]
            self.compiles = [self._started(self.start_compile(i)) for i in range(2)]
            self.workers = [self._started(self.start_node(i)) for i in range(len(NODE_IPS))]
            self.dispatchers = [self._started(self.start_dispatch(i)) for i in range(2)]
        except BaseException:
            self.stop()
            raise

    def _started(self, process):
        self.started_at[process.name] = time.monotonic()
        self.incarnations[process.name] = self.incarnations.get(process.name, -1) + 1
        return process

    def start_node(self, index: int, listen: str = ""):
        ip = NODE_IPS[index]
        tls = self.credentials.issue(Role.WORKER, f"node-{ip}", [ip]).tls
        return start_worker(replicas.both(self.inventories), replicas.both(self.compiles), self.credentials,
                            devices=len(replicas.EMULATE), emulate=replicas.EMULATE, listen=listen or f"{ip}:0",
                            artifact_dir=self.data_dir / f"artifacts-{ip}", name=f"worker-{index}",
                            env={"ACCELMESH_CERT_FILE": str(tls.cert_file), "ACCELMESH_KEY_FILE": str(tls.key_file)})

    def start_dispatch(self, index: int, listen: str = "127.0.0.1:0"):
        from accelmesh.embedded import start_dispatch

        return start_dispatch(self.data_dir, replicas.both(self.inventories), replicas.both(self.compiles),
                              self.credentials, env={**DISPATCH_ENV, "ACCELMESH_DISPATCH_DB": self.dispatch_db},
                              name=f"dispatch-{index}", listen=listen)

    def processes(self) -> dict[str, object]:
        return {p.name: p for p in [*self.inventories, *self.compiles, *self.workers, *self.dispatchers]}

    def targets(self) -> dict[str, list[str]]:
        return {"worker": [p.name for p in self.workers], "inventory": [p.name for p in self.inventories],
                "compile": [p.name for p in self.compiles], "dispatch": [p.name for p in self.dispatchers],
                "postgres": ["postgres"]}

    def save_log(self, process) -> None:
        path = self.log_dir / f"{process.name}.{self.incarnations[process.name]}.log"
        path.write_text("\n".join(process.output) + "\n")

    def kill(self, target: str) -> None:
        if target == "postgres":
            self.server.kill()
            return
        process = self.processes()[target]
        process.kill()
        self.save_log(process)

    def restart(self, target: str) -> None:
        if target == "postgres":
            self.server.start()
            return
        kind, index = target.rsplit("-", 1)
        group = {"inventory": self.inventories, "compile": self.compiles, "worker": self.workers,
                 "dispatch": self.dispatchers}[kind]
        start = {"inventory": self.start_inventory, "compile": self.start_compile, "worker": self.start_node,
                 "dispatch": self.start_dispatch}[kind]
        group[int(index)] = self._started(start(int(index), group[int(index)].address))

    def reservations(self) -> list[dict]:
        for process in self.inventories:
            try:
                with open_channel(process.address, security=self.credentials.client()) as channel:
                    stub = inventory_service_pb2_grpc.InventoryServiceStub(channel)
                    found = stub.ListReservations(inv_pb.ListReservationsRequest(), timeout=30).reservations
                return [{"job_id": r.job_id, "device_id": r.device_id,
                         "expire_time": round(replicas.seconds(r.expire_time), 3)} for r in found]
            except grpc.RpcError:
                continue
        raise RuntimeError("no inventory replica answered ListReservations")


# ---- the clients ---------------------------------------------------------------------------------

@dataclass
class JobRun:
    kind: str
    mode: str  # "run" (RunJob) or "submit" (SubmitJob, WatchJob, FetchResult)
    client: int
    request_id: str
    submitted_at: float
    job_id: str = ""
    state: str = ""
    error: str = ""
    ended_at: float | None = None
    correct: bool | None = None
    max_rel_diff: float | None = None
    queued: bool = False
    events: list[str] = field(default_factory=list)
    rpc_errors: list[str] = field(default_factory=list)


def describe(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return f"{code.name if code else 'ERROR'}: {(error.details() if hasattr(error, 'details') else str(error))[:300]}"


class Client:
    """One user: jobs one after another, of kinds drawn with its seed, over either dispatch replica."""

    def __init__(self, index: int, mesh: SoakMesh, user, references: dict, seed: int, stop: threading.Event,
                 stuck_after_s: float, runs: list[JobRun], lock: threading.Lock):
        self.index, self.mesh, self.user, self.references = index, mesh, user, references
        self.rng, self.stop, self.stuck_after_s = random.Random(seed * 1000 + index), stop, stuck_after_s
        self.runs, self.lock = runs, lock
        self.dispatcher = index % 2

    def address(self) -> str:
        return self.mesh.dispatchers[self.dispatcher].address

    def other(self) -> None:
        self.dispatcher = 1 - self.dispatcher

    def loop(self) -> None:
        while not self.stop.is_set():
            kind = self.rng.choice(sorted(JOBS))
            run = JobRun(kind, "run" if self.index % 2 else "submit", self.index, str(uuid.uuid4()), time.time())
            with self.lock:
                self.runs.append(run)
            try:
                self.one(run)
            except Exception as exc:  # noqa: BLE001 - the soak goes on; what broke is in the job's record
                run.rpc_errors.append(f"client: {type(exc).__name__}: {exc}"[:300])

    def one(self, run: JobRun) -> None:
        program, inputs, options, _ = JOBS[run.kind]
        give_up = run.submitted_at + 2 * self.stuck_after_s
        if run.mode == "run":
            try:
                with MeshClient(self.address(), security=self.user) as client:
                    result = client.run(program, inputs, request_id=run.request_id, timeout=self.stuck_after_s,
                                        on_event=lambda e: self.note(run, e), **options)
                self.finish(run, result.job, result.outputs)
                return
            except grpc.RpcError as error:
                run.rpc_errors.append(describe(error))
                self.other()
        while not run.job_id and time.time() < give_up:
            try:
                with MeshClient(self.address(), security=self.user) as client:
                    run.job_id = client.submit(program, inputs, request_id=run.request_id, timeout=60, **options)
            except grpc.RpcError as error:
                run.rpc_errors.append(describe(error))
                self.other()
                time.sleep(1.0)
        self.follow(run, give_up)

    def note(self, run: JobRun, event) -> None:
        run.job_id = run.job_id or event.job_id
        run.events.append(job_pb.JobEventType.Name(event.type).removeprefix("JOB_EVENT_TYPE_"))
        run.queued = run.queued or event.type == job_pb.JOB_EVENT_TYPE_QUEUED

    def follow(self, run: JobRun, give_up: float) -> None:
        """Watch the job to its end, then fetch its results, across dispatcher failures."""
        while run.job_id and time.time() < give_up:
            try:
                with MeshClient(self.address(), security=self.user) as client:
                    seen = []
                    for event in client.watch(run.job_id):
                        seen.append(event)
                    job = client.get(run.job_id)
                    if job.state not in FINAL:
                        time.sleep(0.5)
                        continue
                    run.events = []
                    for event in seen:
                        self.note(run, event)
                    outputs = client.fetch_result(run.job_id) if job.state == job_pb.JOB_STATE_SUCCEEDED else {}
                self.finish(run, job, outputs)
                return
            except grpc.RpcError as error:
                run.rpc_errors.append(describe(error))
                self.other()
                time.sleep(1.0)

    def finish(self, run: JobRun, job, outputs: dict) -> None:
        record_end(run, job, outputs, self.references)


def record_end(run: JobRun, job, outputs: dict, references: dict) -> None:
    run.job_id = job.job_id
    run.state = job_pb.JobState.Name(job.state).removeprefix("JOB_STATE_")
    run.error = job.error
    run.ended_at = replicas.seconds(job.end_time) if job.HasField("end_time") else None
    if job.state == job_pb.JOB_STATE_SUCCEEDED:
        run.correct, run.max_rel_diff = compare(outputs, references[run.kind], JOBS[run.kind][3])


def resolve(mesh: SoakMesh, run: JobRun, references: dict) -> None:
    """A job its client gave up on: its state now, from either dispatcher."""
    if not run.job_id:
        return
    for process in mesh.dispatchers:
        try:
            with MeshClient(process.address, security=mesh.credentials.client()) as client:
                job = client.get(run.job_id)
                if job.state in FINAL:
                    outputs = client.fetch_result(run.job_id) if job.state == job_pb.JOB_STATE_SUCCEEDED else {}
                    record_end(run, job, outputs, references)
                else:
                    run.state = job_pb.JobState.Name(job.state).removeprefix("JOB_STATE_")
            return
        except grpc.RpcError as error:
            run.rpc_errors.append(describe(error))


# ---- the run -------------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


class Memory:
    """Each process incarnation's resident memory after its warm-up, and at the end."""

    def __init__(self, mesh: SoakMesh):
        self.mesh = mesh
        self.warm: dict[str, tuple[int, int]] = {}  # name -> (incarnation, bytes)
        self.first: dict[str, int] = {}  # name -> bytes after the warm-up, of the incarnation that ran it

    def baseline_all(self) -> None:
        for name, process in self.mesh.processes().items():
            self.warm[name] = (self.mesh.incarnations[name], rss_bytes(process.process.pid))
            self.first[name] = self.warm[name][1]

    def sample(self) -> None:
        """A restarted process's warm-up figure, once it has run RESTART_WARMUP_S."""
        for name, process in self.mesh.processes().items():
            incarnation = self.mesh.incarnations[name]
            if self.warm.get(name, (-1, 0))[0] != incarnation and \
                    time.monotonic() - self.mesh.started_at[name] >= RESTART_WARMUP_S:
                self.warm[name] = (incarnation, rss_bytes(process.process.pid))

    def report(self) -> dict[str, dict]:
        out = {}
        for name, process in sorted(self.mesh.processes().items()):
            incarnation, own = self.warm.get(name, (-1, 0))
            now = rss_bytes(process.process.pid)
            current = incarnation == self.mesh.incarnations[name]
            warm = max(own, self.first.get(name, 0)) if current else 0
            out[name] = {"restarts": self.mesh.incarnations[name],
                         "warm_mib": round(own / 2**20, 1) if current else None,
                         "first_warm_mib": round(self.first.get(name, 0) / 2**20, 1),
                         "end_mib": round(now / 2**20, 1), "ratio": ratio(now, warm) if warm else None}
        return out


class StallWatch:
    """Evidence when the mesh goes quiet: jobs in flight but none ended for STALL_AFTER_S.

    Each time (at most once a STALL_AFTER_S) it writes `stall-N.txt` to the log folder: the
    dispatch database's sessions and the locks they wait on, and, where py-spy is on PATH, every
    dispatcher's Python stacks. A stall's cause is then read from the files, not guessed."""

    def __init__(self, mesh: SoakMesh, runs: list[JobRun], lock: threading.Lock):
        self.mesh, self.runs, self.lock = mesh, runs, lock
        self.files: list[str] = []
        self.last_end = self.last_dump = time.time()
        self.engine = None

    def sample(self) -> None:
        now = time.time()
        with self.lock:
            ends = [r.ended_at for r in self.runs if r.ended_at]
            in_flight = sum(1 for r in self.runs if r.ended_at is None)
        self.last_end = max([self.last_end, *ends])
        if in_flight and now - self.last_end >= STALL_AFTER_S and now - self.last_dump >= STALL_AFTER_S:
            self.last_dump = now
            self.dump(now, in_flight)

    def dump(self, now: float, in_flight: int) -> None:
        path = self.mesh.log_dir / f"stall-{len(self.files)}.txt"
        parts = [f"{time.strftime('%H:%M:%S', time.gmtime(now))} UTC: {in_flight} jobs in flight, none ended "
                 f"for {now - self.last_end:.0f} s"]
        parts.append(self.database())
        spy = shutil.which("py-spy")
        if spy is None:
            parts.append("py-spy is not on PATH: no stacks")
        for process in self.mesh.dispatchers if spy else []:
            found = subprocess.run([spy, "dump", "--pid", str(process.process.pid)], capture_output=True,
                                   text=True, timeout=30, check=False)
            parts.append(f"== {process.name} (pid {process.process.pid})\n{found.stdout}{found.stderr}")
        path.write_text("\n\n".join(parts) + "\n")
        self.files.append(path.name)
        progress(f"no job ended for {now - self.last_end:.0f} s with {in_flight} in flight: evidence in {path}")

    def database(self) -> str:
        import sqlalchemy as sa

        try:
            if self.engine is None:
                self.engine = sa.create_engine(self.mesh.dispatch_db.replace("postgresql://",
                                                                             "postgresql+psycopg://"))
            with self.engine.connect() as connection:
                sessions = connection.execute(sa.text(
                    "SELECT pid, state, wait_event_type, wait_event, now() - xact_start AS in_xact, "
                    "pg_blocking_pids(pid) AS blocked_by, left(query, 200) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")).fetchall()
                locks = connection.execute(sa.text(
                    "SELECT pid, locktype, relation::regclass, mode, granted FROM pg_locks "
                    "WHERE NOT granted OR pid IN "
                    "(SELECT unnest(pg_blocking_pids(a.pid)) FROM pg_stat_activity a)")).fetchall()
        except Exception as exc:  # noqa: BLE001 - the database may be the one down: say so and go on
            self.engine = None
            return f"dispatch database not read: {exc}"
        return "sessions:\n" + "\n".join(map(str, sessions)) + "\nlocks waited on or blocking:\n" + \
            "\n".join(map(str, locks))


def reference_outputs(mesh: SoakMesh) -> dict[str, dict[str, np.ndarray]]:
    references = {}
    with MeshClient(mesh.dispatchers[0].address, security=mesh.credentials.client()) as client:
        for kind, (program, inputs, options, _) in JOBS.items():
            result = client.run(program, inputs, timeout=600, **options)
            references[kind] = result.outputs
            progress(f"reference {kind}: {result.job.plan.placement.strategy and 'placed' or 'split'} over "
                     f"{len({s.device_id for s in result.job.shards})} devices")
    return references


def warm_up(mesh: SoakMesh, user, references: dict, clients: int, rounds: int = 2) -> tuple[list[str], list[str]]:
    """Every kind on every client at once, `rounds` times, alternating the dispatchers: each process
    has then done what it does in the soak. Returns the jobs unlike the reference (a fault-free run
    must match it) and the errors that had a job submitted again."""
    mismatched, errors = [], []

    def one(index: int, kind: str) -> None:
        program, inputs, options, exact = JOBS[kind]
        for _ in range(5):
            try:
                with MeshClient(mesh.dispatchers[index % 2].address, security=user) as client:
                    result = client.run(program, inputs, timeout=600, **options)
                break
            except grpc.RpcError as error:
                errors.append(f"{kind}: {describe(error)}")
                time.sleep(1.0)
        else:
            return
        ok, diff = compare(result.outputs, references[kind], exact)
        if not ok:
            mismatched.append(f"{kind} {result.job.job_id}: largest relative difference {diff:.3g}")

    for round_ in range(rounds):
        threads = [threading.Thread(target=one, args=(index + round_, kind), daemon=True)
                   for index in range(clients) for kind in JOBS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return mismatched, errors


def set_pool_quota(mesh: SoakMesh, tenant: str) -> None:
    """The clients' tenant may hold as many devices at once as the pool has: with several jobs
    each asking for several devices, some wait in the queue."""
    with MeshClient(mesh.dispatchers[0].address, security=mesh.credentials.client()) as operator:
        operator.stub.SetQuota(dispatch_pb.SetQuotaRequest(quota=dispatch_pb.Quota(
            tenant=tenant, max_devices=2 * len(NODE_IPS))))


def normalized(message: str) -> str:
    return re.sub(r"\b[0-9a-f]{8,}(-[0-9a-f]{4,})*\b", "<id>", message)


def log_lines(mesh: SoakMesh, job_id: str, limit: int = 12) -> list[str]:
    """The lines naming the job in every incarnation's saved output (each is saved when killed and
    at the end)."""
    lines = []
    for path in sorted(mesh.log_dir.glob("*.log")):
        lines += [f"{path.stem}: {line}" for line in path.read_text().splitlines() if job_id in line]
    return [line[:400] for line in lines[:limit]]


def evidence(mesh: SoakMesh, run: JobRun, why: str, kills: list[dict], began: float) -> dict:
    start, end = run.submitted_at - began, (run.ended_at or time.time()) - began
    return {"why": why, "job_id": run.job_id, "kind": run.kind, "mode": run.mode, "state": run.state,
            "error": run.error, "submitted_s": round(start, 1), "ended_s": round(end, 1) if run.ended_at else None,
            "events": run.events, "rpc_errors": run.rpc_errors[-6:],
            "kill_before": next((k for k in reversed(kills) if k["at_s"] <= start), None),
            "kills_during": [k for k in kills if start < k["at_s"] <= end],
            "log_lines": log_lines(mesh, run.job_id) if run.job_id else []}


def tally(runs: list[JobRun], stuck_after_s: float) -> tuple[dict, dict[str, list[JobRun]]]:
    """Counts of each outcome and the runs behind the ones that break a rule."""
    bad: dict[str, list[JobRun]] = {k: [] for k in ("lost", "stuck", "wrong", "failed_unclear", "cancelled",
                                                    "not_submitted")}
    counts = {"submitted": 0, "run": 0, "correct": 0, "failed_resubmit": 0, "queued": 0}
    for run in runs:
        if not run.job_id:
            bad["not_submitted"].append(run)
            continue
        counts["submitted"] += 1
        counts["queued"] += run.queued
        if run.state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            bad["lost"].append(run)
            continue
        counts["run"] += 1
        if run.ended_at is not None and run.ended_at - run.submitted_at > stuck_after_s:
            bad["stuck"].append(run)
        if run.state == "SUCCEEDED":
            if run.correct:
                counts["correct"] += 1
            else:
                bad["wrong"].append(run)
        elif run.state == "CANCELLED":
            bad["cancelled"].append(run)
        elif RESUBMIT.search(run.error):
            counts["failed_resubmit"] += 1
        else:
            bad["failed_unclear"].append(run)
    counts.update({k: len(v) for k, v in bad.items()})
    return counts, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 minutes (3-4 kills)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--stuck-after", type=float, default=120.0, help="a job must end this many seconds after "
                        "its submission")
    parser.add_argument("--logs", type=Path, default=None, help="folder for every process's output")
    args = parser.parse_args()
    minutes, clients = (2.0, args.clients) if args.quick else (args.minutes, args.clients)
    binaries = postgres.find_binaries()
    if binaries is None:
        print(json.dumps({"benchmark": "chaos", "skipped": postgres.HOW_TO_ENABLE}))
        return 0
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="accelmesh-chaos-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server = postgres.PostgresServer(binaries, durable_commits=True)  # a crash loses no acknowledged commit
    data_dir = Path(tempfile.mkdtemp(prefix="accelmesh-bench-chaos-"))
    credentials = mesh_credentials(data_dir)
    progress(f"starting 2 inventories, 2 compile services, {len(NODE_IPS)} workers and 2 dispatchers on one "
             f"PostgreSQL; logs in {log_dir}")
    mesh = SoakMesh(data_dir, credentials, server, log_dir)
    runs: list[JobRun] = []
    kills: list[dict] = []
    try:
        references = reference_outputs(mesh)
        user = credentials.client(credentials.add_user(USER))
        set_pool_quota(mesh, f"user:{USER}")
        warm_mismatch, warm_errors = warm_up(mesh, user, references, clients)
        progress(f"warmed up ({len(warm_mismatch)} fault-free jobs unlike the reference, {len(warm_errors)} "
                 "submitted again)")
        time.sleep(TRIM_INTERVAL_S + 0.5)
        memory = Memory(mesh)
        memory.baseline_all()
        schedule = kill_schedule(args.seed, minutes * 60, mesh.targets())
        stop, lock = threading.Event(), threading.Lock()
        watch = StallWatch(mesh, runs, lock)
        workers = [threading.Thread(target=Client(i, mesh, user, references, args.seed, stop, args.stuck_after, runs,
                                                  lock).loop, name=f"client-{i}", daemon=True)
                   for i in range(clients)]
        began = time.time()
        began_mono = time.monotonic()
        for thread in workers:
            thread.start()

        def idle_until(moment: float) -> None:
            while time.monotonic() < moment:
                memory.sample()
                watch.sample()
                time.sleep(min(1.0, max(0.0, moment - time.monotonic())))

        for planned in schedule:
            idle_until(began_mono + planned.at_s)
            killed = time.time()
            mesh.kill(planned.target)
            progress(f"{killed - began:.0f} s: killed {planned.target}; {len(runs)} jobs so far")
            idle_until(time.monotonic() + planned.restart_after_s)
            for attempt in range(3):
                try:
                    mesh.restart(planned.target)
                    break
                except Exception as exc:  # noqa: BLE001 - a failed start is tried again: the soak needs it
                    progress(f"restart of {planned.target} failed ({attempt + 1}/3): {exc}")
            kills.append({"at_s": round(killed - began, 1), "target": planned.target,
                          "down_s": round(time.time() - killed, 1)})
        idle_until(began_mono + minutes * 60)
        stop.set()
        progress(f"soak over after {time.time() - began:.0f} s; draining {len(runs)} jobs")
        for thread in workers:
            thread.join(timeout=max(0.0, began + minutes * 60 + 2 * args.stuck_after - time.time()))
            memory.sample()
        for run in runs:
            if run.state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                resolve(mesh, run, references)
        # Every job has ended (or is lost): what the inventory still holds one lease from now is leaked.
        time.sleep(RESERVATION_TTL_S + 2)
        memory.sample()
        looked_at = time.time()
        held = mesh.reservations()
        job_ends = {r.job_id: r.ended_at for r in runs if r.job_id}
        for job_id in {r["job_id"] for r in held} - job_ends.keys():
            try:
                with MeshClient(mesh.dispatchers[0].address, security=credentials.client()) as client:
                    job = client.get(job_id)
                job_ends[job_id] = replicas.seconds(job.end_time) if job.state in FINAL else None
            except grpc.RpcError:
                pass
        leaked = leaked_reservations(held, job_ends, looked_at, RESERVATION_TTL_S)
        figures = memory.report()
        alive = {name: p.process.poll() is None for name, p in mesh.processes().items()}
    finally:
        for process in mesh.processes().values():
            mesh.save_log(process)
        mesh.stop()
        server.stop()
    counts, bad = tally(runs, args.stuck_after)
    passed, reasons = verdict(counts, figures, len(leaked))
    if warm_mismatch:
        passed, reasons = False, [*reasons, f"{len(warm_mismatch)} fault-free warm-up jobs unlike the reference"]
    if not all(alive.values()):
        passed, reasons = False, [*reasons, f"processes not alive at the end: {[n for n, a in alive.items() if not a]}"]
    messages: dict[str, int] = {}
    for run in runs:
        if run.state == "FAILED":
            messages[normalized(run.error)] = messages.get(normalized(run.error), 0) + 1
    client_errors: dict[str, int] = {}
    for run in runs:
        for error in run.rpc_errors:
            client_errors[normalized(error)] = client_errors.get(normalized(error), 0) + 1
    by_kind = {kind: tally([r for r in runs if r.kind == kind], args.stuck_after)[0] for kind in JOBS}
    walls = sorted(r.ended_at - r.submitted_at for r in runs if r.ended_at)
    print(json.dumps({
        "benchmark": "chaos", "machine": platform.machine(), "python": platform.python_version(),
        "seed": args.seed, "minutes": minutes, "clients": clients, "devices": 2 * len(NODE_IPS),
        "dispatch_lease_s": replicas.LEASE_S, "reservation_lease_s": RESERVATION_TTL_S,
        "stuck_after_s": args.stuck_after, "rss_bar": RSS_BAR,
        "correctness": {"inference": "bit-identical", "pipeline": "bit-identical", "small": "bit-identical",
                        "training": f"rtol {TRAINING_RTOL}, atol {TRAINING_ATOL}"},
        "jobs": counts, "by_kind": by_kind,
        "job_wall_s": {"median": round(walls[len(walls) // 2], 2), "max": round(walls[-1], 2)} if walls else None,
        "largest_training_rel_diff": max((r.max_rel_diff or 0 for r in runs if r.kind == "training"), default=None),
        "failure_messages": messages, "client_errors": client_errors,
        "leaked_reservations": leaked, "reservations_at_end": len(held),
        "memory": figures, "kills": kills, "warm_up_mismatches": warm_mismatch,
        "warm_up_errors": sorted(set(warm_errors)),
        "problems": [evidence(mesh, run, why, kills, began) for why, group in bad.items() for run in group],
        "stalls": watch.files, "logs": str(log_dir), "pass": passed, "reasons": reasons,
    }, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
