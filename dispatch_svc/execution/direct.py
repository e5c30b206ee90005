"""A DATA_PATH_DIRECT job's bytes (docs/data-plane.md): the client puts each shard's input rows
into the object store of the worker that runs it, the shard runs on them there, and its outputs
stay there for the client to fetch. The dispatcher moves descriptors and tickets, never a tensor
byte: this is its half of that exchange.

`DirectJob` asks the client for a shard's inputs at a worker (all shards at their planned workers
once the job holds its devices, and a shard again wherever a retry moves it), hears that they
are stored, lets a shard's attempt wait until they are, and keeps where each finished shard's
outputs lie. What it asks for goes out on the job's RunJob stream (`take_wanted`; an
INPUTS_WANTED event in the log says which shards and where, and wakes that stream), with tickets
signed for the job's owner, the job, the worker and a direction: a put ticket covers the job's
input objects ("in/...") at that worker, a get ticket its output objects ("out/...").

Object ids: a shard's inputs are "in/<shard>/<input index>", its outputs (worker_svc keeps them
as "<prefix><output index>") under "out/<shard>.<attempt>/", so a retry never meets the objects
of the attempt before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accelmesh import errors
from accelmesh.runtime.beside import beside
from accelmesh.security.identity import address_host
from dispatch_svc.jobs import records as m

INPUT_PREFIX, OUTPUT_PREFIX = "in/", "out/"
TICKET_S = 3600.0  # how long a job's tickets are good for; a job running longer is asked again with new ones
WAIT_POLL_S = 0.5  # how often a shard waiting for its inputs looks for its job's stop
# Finished shards' outputs are named to the client once they cover this many bytes of the job's
# input rows (the rest at the job's end): a job of big shards is fetched while it runs, and one
# of small shards still costs the client a fetch or two, not one a shard. The first time once
# they cover FIRST_TELL_BYTES, then twice what was told last, so the client's first fetch comes
# early (a job of 200 shards of 32 KiB was fetched only once its last shard ended).
FIRST_TELL_BYTES = 1024 * 1024
TELL_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ShardObjects:
    """Where one shard's rows lie (or are to go) in a worker's store: RunJob's ShardObjects."""

    shard_index: int
    first_row: int
    rows: int
    worker_address: str
    object_ids: tuple[str, ...]
    names: tuple[str, ...]
    ticket: bytes


def input_ids(index: int, count: int) -> tuple[str, ...]:
    return tuple(f"{INPUT_PREFIX}{index}/{k}" for k in range(count))


def output_prefix(index: int, attempt: int) -> str:
    return f"{OUTPUT_PREFIX}{index}.{attempt}/"


