"""Abuse benchmark: what a hostile or merely heavy client can make the mesh spend, against a live mesh.

    .venv/bin/python bench/abuse.py [--quick]

Prints one JSON document on stdout (progress on stderr) and exits 1 when a reproducer finds the
mesh spending more than its request sent, or a process unhealthy. The embedded mesh runs as real
processes on loopback with mutual TLS (inventory, compile, dispatch, one worker emulating a V100).
Each reproducer reports the status its requests got and, where memory is at stake, the worker's
and the dispatcher's VmRSS before, the most seen during (sampled every 20 ms) and after; "after"
must be back within 10% of "before" (the mesh's own warm-up is done before "before").

- declared_tensors: Execute calls whose TensorHeader declares 1 GiB and sends 1 MiB, then cancel.
- failed_jobs: client-parameter jobs that receive 32 MiB of rows, then a malformed block.
- declared_rows: PlanJob and a spec-only SubmitJob declaring 2^38 and 2^34 rows; then ListJobs
  (page_size 1) and GetJob must still answer.
- idle_streams: 200 idle streams (SubmitJob, UploadProgram, Execute: spread over the processes
  that take client streams) and 200 WatchDevices subscribers open at once, while every process's
  health Check is timed (p99 must be under 100 ms).
- executable_churn: jobs of one program and input size, planned on the rates the dispatcher
  measures as they run: the distinct executable sizes the compile service built per target type.
- small: a page_token whose `after` is a dict, a 100 kB job id, Health/List, a client gone
  mid-SubmitJob (the job's state and reason), a malformed first block (its status and how long
  the refusal took), and uploads 1.0 and 1.1 of one name (both kept).

Not here, tested in the suite instead: a job outliving its reservation lease (needs a short
lease in the dispatcher's configuration: tests/e2e/test_leases.py) and signals to `accelmesh up`
at each moment of start-up (tests/shared/test_launcher.py).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fuzzing
import grpc
import numpy as np
from common import percentile, progress
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh.common.v1 import common_pb2
from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
from accelmesh.compile.v1 import compile_service_pb2_grpc
from accelmesh.compile.v1 import program_pb2 as program_pb
from accelmesh.dispatch.v1 import dispatch_service_pb2 as dispatch_pb
from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.embedded import start_embedded_mesh
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.inventory.v1 import inventory_service_pb2_grpc
from accelmesh.runtime.memory import TRIM_INTERVAL_S
from accelmesh.runtime.tensors import split, to_proto
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from accelmesh.worker.v1 import worker_service_pb2_grpc

MIB, GIB = 1 << 20, 1 << 30
EMULATE = ("v100-32gb",)
RSS_RATIO_BOUND = 1.10
HEALTH_P99_BOUND_MS = 100.0
CALL_TIMEOUT_S = 60.0
MAX_EXECUTABLE_SIZES = 6  # the bucket ladder's rungs and its tail (dispatch_svc/planner/buckets.py)


class RssSampler:
    """VmRSS of some processes: before, the most seen while running, after."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.02):
        self.pids, self.interval_s = pids, interval_s
        self.before = self.peak = self.after = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RssSampler:
        time.sleep(TRIM_INTERVAL_S + 0.5)  # what the processes hold, not what they have yet to hand back
        self.before = {name: fuzzing.rss_bytes(pid) for name, pid in self.pids.items()}
        self.peak = dict(self.before)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], fuzzing.rss_bytes(pid))

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def settle(self) -> None:
        time.sleep(TRIM_INTERVAL_S + 0.5)  # a trim pass since the calls ended (fuzzing.settled_rss)
        self.after = {name: fuzzing.rss_bytes(pid) for name, pid in self.pids.items()}

    def report(self) -> dict:
        out = {}
        for name in self.pids:
            before, peak, after = self.before[name], self.peak[name], self.after[name]
            out[name] = {"before_mib": round(before / MIB, 1), "peak_mib": round(peak / MIB, 1),
                         "after_mib": round(after / MIB, 1), "after_ratio": round(after / before, 3)}
        return out


