"""`accelmesh run`, `accelmesh jobs` and `accelmesh quota` against a real mesh (an inventory, a
compile service and a one-device worker as processes, the dispatcher in this process with a
short queue poll), called in-process as `accelmesh.cli.main` and read from stdout and stderr: inputs
from .npy files and results back to .npy files; a detached job followed and fetched; the job table,
one job's page and its event log; a job on the direct data path, its results the relay path's;
a queued job cancelled; Ctrl-C on a running `accelmesh run`,
which cancels its job; quotas set, listed and removed by an operator and refused to a user.

The pool is made full as test_queue_e2e.py makes it: a reservation of the test's own, taken through
the inventory with the dispatch role and released afterwards."""

from __future__ import annotations

import dataclasses
import io
import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from accelmesh.cli import main
from accelmesh.cli.job_view import RunProgress, bytes_path
from accelmesh.cli.tables import format_size
from accelmesh.client import MeshClient
from accelmesh.common.v1 import common_pb2
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.dispatch.v1 import plan_pb2 as plan_pb
from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
from accelmesh.object_client import SHARED, STREAMED
from accelmesh.run_stream import JobResult
from compile_svc.programs.builtin import IDENTITY_WIDTH

from conftest import CREDENTIALS, small_mesh

pytestmark = pytest.mark.slow

WAIT_S = 60.0  # a bound on a failing test, never a pause: every wait below ends on what it waits for
OCCUPIER = "occupier-of-the-cli-test"
GIB = 1024**3


@dataclasses.dataclass
class Mesh:
    address: str
    inventory: object  # an InventoryService stub with the dispatch role
    device: str
    alice: Path  # a user's token file


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    alice = CREDENTIALS.add_user("cli-alice")
    with small_mesh(tmp_path_factory.mktemp("cli-jobs"), queue_poll_s=0.1) as (server, _, inventory):
        device = inventory.ListDevices(inv_pb.ListDevicesRequest()).devices[0]
        yield Mesh(f"127.0.0.1:{server.port}", inventory, device.id, alice)


