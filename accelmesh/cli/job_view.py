"""How `accelmesh run` and `accelmesh jobs` show jobs and their events: tables, one line per event,
and the progress a running job shows on stderr.

Kept apart from the commands (jobs.py) so the text can change without touching how the
dispatcher is called, and be read in one place: every line here is built from the Job and
JobEvent messages alone, or from the JobResult of a run.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TextIO

from accelmesh.cli.tables import format_size, table
from accelmesh.dispatch.v1 import job_pb2 as job_pb

BAR_WIDTH = 30
# Events worth a line of their own while a job runs (a shard starting is not: its end says more).
NOTABLE_EVENTS = frozenset({
    job_pb.JOB_EVENT_TYPE_PLANNED, job_pb.JOB_EVENT_TYPE_COMPILED, job_pb.JOB_EVENT_TYPE_QUEUED,
    job_pb.JOB_EVENT_TYPE_SHARD_FINISHED, job_pb.JOB_EVENT_TYPE_SHARD_RETRIED, job_pb.JOB_EVENT_TYPE_TRAINING_STEP,
    job_pb.JOB_EVENT_TYPE_TAKEN_OVER, job_pb.JOB_EVENT_TYPE_SUCCEEDED, job_pb.JOB_EVENT_TYPE_FAILED,
    job_pb.JOB_EVENT_TYPE_CANCELLED,
})
# Events a terminal shows above its progress bar rather than only in it: the job waits, or lost a device.
ANNOUNCED_EVENTS = frozenset({job_pb.JOB_EVENT_TYPE_QUEUED, job_pb.JOB_EVENT_TYPE_SHARD_RETRIED,
                              job_pb.JOB_EVENT_TYPE_TAKEN_OVER})
FINAL_EVENTS = {job_pb.JOB_EVENT_TYPE_SUCCEEDED: job_pb.JOB_STATE_SUCCEEDED,
                job_pb.JOB_EVENT_TYPE_FAILED: job_pb.JOB_STATE_FAILED,
                job_pb.JOB_EVENT_TYPE_CANCELLED: job_pb.JOB_STATE_CANCELLED}
FINAL_STATES = frozenset(FINAL_EVENTS.values())
STATES = {job_pb.JobState.Name(v).removeprefix("JOB_STATE_").lower(): v
          for v in job_pb.JobState.values() if v != job_pb.JOB_STATE_UNSPECIFIED}
ACTIVE_STATES = frozenset(STATES[s] for s in ("queued", "planning", "compiling", "running"))
MAX_SHARD_ROWS = 50  # `jobs get` lists this many shards; --json has every one


def state_name(state: int) -> str:
    return job_pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def event_name(kind: int) -> str:
    return job_pb.JobEventType.Name(kind).removeprefix("JOB_EVENT_TYPE_").lower()


def clock(ts, *, date: bool = True) -> str:
    """A Timestamp in this machine's time zone; "-" when unset."""
    if not ts.seconds and not ts.nanos:
        return "-"
    moment = datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=UTC).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S.%f")[: None if date else -3]


def bytes_path(result) -> str:
    """Which way a run's tensor bytes went (docs/data-plane.md), and how many each way on the
    direct path: `accelmesh run` and `accelmesh demo` say it after a job."""
    if result.data_path != "direct":
        return "bytes: through the dispatcher (relayed on the RunJob stream)"
    ways = ", ".join(f"{way} {format_size(n)}" for way, n in sorted(result.moved_bytes.items())) or "none"
    return f"bytes: direct, client <-> the workers' object stores ({ways}); none through the dispatcher"


def describe(event: job_pb.JobEvent) -> str:
    if event.type == job_pb.JOB_EVENT_TYPE_QUEUED:
        return f"queued at position {event.queue.position}: {event.queue.reason}"
    if event.type == job_pb.JOB_EVENT_TYPE_TRAINING_STEP:
        return f"step {event.step} loss {event.loss:.4g}" + (f" ({event.message})" if event.message else "")
    return event.message


def format_event(event: job_pb.JobEvent) -> str:
    """One line of a job's log: index, time, type, what happened."""
    return f"{event.index:>4}  {clock(event.time)}  {event_name(event.type):<14}  {describe(event)}".rstrip()


def _percent(fraction: float) -> str:
    return f"{min(1.0, max(0.0, fraction)):.0%}"


def format_jobs(jobs) -> str:
    rows = [("JOB", "NAME", "PROGRAM", "STATE", "PROGRESS", "OWNER", "CREATED", "QUEUE")]
    for j in jobs:
        rows.append((j.job_id, j.spec.name or "-", j.spec.program, state_name(j.state), _percent(j.progress),
                     j.owner or "-", clock(j.create_time),
                     f"#{j.queue.position}" if j.state == job_pb.JOB_STATE_QUEUED and j.queue.position else "-"))
    return table(rows)


def _plan_lines(job: job_pb.Job) -> list[str]:
    plan = job.plan
    if not plan.targets and not plan.HasField("placement"):
        return []
    measured = f", measured {job.measured_seconds:.3f} s" if job.measured_seconds else ""
    if plan.HasField("placement"):
        p = plan.placement
        lines = [f"plan       pipeline of {len(p.stages)} stage(s) on {p.device_count} device(s), "
                 f"{p.micro_batches} micro-batch(es) of {p.micro_batch_rows} rows, predicted step "
                 f"{p.predicted_step_seconds * 1e3:.3f} ms, job {plan.predicted_seconds:.3f} s{measured}"]
    else:
        devices = {d for t in plan.targets for d in t.device_ids}
        lines = [f"plan       {len(job.shards) or len(plan.shards)} shard(s) on {len(devices)} device(s), "
                 f"predicted {plan.predicted_seconds:.3f} s{measured}"]
    rows = [("TARGET TYPE", "RULE", "DTYPE", "DEVICES")]
    rows += [(t.target_type, t.rule, t.compute_dtype, ",".join(t.device_ids)) for t in plan.targets]
    return lines + ["", table(rows)] if plan.targets else lines