def status_of(call: Callable[[], object]) -> dict:
    try:
        call()
        return {"code": "OK"}
    except grpc.RpcError as exc:
        return {"code": exc.code().name, "details": (exc.details() or "")[:300],
                "details_chars": len(exc.details() or "")}


class Abuse:
    def __init__(self, mesh, quick: bool):
        self.mesh, self.quick = mesh, quick
        self.callers = fuzzing.Callers(mesh, mesh.credentials)
        self.dispatch = dispatch_service_pb2_grpc.DispatchServiceStub(self.callers.channel("dispatch", Role.OPERATOR))
        self.inventory = inventory_service_pb2_grpc.InventoryServiceStub(
            self.callers.channel("inventory", Role.OPERATOR))
        self.compile = compile_service_pb2_grpc.CompileServiceStub(self.callers.channel("compile", Role.OPERATOR))
        self.worker = worker_service_pb2_grpc.WorkerServiceStub(self.callers.channel("worker", Role.DISPATCH))
        self.pids = {"worker": mesh.workers[0].process.pid, "dispatch": mesh.dispatch.process.pid}
        devices = self.inventory.ListDevices(inv_pb.ListDevicesRequest(), timeout=CALL_TIMEOUT_S).devices
        self.device = next(d for d in devices if d.node_address == mesh.workers[0].address)
        (self.build,) = self.compile.Compile(compile_pb.CompileRequest(
            program="identity", targets=[self.device], batch_sizes=[8]), timeout=300).builds
        self._warm_up()

    def _warm_up(self) -> None:
        """What every process loads once, on its first job (modules, artifacts, channels), so that
        no reproducer's "before" is taken ahead of it: an identity job and a client-parameter
        mlp job, both ordinary."""
        from accelmesh.client import MeshClient
        from compile_svc.programs import default_registry

        mlp = default_registry().get("mlp_classifier")
        parameters = [(leaf.name, np.asarray(v)) for leaf, v in zip(mlp.parameters, mlp.init_params(0), strict=True)]
        with MeshClient(self.mesh.dispatch.address, security=self.callers.security(Role.OPERATOR)) as client:
            client.run("identity", {"x": np.zeros((256, 1024), np.float32)}, name="abuse-warm-up", timeout=300)
            client.run("mlp_classifier", {"x": np.zeros((4096, 64), np.float32)}, parameters=parameters,
                       name="abuse-warm-up-parameters", timeout=300)

    def shard_header(self, job_id: str) -> worker_pb.ShardHeader:
        artifact = self.build.executables[0]
        return worker_pb.ShardHeader(job_id=job_id, shard_index=0, attempt=1, device_id=self.device.id,
                                     target_type=self.build.target_type, artifact_key=artifact.key,
                                     artifact_digest=artifact.digest, artifact_format=artifact.format,
                                     rule=self.build.rule, input_count=1, batch_size=8)

    def declared_tensors(self) -> dict:
        calls = 3 if self.quick else 9
        statuses = []
        with RssSampler(self.pids) as sampler:
            for k in range(calls):
                requests: queue.Queue = queue.Queue()
                requests.put(worker_pb.ExecuteRequest(header=self.shard_header(f"abuse-declared-{k}")))
                rows = GIB // (1024 * 4)
                requests.put(worker_pb.ExecuteRequest(tensor=common_pb2.TensorHeader(
                    name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[rows, 1024], total_bytes=GIB)))
                requests.put(worker_pb.ExecuteRequest(chunk=common_pb2.TensorChunk(offset=0, data=bytes(MIB))))
                call = self.worker.Execute(iter(requests.get, None), timeout=CALL_TIMEOUT_S)
                call.add_done_callback(lambda _c, requests=requests: requests.put(None))
                time.sleep(0.2)  # the worker takes the header and the first MiB (the reproducer's own pace)
                call.cancel()
                statuses.append(status_of(lambda c=call: list(c)))
            sampler.settle()
        return {"calls": calls, "declared_bytes_each": GIB, "sent_bytes_each": MIB, "statuses": statuses,
                "rss": sampler.report()}

    def _failing_job(self, index: int, rows: int) -> Iterator[dispatch_pb.SubmitJobRequest]:
        from compile_svc.programs import default_registry

        program = default_registry().get("mlp_classifier")
        spec = job_pb.JobSpec(program="mlp_classifier", client_parameters=True, name=f"abuse-failed-{index}",
                              inputs=[common_pb2.TensorHeader(name="x", dtype=common_pb2.DATA_TYPE_FLOAT32,
                                                              shape=[rows + 1, 64])])
        yield dispatch_pb.SubmitJobRequest(spec=spec)
        for leaf, value in zip(program.parameters, program.init_params(0), strict=True):
            header, chunks = _tensor_messages(leaf.name, np.asarray(value))
            yield dispatch_pb.SubmitJobRequest(parameter=header)
            for chunk in chunks:
                yield dispatch_pb.SubmitJobRequest(parameter_chunk=chunk)
        block_rows = MIB // (64 * 4)
        x = np.zeros((block_rows, 64), dtype=np.float32)
        for first in range(0, rows, block_rows):
            yield dispatch_pb.SubmitJobRequest(block=dispatch_pb.InputBlock(first_row=first, tensors=[to_proto(x)]))
        bad = to_proto(np.zeros((1, 63), dtype=np.float32))  # one row of the wrong width
        yield dispatch_pb.SubmitJobRequest(block=dispatch_pb.InputBlock(first_row=rows, tensors=[bad]))

    def failed_jobs(self) -> dict:
        jobs, rows = (2 if self.quick else 4), 32 * MIB // (64 * 4)
        statuses, states = [], []
        with RssSampler(self.pids) as sampler:
            for k in range(jobs):
                response = {}
                statuses.append(status_of(lambda k=k, out=response: out.setdefault(
                    "job", self.dispatch.SubmitJob(self._failing_job(k, rows), timeout=CALL_TIMEOUT_S))))
                if "job" in response:
                    states.append(self._final_state(response["job"].job_id))
            sampler.settle()
        return {"jobs": jobs, "rows_each": rows, "bytes_each": rows * 64 * 4, "submit_statuses": statuses,
                "final_states": states, "rss": sampler.report()}

    def _final_state(self, job_id: str) -> str:
        """The job's state once its event stream has ended (WatchJob ends with the job)."""
        for _ in self.dispatch.WatchJob(dispatch_pb.WatchJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S):
            pass
        job = self.dispatch.GetJob(dispatch_pb.GetJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_S).job
        return job_pb.JobState.Name(job.state)

    def declared_rows(self) -> dict:
        def spec(rows: int, name: str) -> job_pb.JobSpec:
            return job_pb.JobSpec(program="identity", name=name, inputs=[common_pb2.TensorHeader(
                name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[rows, 1024])])

        out = {}
        with RssSampler(self.pids) as sampler:
            started = time.perf_counter()
            out["plan_2_38"] = status_of(lambda: self.dispatch.PlanJob(
                dispatch_pb.PlanJobRequest(spec=spec(2**38, "abuse-plan")), timeout=CALL_TIMEOUT_S))
            out["plan_2_38"]["seconds"] = round(time.perf_counter() - started, 3)
            submitted = {}
            out["submit_2_34"] = status_of(lambda: submitted.setdefault("job", self.dispatch.SubmitJob(
                iter([dispatch_pb.SubmitJobRequest(spec=spec(2**34, "abuse-rows"))]), timeout=CALL_TIMEOUT_S)))
            out["list_jobs_page_size_1"] = status_of(lambda: self.dispatch.ListJobs(
                dispatch_pb.ListJobsRequest(page_size=1), timeout=CALL_TIMEOUT_S))
            if "job" in submitted:
                out["get_job"] = status_of(lambda: self.dispatch.GetJob(
                    dispatch_pb.GetJobRequest(job_id=submitted["job"].job_id), timeout=CALL_TIMEOUT_S))
                out["get_job_bytes"] = self.dispatch.GetJob(
                    dispatch_pb.GetJobRequest(job_id=submitted["job"].job_id), timeout=CALL_TIMEOUT_S).ByteSize()
            sampler.settle()
        out["rss"] = sampler.report()
        return out

    def idle_streams(self) -> dict:
        streams_each, watchers = (30, 30) if self.quick else (200, 200)
        opened: list = []
        ends: list[queue.Queue] = []

        def idle(stub_method, first):
            requests: queue.Queue = queue.Queue()
            requests.put(first)
            ends.append(requests)
            opened.append(stub_method(iter(requests.get, None), timeout=600))  # open, not waited for

        kinds = {
            "dispatch.SubmitJob": (self.dispatch.SubmitJob.future, lambda: dispatch_pb.SubmitJobRequest(
                spec=job_pb.JobSpec(program="identity", inputs=[common_pb2.TensorHeader(
                    name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[8, 1024])]))),
            "compile.UploadProgram": (self.compile.UploadProgram.future, lambda: compile_pb.UploadProgramRequest(
                header=compile_pb.UploadHeader(name="abuse_idle", version="1", input_names=["x"],
                                               total_bytes=MIB))),
            "worker.Execute": (self.worker.Execute, lambda: worker_pb.ExecuteRequest(
                header=self.shard_header("abuse-idle"))),
        }
        per_kind = max(1, streams_each // len(kinds))
        for stub_method, first in kinds.values():
            for _ in range(per_kind):
                idle(stub_method, first())
        watches = [self.inventory.WatchDevices(inv_pb.WatchDevicesRequest(include_existing=True), timeout=600)
                   for _ in range(watchers)]
        opened.extend(watches)
        latencies = {}
        try:
            for watch in watches:  # each subscriber is served: its first event, a device that exists
                next(watch)
            for process in ("inventory", "compile", "dispatch", "worker"):
                stub = health_pb2_grpc.HealthStub(self.callers.channel(process, Role.OPERATOR))
                times = []
                for _ in range(50 if self.quick else 200):
                    started = time.perf_counter()
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    times.append((time.perf_counter() - started) * 1e3)
                latencies[process] = {"p50_ms": round(percentile(times, 50), 2),
                                      "p99_ms": round(percentile(times, 99), 2), "n": len(times)}
            still_open = sum(1 for call in opened if not call.done())
        finally:
            for requests in ends:
                requests.put(None)
            for call in opened:
                call.cancel()
        return {"client_streams": per_kind * len(kinds), "client_streams_by_kind": dict.fromkeys(kinds, per_kind),
                "watch_devices_subscribers": watchers, "still_open_when_measured": still_open,
                "health_check": latencies,
                "p99_under_bound": all(v["p99_ms"] < HEALTH_P99_BOUND_MS for v in latencies.values())}

    def executable_churn(self) -> dict:
        from accelmesh.client import MeshClient

        jobs, rows = (10 if self.quick else 40), 1500
        x = np.random.default_rng(7).standard_normal((rows, 64)).astype(np.float32)
        splits, sizes = set(), {}  # sizes: target type -> the shard row counts its executables serve
        with MeshClient(self.mesh.dispatch.address, security=self.callers.security(Role.OPERATOR)) as client:
            for k in range(jobs):
                job = client.run("mlp_classifier", {"x": x}, name=f"abuse-churn-{k}", timeout=300).job
                splits.add(tuple(sorted((s.device_id, s.rows) for s in job.shards)))
                for shard in job.shards:
                    sizes.setdefault(shard.target_type, set()).add(shard.rows)
        return {"jobs": jobs, "rows_each": rows, "distinct_splits": len(splits),
                "executable_sizes_by_target": {t: sorted(v) for t, v in sorted(sizes.items())},
                "most_sizes_of_a_target": max((len(v) for v in sizes.values()), default=0)}

    def _disconnect_mid_submit(self) -> dict:
        gate = threading.Event()
        x = np.zeros((4096, 1024), dtype=np.float32)
        spec = job_pb.JobSpec(program="identity", name="abuse-disconnect", inputs=[common_pb2.TensorHeader(
            name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), total_bytes=x.nbytes)])

        def parts():
            yield dispatch_pb.SubmitJobRequest(spec=spec)
            yield dispatch_pb.SubmitJobRequest(block=dispatch_pb.InputBlock(first_row=0, tensors=[to_proto(x[:256])]))
            gate.wait(CALL_TIMEOUT_S)

        call = self.dispatch.SubmitJob.future(parts(), timeout=CALL_TIMEOUT_S)
        try:
            job = None
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while job is None and time.monotonic() < deadline:  # until the dispatcher has the job
                listed = self.dispatch.ListJobs(dispatch_pb.ListJobsRequest(page_size=50), timeout=CALL_TIMEOUT_S).jobs
                job = next((j for j in listed if j.spec.name == "abuse-disconnect"), None)
            call.cancel()
        finally:
            gate.set()
        final = self._final_state(job.job_id) if job else "never listed"
        got = (self.dispatch.GetJob(dispatch_pb.GetJobRequest(job_id=job.job_id), timeout=CALL_TIMEOUT_S).job
               if job else None)
        return {"final_state": final, "error": got.error if got else ""}

    def _malformed_first_block(self) -> dict:
        spec = job_pb.JobSpec(program="identity", name="abuse-malformed", inputs=[common_pb2.TensorHeader(
            name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[64, 1024], total_bytes=64 * 1024 * 4)])
        bad = to_proto(np.zeros((64, 1000), dtype=np.float32))
        started = time.perf_counter()
        out = status_of(lambda: self.dispatch.SubmitJob(iter([
            dispatch_pb.SubmitJobRequest(spec=spec),
            dispatch_pb.SubmitJobRequest(block=dispatch_pb.InputBlock(first_row=0, tensors=[bad]))]),
            timeout=CALL_TIMEOUT_S))
        out["seconds"] = round(time.perf_counter() - started, 3)
        return out

    def _two_versions(self) -> dict:
        artifact = fuzzing.exported_double()
        kept = {}
        for version in ("1.0", "1.1"):
            def upload(version=version):
                yield compile_pb.UploadProgramRequest(header=compile_pb.UploadHeader(
                    name="abuse_versions", version=version, input_names=["x"], total_bytes=len(artifact),
                    output_combine=[program_pb.COMBINE_RULE_CONCAT]))
                yield compile_pb.UploadProgramRequest(chunk=artifact)
            kept[version] = status_of(lambda u=upload: self.compile.UploadProgram(u(), timeout=CALL_TIMEOUT_S))["code"]
        listed = self.compile.ListPrograms(compile_pb.ListProgramsRequest(), timeout=CALL_TIMEOUT_S).programs
        return {"uploads": kept, "versions_listed": sorted(p.version for p in listed if p.name == "abuse_versions")}

    def small(self) -> dict:
        no_filter = hashlib.sha256(b"").hexdigest()[:16]  # what the inventory's tokens carry for filter ""
        crafted = base64.urlsafe_b64encode(json.dumps({"after": {"x": 1}, "filter": no_filter}).encode()).decode()
        health = health_pb2_grpc.HealthStub(self.callers.channel("dispatch", Role.OPERATOR))
        return {
            "inventory_page_token_dict": status_of(lambda: self.inventory.ListDevices(
                inv_pb.ListDevicesRequest(page_token=crafted), timeout=CALL_TIMEOUT_S)),
            "dispatch_100kb_job_id": status_of(lambda: self.dispatch.GetJob(
                dispatch_pb.GetJobRequest(job_id="j" * 100_000), timeout=CALL_TIMEOUT_S)),
            "health_list": status_of(lambda: health.List(health_pb2.HealthListRequest(), timeout=CALL_TIMEOUT_S))
            if hasattr(health_pb2, "HealthListRequest") else {"code": "not in this grpcio-health-checking"},
            "disconnect_mid_submit": self._disconnect_mid_submit(),
            "malformed_first_block": self._malformed_first_block(),
            "two_versions": self._two_versions(),
        }

    def health(self) -> dict:
        from accelmesh.runtime.channels import open_channel

        out = {}
        for process in ("inventory", "compile", "dispatch", "worker"):
            service = self.mesh.workers[0] if process == "worker" else getattr(self.mesh, process)
            with open_channel(service.address, security=self.callers.security(Role.OPERATOR)) as channel:
                out[process] = status_of(lambda ch=channel: health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=10))["code"] == "OK" and service.process.poll() is None
        return out