class DirectJob:
    """Thread-safe: device threads wait and finish shards while the RunJob stream's reader hears
    what the client stored. `sign(direction, host, prefix, ttl_s)` makes a ticket for this job."""

    def __init__(self, job: m.JobRecord, sign: Callable[[str, str, str, float], bytes],
                 emit: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 free: Callable[[str, bytes, list[str]], None] = lambda address, ticket, ids: None):
        """`free(address, put ticket, input ids)` frees finished shards' inputs at a worker."""
        self.job, self._sign, self._emit, self._clock, self._free = job, sign, emit, clock, free
        self.scope = f"{job.owner}|{job.job_id}"
        self._names = tuple(i.name for i in job.spec.inputs)
        self._changed = threading.Condition()
        self.lock = threading.Lock()  # for the strategy's own counts, taken on device threads
        self._rows: dict[int, tuple[int, int]] = {}  # shard -> (first row, rows)
        self._asked: dict[int, str] = {}  # shard -> the worker its inputs were last asked for at
        self._held: dict[int, set[str]] = {}  # shard -> workers that hold its inputs (the client said so)
        self._wanted: list[ShardObjects] = []  # asked, not yet taken by the RunJob stream
        self._tickets: dict[tuple[str, str], tuple[bytes, float]] = {}  # (direction, worker) -> (ticket, made)
        self._outputs: dict[int, ShardObjects] = {}  # finished shard -> where its outputs lie
        self._untold: dict[int, ShardObjects] = {}  # finished shards the client was not told of yet
        self._untold_rows = 0
        self._row_bytes = max(1, job.spec.row_bytes)
        self._tell_rows = max(1, min(FIRST_TELL_BYTES, TELL_BYTES) // self._row_bytes)
        self._workers: set[str] = set()  # every worker asked to hold anything of the job
        self._stopped: BaseException | None = None

    def ticket(self, direction: str, address: str) -> bytes:
        """This job's ticket for `direction` at the worker, made once and again after half its life."""
        with self._changed:
            made = self._tickets.get((direction, address))
            if made is not None and self._clock() - made[1] < TICKET_S / 2:
                return made[0]
        prefix = INPUT_PREFIX if direction == "put" else OUTPUT_PREFIX
        token = self._sign(direction, address_host(address), prefix, TICKET_S)
        with self._changed:
            self._tickets[(direction, address)] = (token, self._clock())
        return token

    def ask(self, shards: Sequence[tuple[int, int, int, str]]) -> None:
        """Ask the client to put these shards' inputs, (index, first row, rows) at the worker's address each."""
        wanted = [ShardObjects(index, first, rows, address, input_ids(index, len(self._names)), self._names,
                               self.ticket("put", address)) for index, first, rows, address in shards]
        with self._changed:
            for w in wanted:
                self._rows[w.shard_index] = (w.first_row, w.rows)
                self._asked[w.shard_index] = w.worker_address
                self._workers.add(w.worker_address)
            self._wanted.extend(wanted)
        where = sorted({w.worker_address for w in wanted})
        self._emit(f"inputs of {len(wanted)} shard{'s' if len(wanted) != 1 else ''} "
                   f"({_indexes(w.shard_index for w in wanted)}) asked at {', '.join(where)}")

    def take_wanted(self) -> list[ShardObjects]:
        with self._changed:
            wanted, self._wanted = self._wanted, []
            return wanted

    def stored(self, indexes: Sequence[int]) -> None:
        """The client put these shards' inputs where they were last asked for."""
        with self._changed:
            for index in indexes:
                address = self._asked.get(index)
                if address is None:
                    raise errors.InvalidArgument(
                        f"stored.shard_indexes names shard {index}, whose inputs were never asked for: send "
                        "only the shard indexes of RunJobResponse.put_inputs", field="stored.shard_indexes")
                self._held.setdefault(index, set()).add(address)
            self._changed.notify_all()

    def holds(self, index: int, address: str) -> bool:
        """Whether the client said the shard's inputs lie at the worker."""
        with self._changed:
            return address in self._held.get(index, ())

    def inputs_at(self, index: int, address: str, check: Callable[[], None]) -> tuple[str, ...]:
        """The shard's input ids once they lie at the worker: asked for there if they were not, then
        waited for (`check` raises when the job must stop)."""
        with self._changed:
            asked = self._asked.get(index) == address or address in self._held.get(index, ())
            rows = self._rows[index]
        if not asked:
            self.ask([(index, *rows, address)])
        with self._changed:
            while address not in self._held.get(index, ()):
                if self._stopped is not None:
                    raise self._stopped
                self._changed.wait(WAIT_POLL_S)
                check()
        return input_ids(index, len(self._names))

    def finished(self, index: int, address: str, object_ids: Sequence[str], names: Sequence[str]) -> None:
        first, rows = self._rows[index]
        done = ShardObjects(index, first, rows, address, tuple(object_ids), tuple(names), self.ticket("get", address))
        with self._changed:
            self._outputs[index] = done
            self._untold[index] = done
            self._untold_rows += rows

    def take_finished(self, every: bool = False) -> list[ShardObjects]:
        """Where the outputs of the shards finished since the last call lie, in row order, once
        they cover the next batch's bytes of input rows (FIRST_TELL_BYTES, doubling up to
        TELL_BYTES), or whatever there is once every shard finished or with `every`: the RunJob
        stream tells the client as they finish, so it fetches while the others run."""
        with self._changed:
            # Every shard asked for has finished: the rest go now, not after the job's end is recorded.
            every = every or len(self._outputs) == len(self._rows)
            if not every and self._untold_rows < self._tell_rows:
                return []
            if not every:
                self._tell_rows = min(2 * self._tell_rows, max(1, TELL_BYTES // self._row_bytes))
            new, self._untold, self._untold_rows = list(self._untold.values()), {}, 0
        # Their inputs are done with (a finished shard is never run again): freed now, not at the
        # job's end, so a worker's store holds the rows still to run and the outputs not fetched.
        spent: dict[str, list[str]] = {}
        for shard in new:
            spent.setdefault(shard.worker_address, []).extend(input_ids(shard.shard_index, len(self._names)))
        for address, ids in spent.items():
            self._free(address, self.ticket("put", address), ids)
        return sorted(new, key=lambda s: s.first_row)

    def stop(self, why: BaseException) -> None:
        """The job ended: shards still waiting for their inputs stop."""
        with self._changed:
            self._stopped = why
            self._changed.notify_all()

    def release(self, release: Callable[[str, bytes], None], succeeded: bool) -> None:
        """Free what the job left in the workers' stores: its inputs always, its outputs too unless
        it succeeded (the client fetches those, then frees them; else the store's idle expiry)."""
        with self._changed:
            workers = sorted(self._workers | {o.worker_address for o in self._outputs.values()})
        for address in workers:
            release(address, self.ticket("put", address))
            if not succeeded:
                release(address, self.ticket("get", address))


def _indexes(values) -> str:
    """Shard indexes as a short text: "0-3, 7"."""
    out, run = [], []
    for value in sorted(values):
        if run and value == run[-1] + 1:
            run.append(value)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [value]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def stored_refs(direct: DirectJob, input_names: Sequence[str], index: int, attempt: int, address: str,
                check: Callable[[], None]) -> tuple[str, tuple[tuple[str, str], ...], str]:
    """What a shard's attempt runs on at `address` (once the client put it there): the store's
    scope, (input name, object id) pairs, and the prefix its outputs are kept under."""
    ids = direct.inputs_at(index, address, check)
    return direct.scope, tuple(zip(input_names, ids)), output_prefix(index, attempt)


class NotQueued(errors.ResourceExhausted):
    """A direct job the pool cannot take now: it does not wait in the queue (its inputs are its
    client's, which the queue cannot keep)."""

    def __init__(self, reason: str):
        super().__init__(f"the job cannot start now ({reason}), and a DATA_PATH_DIRECT job does not wait in the "
                         "queue: send it again later, or with DATA_PATH_RELAY, which queues", field="spec.data_path")


def check_signer(spec: m.JobSpec, sign_ticket: Callable[..., bytes] | None) -> None:
    if spec.data_path == m.DIRECT and sign_ticket is None:
        raise errors.FailedPrecondition("this dispatcher signs no tickets, so it runs no DATA_PATH_DIRECT job: "
                                        "send the job with DATA_PATH_RELAY", field="spec.data_path")


def direct_job(job: m.JobRecord, book, sign_ticket: Callable[..., bytes], workers) -> DirectJob:
    """The DirectJob of a new job; `sign_ticket(owner, job_id, direction, host, prefix, ttl_s)`.
    Finished shards' inputs are freed through `workers` (the Workers port), beside the caller."""

    def sign(direction: str, host: str, prefix: str, ttl_s: float) -> bytes:
        return sign_ticket(job.owner, job.job_id, direction, host, prefix, ttl_s)

    def free(address: str, ticket: bytes, ids: list[str]) -> None:
        beside(workers.release_objects, address, ticket, ids)
    return DirectJob(job, sign, lambda message: book.emit(job, m.INPUTS_WANTED, message=message), free=free)


def end_direct(live, workers, exc: BaseException | None) -> None:
    """A direct job ended: shards waiting for inputs stop, its objects are freed (runner._end)."""
    direct = live.direct
    if direct is None:
        return
    direct.stop(exc or errors.Cancelled("the job ended"))
    direct.release(workers.release_objects, succeeded=exc is None)
