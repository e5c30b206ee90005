"""`accelmesh run` and `accelmesh jobs`: run a program on the mesh from .npy files, and follow,
inspect, cancel and collect jobs, through the dispatch service at --dispatch.

Like every command the dispatcher is found by a flag (default the port `accelmesh up` serves on)
and the caller by this process's client credentials (ACCELMESH_CA_FILE, _CERT_FILE, _KEY_FILE,
_TOKEN_FILE, or the folder `accelmesh up` wrote), so a user sees and touches only their own jobs.

`run` follows its job through RunJob. Ctrl-C cancels the job with CancelJob before exiting 130:
a job left running would hold its devices, and the caller would not know what became of it.
RunJob names the job only at its end, so the job is found by the request id `run` gives it.

`run --data-path direct` puts the rows into the workers' object stores and fetches the results
from them itself (MeshClient.run's DATA_PATH_DIRECT, docs/data-plane.md). The relay path stays the
default: it takes every job `run` can send, and a direct one does not (it is for data-parallel
inference whose outputs are concatenated, without spot checks; it never waits in the queue, so a
full pool refuses it; and this machine must reach every worker). A direct job is followed to its
end by the client that holds its rows, so `--detach` (SubmitJob, relay alone) is refused with it.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from accelmesh import errors
from accelmesh.cli import job_view
from accelmesh.cli.arguments import at_least
from accelmesh.cli.mesh import DEFAULT_DISPATCH
from accelmesh.client import PRECISIONS, MeshClient
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.runtime.tensors import dtype_code

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
DEFAULT_LIST_LIMIT = 50
MAX_PAGE = 1000  # ListJobs reads a larger page_size as this
SEARCH_PAGES = 5  # Ctrl-C looks this many pages of 100 (newest first) for the job `run` made
RELAY, DIRECT = "relay", "direct"  # `run --data-path`: MeshClient.run's data_path


# --- arguments -------------------------------------------------------------------------------------

def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0; 0 refuses to queue at all")
    return value


def input_flag(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=FILE.npy; write e.g. --input x=rows.npy")
    return name, path


def load_inputs(pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    """Each --input's array, in the order given (the program's order: `accelmesh programs` lists it)."""
    inputs: dict[str, np.ndarray] = {}
    for name, path in pairs:
        where = f"--input {name}={path}"
        if name in inputs:
            raise errors.InvalidArgument(f"--input {name} is given twice; give each of the program's inputs once")
        if not Path(path).is_file():
            raise errors.InvalidArgument(f"{where}: no such file; save the array with numpy.save")
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise errors.InvalidArgument(f"{where}: not a .npy array ({exc}); save it with numpy.save") from None
        if not isinstance(array, np.ndarray):  # an .npz archive loads as a mapping of arrays
            raise errors.InvalidArgument(f"{where}: an .npz archive, not one array; save each input with numpy.save")
        if array.ndim == 0:
            raise errors.InvalidArgument(f"{where}: a scalar; an input needs rows (its first axis)")
        dtype_code(array.dtype, where)
        inputs[name] = array
    if not inputs:
        raise errors.InvalidArgument("no inputs: give each of the program's inputs as --input NAME=FILE.npy")
    return inputs


def _output_folder(args) -> None:
    if args.output is not None and Path(args.output).exists() and not Path(args.output).is_dir():
        raise errors.InvalidArgument(f"--output {args.output}: a file is there; name a folder (made if missing)")


def write_results(outputs: dict[str, np.ndarray], folder: Path) -> None:
    """Each result as folder/<name>.npy (a name with '/' in a subfolder), printing where."""
    for name, value in outputs.items():
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise errors.InvalidArgument(f"the result {name!r} cannot be a file name under {folder}; "
                                         "fetch it with accelmesh.client.MeshClient.fetch_result instead")
        path = folder.joinpath(*parts[:-1], parts[-1] + ".npy")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, value, allow_pickle=False)
        print(f"wrote {path}  {value.dtype}{list(value.shape)}")


def _folder(args, job_id: str) -> Path:
    return Path(args.output) if args.output is not None else Path("results") / job_id


# --- run ---------------------------------------------------------------------------------------------

def _find_job(client: MeshClient, request_id: str) -> str | None:
    token = ""
    for _ in range(SEARCH_PAGES):
        page = client.stub.ListJobs(pb.ListJobsRequest(page_size=100, page_token=token))
        for job in page.jobs:
            if job.spec.request_id == request_id:
                return job.job_id
        token = page.next_page_token
        if not token:
            return None
    return None


def _interrupted(client: MeshClient, request_id: str, job_id: str) -> int:
    """`job_id`: as the job's first event named it ("" before one came, or from a dispatcher that
    does not name it: then found by the run's request id)."""
    job_id = job_id or _find_job(client, request_id)
    if job_id is None:
        print("accelmesh: interrupted before the dispatcher had made the job; closing the call stops it",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    job = client.cancel(job_id)
    state = job_view.state_name(job.state)
    if job.state == job_pb.JOB_STATE_CANCELLED:
        message = f"cancelled job {job_id} (now {state})"
    elif job.state == job_pb.JOB_STATE_SUCCEEDED:  # it ended before the cancel arrived
        message = f"job {job_id} had already succeeded; `accelmesh jobs fetch {job_id}` collects its results"
    elif job.state in job_view.FINAL_STATES:
        message = f"job {job_id} had already {state}: {job.error}"
    else:
        message = f"asked job {job_id} to stop; it is still {state} (`accelmesh jobs get {job_id}` shows it)"
    print(f"accelmesh: interrupted: {message}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def cmd_run(args) -> int:
    if args.detach and args.data_path == DIRECT:
        raise errors.InvalidArgument("--detach submits the job with SubmitJob, which relays its bytes through the "
                                     "dispatcher; --data-path direct needs `run` to follow the job to its end, since "
                                     "it puts the rows and fetches the results itself: drop one of the two flags")
    _output_folder(args)
    inputs = load_inputs(args.input)
    request_id = uuid.uuid4().hex
    options = dict(name=args.name, max_devices=args.max_devices, precision=args.precision, priority=args.priority,
                   queue_timeout_s=args.queue_timeout, request_id=request_id, data_path=args.data_path)
    with MeshClient(args.dispatch) as client:
        progress = job_view.RunProgress()
        named = ""
        exit_code: list[int] = []  # _interrupted's, once it ran inside the call

        def on_event(event) -> None:
            nonlocal named
            if event.job_id and not named:
                named = event.job_id
                progress.say(f"job {named}")  # for `accelmesh jobs watch` elsewhere, before it ends
            progress.event(event)
        try:
            if args.detach:
                job_id = client.submit(args.program, inputs, **options)
                print(job_id)
                print(f"submitted; follow it with `accelmesh jobs watch {job_id}`, collect it with "
                      f"`accelmesh jobs fetch {job_id}`", file=sys.stderr)
                return 0
            def on_interrupt() -> None:  # while the RunJob call is open: the job records CancelJob as its cause
                progress.close()
                exit_code.append(_interrupted(client, request_id, named))
            result = client.run(args.program, inputs, on_event=on_event, on_interrupt=on_interrupt, **options)
        except KeyboardInterrupt:
            progress.close()
            return exit_code[0] if exit_code else _interrupted(client, request_id, named)
        finally:
            progress.close()
    job = result.job
    print(f"job {job.job_id} {job_view.state_name(job.state)}: {len(job.shards)} shard(s), "
          f"measured {job.measured_seconds:.3f} s (predicted {job.plan.predicted_seconds:.3f} s)")
    print(job_view.bytes_path(result))
    write_results(result.outputs, _folder(args, job.job_id))
    return 0


# --- jobs ----------------------------------------------------------------------------------------------

def list_jobs(client: MeshClient, states: frozenset[int] | None, limit: int) -> tuple[list, bool]:
    """Up to `limit` jobs in `states` (None: any), newest first; and whether more may follow. The
    dispatcher filters by state; the filter here as well keeps the answer right from a dispatcher
    older than ListJobsRequest.states, which lists every state."""
    shown, token = [], ""
    page_size = min(limit, MAX_PAGE)
    while True:
        page = client.stub.ListJobs(pb.ListJobsRequest(page_size=page_size, page_token=token,
                                                       states=sorted(states or ())))
        for i, job in enumerate(page.jobs):
            if states is None or job.state in states:
                shown.append(job)
                if len(shown) == limit:
                    return shown, i + 1 < len(page.jobs) or bool(page.next_page_token)
        token = page.next_page_token
        if not token:
            return shown, False


def cmd_list(args) -> int:
    states = (None if args.all_states else frozenset(job_view.STATES[s] for s in args.state) if args.state
              else job_view.ACTIVE_STATES)
    with MeshClient(args.dispatch) as client:
        jobs, more = list_jobs(client, states, args.limit)  # a queued job's place is in its listing
    if not jobs:
        print("no jobs" if states is None else
              f"no {'active ' if states is job_view.ACTIVE_STATES else ''}jobs"
              f"{' in ' + ', '.join(args.state) if args.state else ''} (--all-states lists every job)")
        return 0
    print(job_view.format_jobs(jobs))
    if more:
        print(f"(the newest {len(jobs)}; --limit N shows more)", file=sys.stderr)
    return 0


def cmd_get(args) -> int:
    with MeshClient(args.dispatch) as client:
        job = client.get(args.job_id)
    print(json_format.MessageToJson(job) if args.json else job_view.format_job(job))
    return 0


def cmd_watch(args) -> int:
    final = None
    with MeshClient(args.dispatch) as client:
        try:
            for event in client.watch(args.job_id):
                print(job_view.format_event(event), flush=True)
                final = job_view.FINAL_EVENTS.get(event.type, final)
        except KeyboardInterrupt:
            print(f"accelmesh: stopped watching; job {args.job_id} goes on (`accelmesh jobs cancel` stops it)",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        if final is None:
            final = client.get(args.job_id).state
    if final == job_pb.JOB_STATE_SUCCEEDED:
        return 0
    print(f"accelmesh: job {args.job_id} {job_view.state_name(final)}", file=sys.stderr)
    return 1


def cmd_cancel(args) -> int:
    with MeshClient(args.dispatch) as client:
        job = client.cancel(args.job_id)
    state = job_view.state_name(job.state)
    if job.state == job_pb.JOB_STATE_CANCELLED:
        print(f"job {job.job_id} {state}" + (f": {job.error}" if job.error else ""))
        return 0
    if job.state in job_view.FINAL_STATES:
        print(f"accelmesh: job {job.job_id} had already {state}; nothing to cancel", file=sys.stderr)
    else:
        print(f"accelmesh: job {job.job_id} is still {state}: it was told to stop and has not yet; "
              f"`accelmesh jobs watch {job.job_id}` follows it", file=sys.stderr)
    return 1


def cmd_logs(args) -> int:
    with MeshClient(args.dispatch) as client:
        ended = False
        for response in client.stub.WatchJob(pb.WatchJobRequest(job_id=args.job_id, from_index=args.from_index,
                                                                log_so_far=True)):
            print(job_view.format_event(response.event))
            ended = response.event.type in job_view.FINAL_EVENTS
        if not ended and client.get(args.job_id).state not in job_view.FINAL_STATES:
            print(f"(job {args.job_id} has not ended: its log goes on; `accelmesh jobs watch {args.job_id}` "
                  "follows it)", file=sys.stderr)
    return 0


def cmd_fetch(args) -> int:
    _output_folder(args)
    with MeshClient(args.dispatch) as client:
        outputs = client.fetch_result(args.job_id)
    write_results(outputs, _folder(args, args.job_id))
    return 0


# --- the parser ------------------------------------------------------------------------------------------

def dispatch_flag(parser) -> None:
    parser.add_argument("--dispatch", default=DEFAULT_DISPATCH, metavar="HOST:PORT",
                        help=f"dispatch service address (default {DEFAULT_DISPATCH}, where `accelmesh up` serves)")


def _output_flag(parser) -> None:
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="write each result as DIR/<name>.npy (default ./results/<job id>)")


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="run a program on the mesh with inputs from .npy files; results to .npy files",
                         description="Run a program on the mesh, show its progress on stderr, say which way the "
                                     "job's bytes went, and write each result as DIR/<name>.npy. Exit 0 when it "
                                     "succeeded, 1 when it failed or was refused, 130 after Ctrl-C (which cancels "
                                     "the job).")
    run.add_argument("program", help="registered program (`accelmesh programs` lists them and their inputs)")
    run.add_argument("--input", type=input_flag, action="append", default=[], metavar="NAME=FILE.npy",
                     help="one of the program's inputs, in the program's order; repeat for each")
    _output_flag(run)
    run.add_argument("--priority", type=at_least(0), default=0, metavar="N",
                     help="place in the queue when the pool is full, 0 (default) to 1000, at most your quota's")
    run.add_argument("--queue-timeout", type=_seconds, default=None, metavar="SECONDS",
                     help="how long the job may wait in the queue (default: the dispatcher's limit; 0: never wait)")
    run.add_argument("--name", default="", metavar="LABEL", help="a label `accelmesh jobs list` shows")
    run.add_argument("--max-devices", type=at_least(1), default=0, metavar="N", help="use at most N devices")
    run.add_argument("--precision", choices=tuple(p for p in PRECISIONS if p), default="",
                     help="least precise compute dtype allowed (fp32: bit-identical results whatever the plan); "
                          "default: each device's compile rules decide")
    run.add_argument("--detach", action="store_true",
                     help="submit and print the job id at once (SubmitJob); follow with `accelmesh jobs watch`")
    run.add_argument("--data-path", choices=(RELAY, DIRECT), default=RELAY,
                     help="how the job's tensor bytes travel: relay (default) streams them through the dispatcher; "
                          "direct puts the rows into the workers' object stores and fetches the results from them "
                          "(shared memory on the same host, else a gRPC stream to each worker), for data-parallel "
                          "inference whose outputs are concatenated: such a job never queues (a full pool refuses "
                          "it, RESOURCE_EXHAUSTED), this machine must reach every worker, and --detach is refused")
    dispatch_flag(run)
    run.set_defaults(func=cmd_run)

    jobs = sub.add_parser("jobs", help="list, inspect, follow, cancel and collect jobs").add_subparsers(
        dest="jobs_command", required=True)
    listing = jobs.add_parser("list", help="jobs as a table, newest first (by default those not ended)")
    which = listing.add_mutually_exclusive_group()
    which.add_argument("--all-states", action="store_true", help="every job, ended ones too")
    which.add_argument("--state", action="append", choices=tuple(job_view.STATES),
                       help="only jobs in this state; repeatable")
    listing.add_argument("--limit", type=at_least(1), default=DEFAULT_LIST_LIMIT, metavar="N",
                         help=f"show at most N jobs (default {DEFAULT_LIST_LIMIT})")
    listing.set_defaults(func=cmd_list)
    get = jobs.add_parser("get", help="a job: state, error, queue place, plan and shards")
    get.add_argument("--json", action="store_true", help="the Job message as JSON, every shard included")
    get.set_defaults(func=cmd_get)
    watch = jobs.add_parser("watch", help="print a job's events until it ends; exit 0 if it succeeded, else 1")
    watch.set_defaults(func=cmd_watch)
    cancel = jobs.add_parser("cancel", help="stop a job (queued or running) and free its devices")
    cancel.set_defaults(func=cmd_cancel)
    logs = jobs.add_parser("logs", help="a job's event log so far: index, time, type, message")
    logs.add_argument("--from", dest="from_index", type=at_least(0), default=0, metavar="N",
                      help="start at event N (default 0, the whole log)")
    logs.set_defaults(func=cmd_logs)
    fetch = jobs.add_parser("fetch", help="a succeeded job's results, as .npy files")
    _output_flag(fetch)
    fetch.set_defaults(func=cmd_fetch)
    for command in (get, watch, cancel, logs, fetch):
        command.add_argument("job_id", metavar="JOB_ID")
    for command in (listing, get, watch, cancel, logs, fetch):
        dispatch_flag(command)
