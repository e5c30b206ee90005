"""Running shards on devices: one queue and one thread per device, retries on another device.

A device runs its shards one after another (a device is one XLA stream), different devices run
at the same time. A shard that fails is retried on another device of the same target type (it
already has the artifact), then on any other device the job may use; a device that failed is
not given more of this job's shards. The job fails only when a shard runs out of devices or
attempts, with every cause named.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelmesh import errors

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# Shards in flight per device: while one runs, the next ones' inputs are already on their way on
# the device's stream, so the device does not wait for a transfer, nor the dispatcher for an
# answer before sending more (200 shards of 32 KiB: two, 5.9-6.6 ms a shard; four, 4.5-5.0;
# eight, no better; bench/README.md). The worker still runs them one at a time.
SHARDS_IN_FLIGHT_PER_DEVICE = 4
# With a pool's `run_group`, a device thread takes the shards queued for its device by then, up to
# this many, as one group: one call to the worker each way and one wake-up for them all (200
# direct shards of 32 KiB: bench/README.md, "Shards in groups").
SHARDS_PER_GROUP = 16
RETRY_BACKOFF_S = 0.05  # doubled per attempt; long enough to skip a node's brief hiccup
BUDGET_CHECK_S = 0.5  # how often wait_all looks for a cancel of the job


# Worker statuses that say the request itself is wrong (the artifact does not load, an input
# does not fit): another device of the job would answer the same, so retries only delay the news.
NOT_RETRYABLE_CODES = frozenset({"FAILED_PRECONDITION", "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED",
                                 "OUT_OF_RANGE"})

# Worker statuses of a node that could not be reached (its transport broke, or it went silent).
UNREACHED_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


class ShardFailed(Exception):
    """A shard's attempt failed on a device; `cause` says why in the worker's words, `code` the
    worker's status name when it answered with one."""

    def __init__(self, cause: str, code: str = ""):
        super().__init__(cause)
        self.cause, self.code = cause, code


class Cancelled(errors.Cancelled):
    """The job was cancelled; the message, when there is one, says why (the job's record keeps it).
    Above the data plane it is an `accelmesh.errors.Cancelled` like any other (the edge's own,
    when a client goes away), which the error table answers with CANCELLED."""

    def __init__(self, message: str = ""):
        super().__init__(message)


@dataclass
class Attempt:
    """One shard as one device will run it."""

    shard: Any  # the caller's shard object (index, rows, inputs ...)
    device: Any  # the caller's device object (has .spec.id and .target_type)
    number: int  # from 1


