"""Jobs and their event logs, kept in SQLite so a client can reconnect (and a restart loses no
finished result); results live as raw arrays on disk next to the database, written and read a
slab at a time so no result is ever held whole in the dispatcher's memory.

`JobBook` is the one place job state changes: every change is written through, and watchers
wait on a condition for new events instead of polling.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy for results
import numpy as np

from accelmesh import errors
from dispatch_svc import records as m
from dispatch_svc.planner.placement import LayerCost

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL, expires REAL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, event TEXT NOT NULL, PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
"""
RESTART_ERROR = "the dispatcher restarted while the job was running; submit it again"


def _plan_from(d: dict | None) -> m.Plan | None:
    if d is None:
        return None
    return m.Plan(
        targets=tuple(m.TargetPlan(**{**t, "device_ids": tuple(t["device_ids"])}) for t in d["targets"]),
        shards=tuple(m.ShardPlan(**s) for s in d["shards"]),
        predicted_seconds=d["predicted_seconds"],
        equal_split_predicted_seconds=d["equal_split_predicted_seconds"],
        placement=_placement_from(d.get("placement")),
    )


def _placement_from(d: dict | None) -> m.PlacementPlan | None:
    if d is None:
        return None
    return m.PlacementPlan(**{
        **d,
        "layers": tuple(m.LayerPlacement(**x) for x in d["layers"]),
        "stages": tuple(m.StagePlan(**x) for x in d["stages"]),
        "devices": tuple(_load_from(x) for x in d["devices"]),
        "weights": tuple(d["weights"]),
        "candidates": tuple(m.PlacementSummary(**{**x, "devices": tuple(_load_from(y) for y in x.get("devices", ()))})
                            for x in d["candidates"]),
        "explain": tuple(d["explain"]),
    })


def _load_from(d: dict) -> m.DeviceLoad:
    return m.DeviceLoad(**{**d, "layers": tuple(d["layers"])})


def _placement_spec_from(d: dict | None) -> m.PlacementSpec | None:
    if d is None:
        return None
    return m.PlacementSpec(**{**d, "weights": tuple(d["weights"]) if d["weights"] else None,
                              "layers": tuple(LayerCost(**x) for x in d["layers"])})


def _spec_from(d: dict) -> m.JobSpec:
    return m.JobSpec(
        **{
            **d,
            "constraints": m.Constraints(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["constraints"].items()}),
            "inputs": tuple(m.InputDecl(i["name"], i["dtype"], tuple(i["shape"])) for i in d["inputs"]),
            "training": m.TrainingOptions(**d["training"]) if d["training"] else None,
            "placement": _placement_spec_from(d.get("placement")),
        }
    )


def record_from(d: dict) -> m.JobRecord:
    return m.JobRecord(
        **{
            **d,
            "spec": _spec_from(d["spec"]),
            "plan": _plan_from(d["plan"]),
            "shards": [m.ShardRecord(**s) for s in d["shards"]],
        }
    )


def event_from(d: dict) -> m.Event:
    return m.Event(**{**d, "plan": _plan_from(d["plan"]), "shard": m.ShardRecord(**d["shard"]) if d["shard"] else None})


def job_not_found(job_id: str) -> errors.NotFound:
    return errors.NotFound(f"job {job_id!r} does not exist (or its results expired); ListJobs shows the jobs kept")