def _shard_lines(job: job_pb.Job) -> list[str]:
    if not job.shards:
        return []
    rows = [("SHARD", "DEVICE", "RULE", "ROWS", "ATTEMPTS", "LOAD ms", "EXEC ms", "TOTAL ms", "PRED ms", "DONE",
             "VERIFIED")]
    for s in list(job.shards)[:MAX_SHARD_ROWS]:
        rows.append((str(s.index), s.device_id or "-", s.rule or "-", str(s.rows), str(s.attempts),
                     f"{s.load_seconds * 1e3:.1f}", f"{s.execute_seconds * 1e3:.1f}", f"{s.total_seconds * 1e3:.1f}",
                     f"{s.predicted_seconds * 1e3:.1f}", "yes" if s.done else "no", _verified(s)))
    lines = ["", table(rows)]
    if len(job.shards) > MAX_SHARD_ROWS:
        lines.append(f"... and {len(job.shards) - MAX_SHARD_ROWS} more shards (--json lists every one)")
    lines += [f"shard {s.index} failed on {failure}" for s in job.shards for failure in s.failures]
    return lines


def _verified(s: job_pb.ShardRecord) -> str:
    """How the shard's spot check came out: the device of another node that agreed, or why none did."""
    if not s.HasField("verification"):
        return "-"
    v = s.verification
    if v.outcome == job_pb.VERIFICATION_OUTCOME_MATCHED:
        return f"matched on {v.verifier_device_id}"
    return "not verifiable" if v.outcome == job_pb.VERIFICATION_OUTCOME_NOT_VERIFIABLE else "-"


def format_job(job: job_pb.Job) -> str:
    """`accelmesh jobs get`: the job, its queue place, plan summary and shards."""
    spec = job.spec
    kind = "training" if spec.kind == job_pb.JOB_KIND_TRAINING else "inference"
    lines = [
        f"job        {job.job_id}" + (f" ({spec.name})" if spec.name else ""),
        f"program    {spec.program}@{spec.version or 'latest'}, {kind}, priority {spec.priority}",
        f"state      {state_name(job.state)}, {_percent(job.progress)} done",
        f"owner      {job.owner or '-'}",
        f"created    {clock(job.create_time)}" + (f", ended {clock(job.end_time)}" if job.HasField("end_time") else "")
        + (f", results kept until {clock(job.expire_time)}" if job.HasField("expire_time") else ""),
    ]
    if job.error:
        lines.append(f"error      {job.error}")
    if job.state == job_pb.JOB_STATE_QUEUED and job.HasField("queue"):
        q = job.queue
        lines.append(f"queue      position {q.position}: {q.reason}")
        lines.append(f"           queued since {clock(q.enqueue_time)}, fails if not started by {clock(q.deadline)}")
    if job.verify_fraction:
        checked = sum(s.HasField("verification") for s in job.shards)
        lines.append(f"verify     fraction {job.verify_fraction:g}: {checked} shard(s) sampled (the VERIFIED column)")
    if job.losses:
        lines.append(f"losses     {len(job.losses)} steps, {job.losses[0]:.4g} -> {job.losses[-1]:.4g}")
    return "\n".join(lines + _plan_lines(job) + _shard_lines(job))


class RunProgress:
    """What `accelmesh run` shows on stderr while its job runs. On a terminal, one bar redrawn in
    place (a wait in the queue, a retry or a takeover is printed above it as a line of its own);
    anywhere else (a log file, CI) one plain line per notable event, in order, without control
    characters, so the log can be read and searched afterwards."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None):
        self._out = stream if stream is not None else sys.stderr
        self._tty = self._out.isatty() if tty is None else tty
        self._total = 0  # shards in the plan (0: not planned yet, or a pipeline's)
        self._done: set[int] = set()
        self._drawn = False

    def event(self, event: job_pb.JobEvent) -> None:
        if event.type == job_pb.JOB_EVENT_TYPE_PLANNED:
            self._total, self._done = len(event.plan.shards), set()
        elif event.type == job_pb.JOB_EVENT_TYPE_SHARD_FINISHED:
            self._done.add(event.shard.index)
        elif event.type == job_pb.JOB_EVENT_TYPE_TRAINING_STEP:
            self._done = set()  # the next step runs every shard again
        if event.type not in NOTABLE_EVENTS:
            return
        if self._tty:
            self._draw(event)
        else:
            print(f"{_percent(event.progress):>4} {self._count()}{describe(event)}", file=self._out, flush=True)

    def say(self, line: str) -> None:
        """A line of its own, above the bar on a terminal."""
        print(f"\r\x1b[K{line}" if self._tty and self._drawn else line, file=self._out, flush=True)

    def close(self) -> None:
        if self._drawn:
            print(file=self._out, flush=True)
            self._drawn = False

    def _count(self) -> str:
        return f"[shards {len(self._done)}/{self._total}] " if self._total else ""

    def _draw(self, event: job_pb.JobEvent) -> None:
        if event.type in ANNOUNCED_EVENTS:
            print(f"\r\x1b[K{describe(event)}", file=self._out)
        fraction = min(1.0, max(0.0, event.progress))
        filled = int(fraction * BAR_WIDTH)
        note = describe(event).splitlines()[0] if describe(event) else ""
        print(f"\r\x1b[K[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%} {self._count()}{note[:60]}",
              end="", file=self._out, flush=True)
        self._drawn = True