def _tensor_messages(name: str, array: np.ndarray):
    header, chunks = split(name, array)
    return header, list(chunks)


def failures(result: dict) -> list[str]:
    out = []
    for name, item in result["reproducers"].items():
        for process, rss in item.get("rss", {}).items():
            if rss["after_ratio"] > RSS_RATIO_BOUND:
                out.append(f"{name}: {process} memory after is {rss['after_ratio']}x before")
    streams = result["reproducers"].get("idle_streams", {})
    if streams and not streams["p99_under_bound"]:
        out.append(f"idle_streams: a health check p99 is over {HEALTH_P99_BOUND_MS} ms")
    rows = result["reproducers"].get("declared_rows", {})
    for key in ("list_jobs_page_size_1", "get_job"):
        if rows.get(key, {}).get("code", "OK") != "OK":
            out.append(f"declared_rows: {key} answered {rows[key]['code']}")
    small = result["reproducers"].get("small", {})
    for name, code in small.items():
        if code.get("code") in ("INTERNAL", "UNKNOWN", "UNIMPLEMENTED") or code.get("details_chars", 0) > 2048:
            out.append(f"small: {name} answered {code.get('code')} ({code.get('details_chars', 0)} chars)")
    if small and small["disconnect_mid_submit"]["final_state"] != "JOB_STATE_CANCELLED":
        out.append(f"small: a client gone mid-SubmitJob left its job {small['disconnect_mid_submit']['final_state']}")
    if small and small["two_versions"]["versions_listed"] != ["1.0", "1.1"]:
        out.append(f"small: uploads 1.0 and 1.1 kept {small['two_versions']['versions_listed']}")
    churn = result["reproducers"].get("executable_churn", {})
    if churn and churn["most_sizes_of_a_target"] > MAX_EXECUTABLE_SIZES:
        out.append(f"executable_churn: {churn['most_sizes_of_a_target']} executable sizes for one target type")
    out += [f"{process} is not healthy after" for process, ok in result["healthy_after"].items() if not ok]
    return out


REPRODUCERS = ("declared_tensors", "failed_jobs", "declared_rows", "idle_streams", "executable_churn", "small")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and streams: a smoke run")
    parser.add_argument("--only", choices=REPRODUCERS, action="append", help="run just these reproducers")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    reproducers = {}
    with tempfile.TemporaryDirectory(prefix="accelmesh-bench-") as tmp:
        progress("starting the mesh: inventory, compile, dispatch, one worker (mutual TLS)")
        with start_embedded_mesh(Path(tmp), devices=2, emulate=EMULATE) as mesh:
            abuse = Abuse(mesh, args.quick)
            try:
                for name in args.only or REPRODUCERS:
                    progress(f"reproducer {name}")
                    reproducers[name] = getattr(abuse, name)()
                healthy = abuse.health()
            finally:
                abuse.callers.close()
    result = {"benchmark": "abuse", "mode": "quick" if args.quick else "full", "machine": fuzzing_machine(),
              "reproducers": reproducers, "healthy_after": healthy}
    result["failures"] = failures(result)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 1 if result["failures"] else 0


def fuzzing_machine() -> dict:
    from fuzz import machine

    return machine()


if __name__ == "__main__":
    sys.exit(main())