@dataclass
class _Pending:
    shard: Any
    on_done: Callable[[Any], None] | None = None  # runs on the device thread when the shard succeeds
    on_error: Callable[[BaseException], None] | None = None  # runs when the shard has finally failed
    # The submitter's context (its trace): device threads run the shard inside it.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    tried: list[str] = field(default_factory=list)  # device ids
    failures: list[str] = field(default_factory=list)
    causes: list[tuple[str, str]] = field(default_factory=list)  # (status name, cause) of each failure
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class CancelScope:
    """Lets a job's cancellation reach every call in flight (each registers a cancel function)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancels: set = set()
        self.cancelled = threading.Event()
        self.reason = ""  # why, from the first cancel that gave one ("" reads as "cancelled")

    def register(self, cancel: Callable[[], object]) -> Callable[[], None]:
        with self._lock:
            if self.cancelled.is_set():
                cancel()
            self._cancels.add(cancel)
        return lambda: self._discard(cancel)

    def _discard(self, cancel) -> None:
        with self._lock:
            self._cancels.discard(cancel)

    def cancel(self, reason: str = "") -> None:
        with self._lock:
            if not self.cancelled.is_set():
                self.reason = reason
            self.cancelled.set()
            cancels = list(self._cancels)
        for cancel in cancels:
            cancel()

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled(self.reason)


class _DeviceQueue(queue.Queue):
    """A device's queue of shards (None: a thread's stop); `take_ready` takes from its head, at
    once, those that can go now."""

    def take_ready(self, most: int, ready: Callable[[Any], bool]) -> list:
        with self.mutex:  # Queue's own lock over its deque, as its _get and _put use them
            taken = []
            while self.queue and len(taken) < most and self.queue[0] is not None and ready(self.queue[0]):
                taken.append(self.queue.popleft())
            return taken


def _closed(attempt: Attempt) -> None:
    raise Cancelled("the job's devices were closed")


class DevicePool:
    """Runs shards on a job's devices. `run(attempt)` does the work and raises ShardFailed;
    `run_group(attempts)`, if given, runs attempts for one device together and gives, for each in
    order as it ends (a list or an iterator), what `run` would have returned or raised (the
    exception, not raised): a shard queued behind the one a device thread takes joins it if
    `ready(shard, device)` says it can go at once."""

    def __init__(
        self,
        devices: Sequence[Any],
        run: Callable[[Attempt], Any],
        scope: CancelScope,
        *,
        on_retry: Callable[[Attempt, str], None] = lambda attempt, cause: None,
        max_attempts: int = MAX_ATTEMPTS,
        run_group: Callable[[list[Attempt]], Iterable[Any]] | None = None,
        ready: Callable[[Any, Any], bool] = lambda shard, device: True,
    ):
        self._devices = {d.spec.id: d for d in devices}
        self._run, self._run_group, self._ready = run, run_group, ready
        self._scope = scope
        self._on_retry = on_retry
        self._max_attempts = max_attempts
        self._lock = threading.Lock()
        self._ended = threading.Condition()  # wait_all's: notified once all it waits for ended, or one failed
        self._watched: set[int] = set()  # ids of the shards wait_all still waits for
        self._failed: dict[str, tuple[str, str]] = {}  # device -> (code, cause) of the failure that took it out
        self._load: dict[str, int] = {d: 0 for d in self._devices}
        self._queues: dict[str, _DeviceQueue] = {d: _DeviceQueue() for d in self._devices}
        self._threads = [
            threading.Thread(target=self._serve, args=(d,), name=f"shards-{d}", daemon=True)
            for d in self._devices for _ in range(SHARDS_IN_FLIGHT_PER_DEVICE)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, shard: Any, device_id: str, on_done: Callable[[Any], None] | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> _Pending:
        pending = _Pending(shard, on_done, on_error)
        self._enqueue(pending, device_id)
        return pending

    def wait(self, pending: _Pending) -> Any:
        while not pending.done.wait(0.5):
            self._scope.check()
        if pending.error is not None:
            raise pending.error
        return pending.result

    def wait_all(self, pendings: Sequence[_Pending]) -> None:
        """Wait until every one of `pendings` has ended; raises the first final failure as soon as
        one comes (the others go on until the job's end cancels them). One wake-up for all, not
        one a shard: waking a waiting thread costs a thread switch, which a small shard notices."""
        with self._ended:
            self._watched = {id(p) for p in pendings if not p.done.is_set()}
            try:
                while (failed := self._first_failure(pendings)) is None and self._watched:
                    self._ended.wait(BUDGET_CHECK_S)
                    self._scope.check()
            finally:
                self._watched = set()
        if failed is not None:
            raise failed.error

    @staticmethod
    def _first_failure(pendings: Sequence[_Pending]) -> _Pending | None:
        return next((p for p in pendings if p.error is not None), None)

    def close(self) -> None:
        for q in self._queues.values():
            for _ in range(SHARDS_IN_FLIGHT_PER_DEVICE):
                q.put(None)
        for thread in self._threads:
            thread.join()
        # The threads refer to this pool and `run` to the job (its parameters among what it closes
        # over): dropped now, so they go with the job instead of waiting for the cycle collector.
        self._threads = []
        self._run, self._run_group, self._on_retry = _closed, None, lambda attempt, cause: None

    def lose(self, device_id: str, cause: str) -> bool:
        """Take a device out of the job: no shard goes to it from now on (one queued for it moves
        on). Its shards in flight are the caller's to stop (Workers.drop_device); their failure
        then retries them here. False if it was out already (or is not the job's)."""
        with self._lock:
            if device_id not in self._devices or device_id in self._failed:
                return False
            self._failed[device_id] = ("UNAVAILABLE", cause)
        return True

    def _enqueue(self, pending: _Pending, device_id: str) -> None:
        with self._lock:
            self._load[device_id] += 1
        self._queues[device_id].put(pending)

    def _serve(self, device_id: str) -> None:
        queued, device = self._queues[device_id], self._devices[device_id]

        def ready(pending: _Pending) -> bool:
            return self._ready(pending.shard, device)
        while (pending := queued.get()) is not None:
            group = [pending]
            if self._run_group is not None:  # the shards behind it that can go now go with it
                group += queued.take_ready(SHARDS_PER_GROUP - 1, ready)
            with self._lock:
                self._load[device_id] -= len(group)
            if len(group) == 1:
                self._attempt(pending, device_id)
            else:
                self._attempt_group(group, device_id)

    def _attempt(self, pending: _Pending, device_id: str) -> None:
        attempt = self._begin(pending, device_id)
        if attempt is None:
            return
        context = pending.context.copy()
        try:
            result = context.run(self._run, attempt)
        except BaseException as exc:  # noqa: BLE001 - settled below, as the shard's failure
            self._settle(pending, device_id, context, None, exc)
            return
        self._settle(pending, device_id, context, result, None)

    def _attempt_group(self, group: list[_Pending], device_id: str) -> None:
        """Shards for one device as one call of `run_group`, in the first one's context (a job's
        shards are submitted from one); each succeeds, fails or is retried on its own as its result
        comes."""
        begun = [(pending, attempt) for pending in group if (attempt := self._begin(pending, device_id)) is not None]
        if not begun:
            return
        settled, results = 0, ()
        try:
            results = begun[0][0].context.copy().run(self._run_group, [attempt for _, attempt in begun])
            for result in results:
                pending = begun[settled][0]
                failed = isinstance(result, BaseException)
                settled += 1
                self._settle(pending, device_id, pending.context.copy(), None if failed else result,
                             result if failed else None)
            if settled < len(begun):
                raise RuntimeError(f"run_group gave {settled} results for {len(begun)} shards")
        except BaseException as exc:  # noqa: BLE001 - the group's call failed: each shard not settled with it
            for pending, _ in begun[settled:]:
                self._settle(pending, device_id, pending.context.copy(), None, exc)
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()

    def _begin(self, pending: _Pending, device_id: str) -> Attempt | None:
        """The shard's next attempt on the device; None if it ended or moved on instead."""
        if self._scope.cancelled.is_set():
            self._fail(pending, Cancelled())
            return None
        if device_id in self._failed:  # queued here before the device failed: move on
            self._reroute(pending, device_id, None)
            return None
        pending.tried.append(device_id)
        return Attempt(pending.shard, self._devices[device_id], len(pending.tried))

    def _settle(self, pending: _Pending, device_id: str, context: contextvars.Context, result: Any,
                error: BaseException | None) -> None:
        """An attempt ended with `result`, or `error`: the shard succeeds, is retried or fails."""
        try:
            if error is not None:
                raise error
            pending.result = result
            if pending.on_done is not None:  # in the submitter's context too: what it submits stays in the trace
                context.run(pending.on_done, pending.result)
                pending.result = None  # taken: holding every shard's outputs would grow with the job
        except ShardFailed as exc:
            if self._scope.cancelled.is_set():
                self._fail(pending, Cancelled())
                return
            pending.failures.append(f"{device_id}: {exc.cause}")
            pending.causes.append((exc.code, exc.cause))
            with self._lock:
                self._failed[device_id] = (exc.code, exc.cause)
            self._reroute(pending, device_id, exc.cause)
            return
        except BaseException as exc:  # noqa: BLE001 - a bug fails the shard, never the thread
            # The traceback goes into the log as text and leaves the error: its frames (the shard's
            # inputs and parameters among their locals and closures, and this frame, which holds
            # `pending`, which will hold the error) would keep all that alive, here and in any log
            # record a handler keeps.
            log.error("shard %s crashed on %s\n%s", getattr(pending.shard, "index", "?"), device_id,
                      "".join(traceback.format_exception(exc)).rstrip())
            traceback.clear_frames(exc.__traceback__)
            self._fail(pending, exc.with_traceback(None))
            return
        finally:
            del error
        self._end(pending)

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        pending.error = error
        if pending.on_error is not None:
            pending.on_error(error)
        self._end(pending, failed=True)

    def _end(self, pending: _Pending, failed: bool = False) -> None:
        with self._ended:
            pending.done.set()
            if id(pending) in self._watched:
                self._watched.discard(id(pending))
                if failed or not self._watched:
                    self._ended.notify_all()

    def _reroute(self, pending: _Pending, device_id: str, cause: str | None) -> None:
        target = self._next_device(pending, self._devices[device_id].target_type)
        if target is None or len(pending.tried) >= self._max_attempts:
            index = getattr(pending.shard, "index", "?")
            # Its own failures; none (every device went out on other shards before it was tried
            # there): those that took the devices out.
            with self._lock:
                causes, devices = ((pending.causes, pending.tried) if pending.causes else
                                   (list(self._failed.values()), list(self._failed)))
            if len(set(causes)) == 1 and causes[0][0] in NOT_RETRYABLE_CODES:
                # The same refusal from every device tried: a fault of the job, not of the devices.
                self._fail(pending, errors.FailedPrecondition(
                    f"shard {index} failed the same way on every device tried ({', '.join(devices)}): "
                    f"{causes[0][1]}; retrying will not help"))
                return
            failures = pending.failures or [f"{device}: {cause}" for device, (_, cause) in zip(devices, causes)]
            self._fail(pending, errors.Unavailable(
                f"shard {index} could not run: {'; '.join(failures) or 'no device left'}"
                + ("" if target else "; no other device can take it")
            ))
            return
        if cause is not None:
            # pending.failures[-1] is "<failed device>: <cause>", what the job's record keeps.
            self._on_retry(Attempt(pending.shard, self._devices[target], len(pending.tried) + 1), pending.failures[-1])
            time.sleep(RETRY_BACKOFF_S * 2 ** (len(pending.tried) - 1))
        self._enqueue(pending, target)

    def _next_device(self, pending: _Pending, target_type: str) -> str | None:
        """Same target type first (it has the artifact), then any other; least loaded first. A node
        the shard could not reach comes last: its other devices sit behind the same silent link."""
        unreached = {getattr(self._devices[d], "node_address", None)
                     for d, (code, _) in zip(pending.tried, pending.causes) if code in UNREACHED_CODES}
        with self._lock:
            usable = [d for d in self._devices if d not in self._failed and d not in pending.tried]
            usable.sort(key=lambda d: (getattr(self._devices[d], "node_address", None) in unreached,
                                       self._devices[d].target_type != target_type, self._load[d], d))
        return usable[0] if usable else None