class Full:
    """The device's free memory reserved by the test while inside: a job then queues."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def __enter__(self) -> Full:
        device = self.mesh.inventory.GetDevice(inv_pb.GetDeviceRequest(device_id=self.mesh.device)).device
        self.mesh.inventory.ReserveDevices(inv_pb.ReserveDevicesRequest(job_id=OCCUPIER, ttl_seconds=300, claims=[
            inv_pb.DeviceClaim(device_id=self.mesh.device, memory_bytes=device.status.memory_free_bytes,
                               compute_fraction=1.0)]))
        return self

    def __exit__(self, *exc) -> None:
        self.mesh.inventory.ReleaseDevices(inv_pb.ReleaseDevicesRequest(job_id=OCCUPIER))


def cli(mesh: Mesh, capsys, *argv: str) -> tuple[int, str, str]:
    """`accelmesh ARGV --dispatch <the mesh>`: exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        code = main([*argv, "--dispatch", mesh.address])
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def saved(folder: Path, seed: int, rows: int = 8, name: str = "x.npy") -> tuple[Path, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((rows, IDENTITY_WIDTH)).astype(np.float32)
    path = folder / name
    np.save(path, x)
    return path, x


def wrote(out: str) -> list[Path]:
    return [Path(line.split()[1]) for line in out.splitlines() if line.startswith("wrote ")]


def job_named(mesh: Mesh, name: str) -> job_pb.Job:
    with MeshClient(mesh.address) as client:
        return next(j for j in client.stub.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs if j.spec.name == name)


@pytest.fixture(scope="module")
def finished(mesh, tmp_path_factory):
    """A job run to its end by `accelmesh run` (its id, input and stdout), for the commands that read jobs."""
    folder = tmp_path_factory.mktemp("finished")
    path, x = saved(folder, 1)
    code = main(["run", "identity", "--input", f"x={path}", "--name", "cli-finished", "--output", str(folder / "out"),
                 "--dispatch", mesh.address])
    assert code == 0
    return job_named(mesh, "cli-finished").job_id, x


# --- run ---------------------------------------------------------------------------------------------

def test_run_writes_each_result_under_results_and_the_job_id_and_exits_0(mesh, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, x = saved(tmp_path, 2, rows=64)
    code, out, err = cli(mesh, capsys, "run", "identity", "--input", f"x={path}", "--name", "cli-run",
                         "--precision", "fp32", "--priority", "3")
    assert code == 0, err
    job = job_named(mesh, "cli-run")
    assert job.state == job_pb.JOB_STATE_SUCCEEDED and job.spec.priority == 3
    assert job.spec.constraints.precision == common_pb2.PRECISION_FP32
    assert f"job {job.job_id} succeeded" in out
    assert wrote(out) == [Path("results") / job.job_id / "y.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "results" / job.job_id / "y.npy"), x)
    # stderr is not a terminal here: one plain line per notable event, in order, and no bar.
    lines = err.splitlines()
    assert "\r" not in err and "\x1b" not in err
    assert lines.pop(0) == f"job {job.job_id}"  # named at its first event: watch it elsewhere meanwhile
    assert lines[0].split()[1:2] == ["[shards"] and "shards on 1 devices" in lines[0]
    assert any("[shards 1/1]" in line and "shard 0 done on" in line for line in lines)
    assert lines[-1].startswith("100% ") and lines[-1].endswith("done")


def test_run_on_the_direct_path_writes_what_the_relay_path_writes_and_says_how_its_bytes_went(mesh, capsys,
                                                                                              tmp_path):
    path, x = saved(tmp_path, 7, rows=64)
    written, said = {}, {}
    for way, flags in (("relay", []), ("direct", ["--data-path", "direct"])):  # relay: the default
        code, out, err = cli(mesh, capsys, "run", "identity", "--input", f"x={path}", "--name", f"cli-{way}",
                             "--precision", "fp32", "--output", str(tmp_path / way), *flags)
        assert code == 0, err
        assert wrote(out) == [tmp_path / way / "y.npy"]
        written[way] = np.load(tmp_path / way / "y.npy")
        (said[way],) = [line for line in out.splitlines() if line.startswith("bytes: ")]
    np.testing.assert_array_equal(written["direct"], written["relay"])
    np.testing.assert_array_equal(written["direct"], x)
    assert job_named(mesh, "cli-relay").spec.data_path == job_pb.DATA_PATH_RELAY
    assert job_named(mesh, "cli-direct").spec.data_path == job_pb.DATA_PATH_DIRECT
    assert said["relay"].startswith("bytes: through the dispatcher")
    # The worker is on this host: the rows in and the results out, each the size of x, by shared memory.
    assert said["direct"].startswith("bytes: direct,") and f"({SHARED} {format_size(2 * x.nbytes)})" in said["direct"]
    assert said["direct"].endswith("none through the dispatcher")


def test_detach_on_the_direct_path_is_refused_before_anything_is_sent(capsys, tmp_path):
    path, _ = saved(tmp_path, 8)
    # Nothing listens at port 1: a refusal that got as far as the dispatcher would say UNAVAILABLE.
    code = main(["run", "identity", "--input", f"x={path}", "--detach", "--data-path", "direct",
                 "--dispatch", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("accelmesh: INVALID_ARGUMENT: --detach submits the job with SubmitJob")
    assert "--data-path direct" in err and "UNAVAILABLE" not in err and "Traceback" not in err


@pytest.mark.parametrize("given, code, words", [
    (["x={missing}"], 1, "--input x={missing}: no such file"),
    (["x"], 2, "'x' is not NAME=FILE.npy"),
    (["=rows.npy"], 2, "'=rows.npy' is not NAME=FILE.npy"),
    (["x={npy}", "x={npy}"], 1, "--input x is given twice"),
    (["x={text}"], 1, "--input x={text}: not a .npy array"),
    (["x={npz}"], 1, "--input x={npz}: an .npz archive"),
    ([], 1, "no inputs: give each of the program's inputs as --input NAME=FILE.npy"),
])
def test_a_bad_input_is_refused_naming_the_flag_before_anything_is_sent(capsys, tmp_path, given, code, words):
    files = {"missing": tmp_path / "missing.npy", "npy": tmp_path / "x.npy", "text": tmp_path / "x.txt",
             "npz": tmp_path / "x.npz"}
    np.save(files["npy"], np.zeros((2, 4), np.float32))
    files["text"].write_text("1 2 3\n")
    np.savez(files["npz"], x=np.zeros((2, 4), np.float32))
    flags = [a for g in given for a in ("--input", g.format(**files))]
    # Nothing listens at port 1: a refusal that got as far as the dispatcher would say UNAVAILABLE.
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["run", "identity", *flags, "--dispatch", "127.0.0.1:1"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == code
    assert words.format(**files) in err and "UNAVAILABLE" not in err and "Traceback" not in err


def test_run_exits_1_with_the_status_when_the_dispatcher_refuses_the_job(mesh, capsys, tmp_path):
    path, _ = saved(tmp_path, 3)
    code, out, err = cli(mesh, capsys, "run", "identity", "--input", f"z={path}")
    assert code == 1 and out == ""
    assert "accelmesh: INVALID_ARGUMENT: spec.inputs[0] 'z': identity" in err and "expects input 'x' here" in err
    with Full(mesh):
        code, _, err = cli(mesh, capsys, "run", "identity", "--input", f"x={path}", "--queue-timeout", "0")
    assert code == 1 and "accelmesh: RESOURCE_EXHAUSTED:" in err and "spec.queue_timeout is 0 s" in err


def test_nothing_listening_is_the_status_and_what_to_do_not_a_traceback(capsys):
    assert main(["jobs", "list", "--dispatch", "127.0.0.1:1"]) == 1
    status, hint = capsys.readouterr().err.splitlines()
    assert status.startswith("accelmesh: UNAVAILABLE:")
    assert hint.startswith("accelmesh: nothing answers at that address: start the mesh with `accelmesh up`")


def test_detach_then_watch_then_fetch_round_trip(mesh, capsys, tmp_path):
    path, x = saved(tmp_path, 4, rows=16)
    code, out, err = cli(mesh, capsys, "run", "identity", "--input", f"x={path}", "--detach", "--name", "cli-detached")
    assert code == 0, err
    job_id = out.strip()
    assert job_id == job_named(mesh, "cli-detached").job_id and f"accelmesh jobs watch {job_id}" in err

    code, out, err = cli(mesh, capsys, "jobs", "watch", job_id)
    assert code == 0, err
    events = out.splitlines()
    assert [int(line.split()[0]) for line in events] == list(range(len(events)))
    assert events[0].split()[3] == "planned" and events[-1].split()[3:] == ["succeeded", "done"]

    code, out, err = cli(mesh, capsys, "jobs", "fetch", job_id, "--output", str(tmp_path / "fetched"))
    assert code == 0, err
    assert wrote(out) == [tmp_path / "fetched" / "y.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "fetched" / "y.npy"), x)


# --- jobs ----------------------------------------------------------------------------------------------

def test_jobs_list_shows_ended_jobs_only_when_asked(mesh, capsys, finished):
    job_id, _ = finished
    code, out, _ = cli(mesh, capsys, "jobs", "list", "--all-states")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["JOB", "NAME", "PROGRAM", "STATE", "PROGRESS", "OWNER", "CREATED", "QUEUE"]
    row = next(r.split() for r in rows if r.startswith(job_id))
    assert row[1:6] == ["cli-finished", "identity", "succeeded", "100%", "operator:local-operator"] and row[-1] == "-"
    assert job_id in cli(mesh, capsys, "jobs", "list", "--state", "succeeded")[1]
    assert job_id not in cli(mesh, capsys, "jobs", "list")[1]  # by default, jobs not ended
    assert job_id not in cli(mesh, capsys, "jobs", "list", "--state", "failed")[1]
    code, out, err = cli(mesh, capsys, "jobs", "list", "--all-states", "--limit", "1")
    assert code == 0 and len(out.splitlines()) == 2 and "--limit N shows more" in err


def test_jobs_get_shows_the_state_plan_and_shards_or_the_job_as_json(mesh, capsys, finished):
    job_id, x = finished
    code, out, _ = cli(mesh, capsys, "jobs", "get", job_id)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"job        {job_id} (cli-finished)"
    assert "state      succeeded, 100% done" in lines
    assert any(line.startswith("plan       1 shard(s) on 1 device(s), predicted") for line in lines)
    shard = next(line.split() for line in lines if line.startswith("0 "))
    assert shard[1] == mesh.device and shard[3] == str(len(x))
    assert shard[-2:] == ["yes", "-"], "DONE, then VERIFIED: no spot check was asked for"

    code, out, _ = cli(mesh, capsys, "jobs", "get", job_id, "--json")
    job = json.loads(out)
    assert code == 0 and job["jobId"] == job_id and job["state"] == "JOB_STATE_SUCCEEDED"
    assert len(job["shards"]) == 1


def test_jobs_get_of_an_unknown_id_exits_1_with_not_found(mesh, capsys):
    code, out, err = cli(mesh, capsys, "jobs", "get", "0123456789abcdef")
    assert code == 1 and out == ""
    assert err.startswith("accelmesh: NOT_FOUND:") and "0123456789abcdef" in err and "Traceback" not in err


def test_jobs_logs_lists_the_events_in_order_from_any_index(mesh, capsys, finished):
    job_id, _ = finished
    code, out, err = cli(mesh, capsys, "jobs", "logs", job_id)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert [int(line.split()[0]) for line in lines] == list(range(len(lines)))
    assert [line.split()[3] for line in lines] == ["planned", "compiled", "shard_started", "shard_finished",
                                                    "succeeded"]
    assert lines[3].endswith(f"shard 0 done on {mesh.device}")
    code, out, _ = cli(mesh, capsys, "jobs", "logs", job_id, "--from", "3")
    assert code == 0 and out.splitlines() == lines[3:]


def test_a_queued_job_is_listed_with_its_place_and_cancelled(mesh, capsys, tmp_path):
    path, _ = saved(tmp_path, 5)
    with Full(mesh):
        code, out, err = cli(mesh, capsys, "run", "identity", "--input", f"x={path}", "--detach",
                             "--name", "cli-queued")
        assert code == 0, err
        job_id = out.strip()
        row = next(r.split() for r in cli(mesh, capsys, "jobs", "list")[1].splitlines() if r.startswith(job_id))
        assert row[3] == "queued" and row[-1] == "#1"
        out = cli(mesh, capsys, "jobs", "get", job_id)[1]
        assert "state      queued, 0% done" in out and "queue      position 1: devices:" in out and mesh.device in out
        code, out, err = cli(mesh, capsys, "jobs", "logs", job_id)  # the log so far, at once: it has not ended
        # Planned and refused by the admission gate: its PLANNED and COMPILED events come once it is admitted.
        assert code == 0 and [line.split()[3] for line in out.splitlines()] == ["queued"]
        assert f"(job {job_id} has not ended: its log goes on" in err

        code, out, err = cli(mesh, capsys, "jobs", "cancel", job_id)
        assert code == 0, err
        assert out.strip() == f"job {job_id} cancelled: cancelled by CancelJob"
    assert cli(mesh, capsys, "jobs", "watch", job_id)[0] == 1
    code, out, _ = cli(mesh, capsys, "jobs", "logs", job_id)
    assert [line.split()[3] for line in out.splitlines()] == ["queued", "cancelled"]
    assert "queued at position 1: devices:" in out
    code, _, err = cli(mesh, capsys, "jobs", "cancel", job_id)
    assert code == 0  # cancelling a cancelled job: it is cancelled
    code, _, err = cli(mesh, capsys, "jobs", "fetch", job_id)
    assert code == 1 and "FAILED_PRECONDITION" in err and "cancelled" in err


_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


def test_ctrl_c_on_run_cancels_its_job_and_exits_130(mesh, tmp_path):
    path, _ = saved(tmp_path, 6)
    with Full(mesh):
        # As a terminal would start it, SIGINT at its default: a suite run in the background (`make
        # test &`, a CI runner) inherits SIGINT ignored, and a CLI must honour that as nohup expects.
        # Reset by a small exec step, not a preexec_fn: that forks this multithreaded (gRPC) process
        # without exec'ing, and the child then sometimes died of gRPC's inherited poller.
        process = subprocess.Popen(
            [sys.executable, "-c", _SIGINT_DEFAULT, sys.executable, "-m", "accelmesh.cli", "run", "identity",
             "--input", f"x={path}", "--name", "cli-interrupted", "--dispatch", mesh.address],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in process.stderr:
                lines.put(line)
            lines.put(None)  # the end of stderr

        threading.Thread(target=read, daemon=True).start()
        try:
            seen = []
            while not (seen and "queued at position 1" in seen[-1]):  # Ctrl-C once the job waits in the queue
                line = lines.get(timeout=WAIT_S)
                assert line is not None, "".join(seen)
                seen.append(line)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=WAIT_S) == 130, "".join(seen)
        finally:
            process.kill()
    rest = list(iter(lambda: lines.get(timeout=WAIT_S), None))
    job = job_named(mesh, "cli-interrupted")
    assert job.state == job_pb.JOB_STATE_CANCELLED and job.error == "cancelled by CancelJob"
    assert f"job {job.job_id}\n" in seen  # named from its first event, before it waited
    assert rest == [f"accelmesh: interrupted: cancelled job {job.job_id} (now cancelled)\n"]
    assert not (tmp_path / "results").exists()


# --- quota ---------------------------------------------------------------------------------------------

def test_quotas_round_trip_for_an_operator_and_are_refused_to_a_user(mesh, capsys, monkeypatch):
    code, out, err = cli(mesh, capsys, "quota", "set", "user:cli-alice", "--max-jobs", "2", "--max-memory", "8GiB",
                         "--max-priority", "5")
    assert code == 0, err
    assert out.strip() == ("set user:cli-alice: max jobs 2, max devices -, max memory 8.0 GiB, max priority 5")
    code, out, _ = cli(mesh, capsys, "quota", "list")
    header, *rows = out.splitlines()
    assert header.split()[:2] == ["TENANT", "QUOTA"]
    assert next(r.split() for r in rows if r.startswith("user:cli-alice")) == [
        "user:cli-alice", "own", "2", "-", "8.0", "GiB", "5", "0", "0", "0", "B", "0"]

    monkeypatch.setenv("ACCELMESH_TOKEN_FILE", str(mesh.alice))
    code, _, err = cli(mesh, capsys, "quota", "set", "user:cli-alice", "--max-jobs", "100")
    assert code == 1 and err.startswith("accelmesh: PERMISSION_DENIED:")
    assert cli(mesh, capsys, "quota", "remove", "user:cli-alice")[0] == 1
    code, out, _ = cli(mesh, capsys, "quota", "list")  # a user sees their own
    assert code == 0 and [r.split()[0] for r in out.splitlines()[1:]] == ["user:cli-alice"]
    monkeypatch.delenv("ACCELMESH_TOKEN_FILE")

    code, out, _ = cli(mesh, capsys, "quota", "remove", "user:cli-alice")
    assert code == 0 and out.startswith("removed the quota of user:cli-alice")
    assert "user:cli-alice" not in cli(mesh, capsys, "quota", "list")[1]
    code, _, err = cli(mesh, capsys, "quota", "remove", "user:cli-alice")
    assert code == 1 and err.startswith("accelmesh: NOT_FOUND:")


@pytest.mark.parametrize("argv, words", [
    (["quota", "set", "alice"], "'alice' is not a tenant: write it as `accelmesh jobs list` shows owners (user:alice)"),
    (["quota", "set", "user:alice", "--max-memory", "8 gigs"], "argument --max-memory: '8 gigs' is not a size"),
    (["quota", "set", "user:alice", "--max-jobs", "-1"], "argument --max-jobs: -1 is below 0"),
    (["jobs", "list", "--state", "done"], "argument --state: invalid choice: 'done'"),
    (["jobs", "list", "--all-states", "--state", "queued"], "not allowed with argument --all-states"),
    (["run", "identity", "--queue-timeout", "-1"], "argument --queue-timeout: -1 is below 0"),
    (["run", "identity", "--data-path", "workers"], "argument --data-path: invalid choice: 'workers'"),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dispatch", "127.0.0.1:1"])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("8GiB", 8 * GIB), ("512MiB", 512 * 2**20), ("1.5TB", 1_500_000_000_000),
                                        ("1000", 1000), ("2 gib", 2 * GIB)])
def test_memory_sizes_read_binary_and_decimal_units(text, size):
    from accelmesh.cli.quota import parse_size
    assert parse_size(text) == size


# --- progress ------------------------------------------------------------------------------------------

def _events() -> list[job_pb.JobEvent]:
    plan = plan_pb.Plan(shards=[plan_pb.ShardPlan(index=i) for i in range(2)])
    queue_status = job_pb.QueueStatus(position=2, reason="devices: no room")
    return [job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_QUEUED, queue=queue_status),
            job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_PLANNED, plan=plan, message="2 shards on 1 devices"),
            job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_SHARD_STARTED, message="shard 0 on d"),
            job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_SHARD_FINISHED, progress=0.5, message="shard 0 done on d",
                            shard=job_pb.ShardRecord(index=0)),
            job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_SHARD_FINISHED, progress=1.0, message="shard 1 done on d",
                            shard=job_pb.ShardRecord(index=1)),
            job_pb.JobEvent(type=job_pb.JOB_EVENT_TYPE_SUCCEEDED, progress=1.0, message="done")]


def test_progress_is_one_plain_line_per_notable_event_off_a_terminal():
    out = io.StringIO()
    progress = RunProgress(out, tty=False)
    for event in _events():
        progress.event(event)
    progress.close()
    assert out.getvalue().splitlines() == [
        "  0% queued at position 2: devices: no room",
        "  0% [shards 0/2] 2 shards on 1 devices",
        " 50% [shards 1/2] shard 0 done on d",
        "100% [shards 2/2] shard 1 done on d",
        "100% [shards 2/2] done",
    ]


def test_progress_on_a_terminal_is_a_bar_redrawn_in_place_with_the_queue_above_it():
    out = io.StringIO()
    progress = RunProgress(out, tty=True)
    for event in _events():
        progress.event(event)
    progress.close()
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 2  # the queued line, and the bar's end
    assert "\r\x1b[Kqueued at position 2: devices: no room\n" in text
    last = text.rstrip("\n").rsplit("\r\x1b[K", 1)[1]
    assert last == f"[{'#' * 30}] 100% [shards 2/2] done"
    assert "[###############...............]  50% [shards 1/2] shard 0 done on d" in text


def test_a_line_said_on_a_terminal_goes_above_the_bar():
    out = io.StringIO()
    progress = RunProgress(out, tty=True)
    progress.say("job j1")  # before any bar: a plain line
    events = _events()
    progress.event(events[0])
    progress.say("job j1 again")  # over the bar: the bar's line cleared first, the bar drawn again next
    for event in events[1:]:
        progress.event(event)
    progress.close()
    text = out.getvalue()
    assert text.startswith("job j1\n") and "\r\x1b[Kjob j1 again\n" in text
    assert text.rstrip("\n").rsplit("\r\x1b[K", 1)[1] == f"[{'#' * 30}] 100% [shards 2/2] done"


def test_the_bytes_line_says_the_relay_or_each_way_the_direct_path_took_in_the_unit_reached():
    assert bytes_path(JobResult(job_pb.Job(), {}, [])) == "bytes: through the dispatcher (relayed on the RunJob stream)"
    direct = bytes_path(JobResult(job_pb.Job(), {}, [], "direct", {STREAMED: 3 * 2**20, SHARED: 512}))
    assert direct == (f"bytes: direct, client <-> the workers' object stores ({STREAMED} 3.0 MiB, {SHARED} 512 B); "
                      "none through the dispatcher")