@dataclass(frozen=True)
class ResultEntry:
    """One result tensor on disk: raw little-endian rows, read a slab at a time."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    def read_rows(self, first: int, last: int) -> np.ndarray:
        if not self.shape:
            return np.fromfile(self.path, dtype=self.dtype, count=1).reshape(())
        count = (last - first) * int(np.prod(self.shape[1:], dtype=np.int64))
        data = np.fromfile(self.path, dtype=self.dtype, count=count, offset=first * self.row_bytes)
        return data.reshape((last - first, *self.shape[1:]))

    def read(self) -> np.ndarray:
        return self.read_rows(0, self.shape[0] if self.shape else 1)


class ResultWriter:
    """Writes rows in place (pwrite, not a memory map: written results never count against the
    dispatcher's memory)."""

    def __init__(self, entry: ResultEntry):
        self.entry = entry
        self._fd = os.open(entry.path, os.O_WRONLY | os.O_CREAT, 0o644)

    def write_rows(self, first_row: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.entry.dtype).tobytes()
        os.pwrite(self._fd, data, first_row * self.entry.row_bytes)

    def close(self) -> None:
        os.close(self._fd)


class ResultStore:
    """Each result tensor is a raw file plus a manifest entry, written as shards finish."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, job_id: str) -> Path:
        return self.root / job_id

    def create(self, job_id: str, name: str, dtype: str, shape: tuple[int, ...]) -> ResultWriter:
        folder = self._dir(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(job_id)
        manifest.append({"name": name, "dtype": dtype, "shape": list(shape)})
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return ResultWriter(self._entry(job_id, len(manifest) - 1, manifest[-1]))

    def save(self, job_id: str, name: str, value: np.ndarray) -> None:
        writer = self.create(job_id, name, str(value.dtype), value.shape)
        writer.write_rows(0, value)
        writer.close()

    def _manifest(self, job_id: str) -> list[dict]:
        path = self._dir(job_id) / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else []

    def _entry(self, job_id: str, index: int, item: dict) -> ResultEntry:
        return ResultEntry(item["name"], np.dtype(item["dtype"]), tuple(item["shape"]), self._dir(job_id) / f"{index}.bin")

    def entries(self, job_id: str) -> list[ResultEntry]:
        return [self._entry(job_id, i, item) for i, item in enumerate(self._manifest(job_id))]

    def delete(self, job_id: str) -> None:
        shutil.rmtree(self._dir(job_id), ignore_errors=True)


class JobBook:
    def __init__(self, data_dir: Path, *, retention_s: float, clock=time.time):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.results = ResultStore(self.data_dir / "results")
        self._retention_s = retention_s
        self._clock = clock
        self._db = sqlite3.connect(self.data_dir / "jobs.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL with NORMAL: a commit survives the process dying; only a power cut can lose the
        # last few, and it no longer costs an fsync per event (two events per shard).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._add_columns()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._live: dict[str, m.JobRecord] = {}
        self._event_counts: dict[str, int] = {}  # events logged per job: the next event's index
        self.interrupted = self._fail_interrupted_jobs()  # their reservations are the caller's to release
        self.expire_results()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ---------------------------------------------------------------------------

    def create(self, spec: m.JobSpec, owner: str = "") -> m.JobRecord:
        job = m.JobRecord(job_id=uuid.uuid4().hex[:16], spec=spec, created=self._clock(), owner=owner)
        with self._lock:
            self._live[job.job_id] = job
            self._save(job)
        return job

    def update(self, job: m.JobRecord, **changes) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(job, key, value)
            if job.final and job.ended is None:
                job.ended = self._clock()
                job.expires = job.ended + self._retention_s
            self._save(job)
            self._changed.notify_all()

    def finish(self, job: m.JobRecord, state: str, error: str = "", message: str = "") -> None:
        """The final event and the final state in one step, so a watcher never ends early."""
        with self._lock:
            self.emit(job, m.EVENT_FOR_STATE[state], message=message or error)
            self.update(job, state=state, error=error, progress=1.0 if state == m.SUCCEEDED else job.progress)

    def emit(self, job: m.JobRecord, type_: str, **fields) -> m.Event:
        with self._lock:
            count = self._event_counts.get(job.job_id)
            if count is None:  # first event of this job in this process: counted once, then kept
                (count,) = self._db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?", (job.job_id,)).fetchone()
            self._event_counts[job.job_id] = count + 1
            event = m.Event(index=count, type=type_, time=self._clock(), progress=job.progress, **fields)
            self._db.execute(
                "INSERT INTO events (job_id, idx, event) VALUES (?, ?, ?)",
                (job.job_id, count, json.dumps(dataclasses.asdict(event))),
            )
            self._changed.notify_all()
            return event

    def _save(self, job: m.JobRecord) -> None:
        self._db.execute(
            "INSERT INTO jobs (job_id, created, state, record, expires, owner) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(job_id) DO UPDATE SET state = excluded.state, record = excluded.record, "
            "expires = excluded.expires",
            (job.job_id, job.created, job.state, json.dumps(dataclasses.asdict(job)), job.expires, job.owner),
        )

    def _add_columns(self) -> None:
        """Books written before a column existed: add it and fill it from the records, once. Jobs
        from before owners existed get none: only operators see them."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in (("expires", "REAL"), ("owner", "TEXT NOT NULL DEFAULT ''")):
            if column in columns:
                continue
            self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
            default = None if column == "expires" else ""
            for job_id, text in self._db.execute("SELECT job_id, record FROM jobs").fetchall():
                value = json.loads(text).get(column, default)
                self._db.execute(f"UPDATE jobs SET {column} = ? WHERE job_id = ?", (value, job_id))

    def _fail_interrupted_jobs(self) -> list[str]:
        rows = self._db.execute(
            "SELECT record FROM jobs WHERE state NOT IN (?, ?, ?)", m.FINAL_STATES
        ).fetchall()
        interrupted = []
        for (text,) in rows:
            job = record_from(json.loads(text))
            self.finish(job, m.FAILED, RESTART_ERROR)
            interrupted.append(job.job_id)
        return interrupted

    def expire_results(self) -> int:
        now = self._clock()
        with self._lock:
            # Every new job sweeps: the expiry is a column, so the sweep never parses a record.
            expired = [job_id for (job_id,) in self._db.execute(
                "SELECT job_id FROM jobs WHERE expires IS NOT NULL AND expires <= ?", (now,)).fetchall()]
            for job_id in expired:
                self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                self._live.pop(job_id, None)
                self._event_counts.pop(job_id, None)
                self.results.delete(job_id)
        return len(expired)

    # -- reads ----------------------------------------------------------------------------

    def get(self, job_id: str) -> m.JobRecord:
        with self._lock:
            if job_id in self._live:
                return self._live[job_id]
            row = self._db.execute("SELECT record FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise job_not_found(job_id)
        return record_from(json.loads(row[0]))

    def list(self, limit: int, owner: str | None = None) -> list[m.JobRecord]:
        """The newest ``limit`` jobs; with ``owner``, only that owner's."""
        with self._lock:
            if owner is None:
                rows = self._db.execute("SELECT job_id FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
            else:
                rows = self._db.execute("SELECT job_id FROM jobs WHERE owner = ? ORDER BY created DESC LIMIT ?",
                                        (owner, limit)).fetchall()
        return [self.get(job_id) for (job_id,) in rows]

    def events(self, job_id: str, from_index: int = 0) -> Iterator[m.Event]:
        """Every event from `from_index` on; blocks for new ones until the job is final."""
        self.get(job_id)
        index = from_index
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT event FROM events WHERE job_id = ? AND idx >= ? ORDER BY idx", (job_id, index)
                ).fetchall()
                if not rows:
                    if self.get(job_id).final:
                        return
                    self._changed.wait()
                    continue
            for (text,) in rows:
                event = event_from(json.loads(text))
                index = event.index + 1
                yield event

    def forget_live(self, job_id: str) -> None:
        """A final job: read from the database from now on (its event count too, if ever needed)."""
        with self._lock:
            self._live.pop(job_id, None)
            self._event_counts.pop(job_id, None)

    def wake_watchers(self) -> None:
        with self._lock:
            self._changed.notify_all()
