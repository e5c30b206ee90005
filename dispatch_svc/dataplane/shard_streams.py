"""One ExecuteMany stream per (job, device) carrying the job's shards for that device to its
worker, instead of an Execute call per shard (requirements A6; bench/README.md, "Where the data plane's time goes").

A call costs the dispatcher more than a small shard's bytes do: gRPC's synchronous client starts
a thread per streaming call to write its requests, and each call is set up and torn down on both
sides. A `ShardStream` is one open call: the device threads of the job's pool write their
shards' messages into it in turn (a shard's messages are written together, and lazily, so a
shard's bytes are framed only as gRPC sends them), and one reader thread matches the worker's
answers to the shards in the order they were written, which is the order the worker runs them in.
Shards written together (`send` of several, a group) may go as one batch, which a worker answers
in one message once they all ran: a message costs more than a small shard's descriptor.

A stream closes itself once no shard of it is waiting (the worker's thread is not held by an
idle job); the next shard opens another. A stream that breaks (the worker went away, the call
was cancelled or ran past SHARD_TIMEOUT_S on one shard) fails every shard waiting on it with the
call's status; the device pool retries them as it retries a failed Execute. A status about the
shard the worker was reading (its inputs: SHARD_STATUSES) is that shard's answer alone: the
shards behind it were never read, and go again on a fresh stream (`Unanswered`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from accelmesh import errors
from accelmesh.runtime.batches import unbatched
from accelmesh.runtime.errors import error_reason
from accelmesh.runtime.tensors import Placed, PlaceTensor, TensorCollector, numpy_dtype
from accelmesh.worker.v1 import worker_service_pb2 as worker_pb
from dispatch_svc.dataplane.device_queues import CancelScope, ShardFailed
from dispatch_svc.dataplane.held_keys import HeldKeys, Transfer

log = logging.getLogger(__name__)

STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
_END = object()  # the request queue's last item: no more shards on this stream


class NotHeld(Exception):
    """The worker did not hold a tensor the shard referred to; `cause` is its answer."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


class Unanswered(ShardFailed):
    """The stream ended on an earlier shard's inputs (its status was that shard's answer) before
    this one was read: send it again."""


# Statuses a worker ends an ExecuteMany call with for the shard it was reading (its header or
# inputs), not for the stream or the node: the shards behind it were never read.
SHARD_STATUSES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            grpc.StatusCode.OUT_OF_RANGE})


class StoredOutputs:
    """A shard's outputs that its worker kept in its object store (ShardHeader.output_prefix): a
    header each, named by its object id, and no chunks; the results are their `Placed` records."""

    def __init__(self):
        self._placed: dict[str, Placed] = {}

    def header(self, header) -> None:
        if header.name in self._placed:
            raise errors.InvalidArgument(f"stored output {errors.quoted(header.name)} was announced twice")
        self._placed[header.name] = Placed(header.name, numpy_dtype(header.dtype, "output dtype"), tuple(header.shape))

    def chunk(self, chunk) -> None:
        raise errors.InvalidArgument("the worker sent chunks of an output it was to keep in its store")

    def results(self) -> dict[str, Placed]:
        return dict(self._placed)


class StreamClosed(Exception):
    """The stream closed before the shard could be written to it: open another."""


@dataclass(eq=False)
class _Sending:
    """What is left to send of the shards written together (one, or a group whose parts may go as
    one batch); None once they were all answered or the stream failed (their inputs go)."""

    messages: Iterator | None
    unanswered: int


# A shard as written to a stream: its messages, its keyed inputs' plan (None: none), whether it
# refers to held tensors, where its outputs go (PlaceTensor) and whether the worker stores them.
Shard = tuple[Iterable, Transfer | None, bool, PlaceTensor | None, bool]


@dataclass(eq=False)
class _Waiting:
    """A shard written to the stream, waiting for its answer."""

    sending: _Sending
    transfer: Transfer | None  # its keyed inputs' plan (None: none)
    referred: bool  # it sent references to held tensors
    outputs: TensorCollector | StoredOutputs
    done: threading.Event = field(default_factory=threading.Event)
    timings: worker_pb.ShardTimings | None = None
    error: Exception | None = None  # ShardFailed or NotHeld


class ShardStream:
    def __init__(self, open_call: Callable[[Iterator], grpc.Call], scope: CancelScope, held: HeldKeys,
                 on_unavailable: Callable[[str], str], first: Sequence[Shard],
                 join: Callable[[Iterator], Iterator] | None = None, on_batches: Callable[[], None] = lambda: None):
        """Opens the call with the shards `first` written (`send`'s arguments): their answers are
        `self.first`. `on_batches` is called once the worker's first batched answer arrives (it
        reads batches too). `on_unavailable` is given an UNAVAILABLE's details and returns what to
        report of them."""
        self._held, self._on_unavailable, self._on_batches = held, on_unavailable, on_batches
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: deque[_Waiting] = deque()
        self.closed = False
        self.first = self.send(first, join)  # before the call opens: whatever becomes of the call answers them
        self._call = open_call(self._messages())
        self._unregister = scope.register(self._call.cancel)
        threading.Thread(target=self._read, name="shard-stream", daemon=True).start()

    def send(self, shards: Sequence[Shard], join: Callable[[Iterator], Iterator] | None = None) -> list[_Waiting]:
        """Write shards (each its header, then its inputs), in order; raises StreamClosed if the
        stream ended. `join` takes all their messages in order and gives what goes on the stream
        (a batch of them); none: each as it is. A shard's outputs go where its `place` says as
        they arrive (TensorCollector), the others to memory; `stored`: the worker keeps them in
        its object store and answers their headers alone."""
        messages = itertools.chain.from_iterable(shard[0] for shard in shards)
        sending = _Sending(join(messages) if join is not None else messages, len(shards))
        waiting = [_Waiting(sending, transfer, referred,
                            StoredOutputs() if stored else TensorCollector("output", place))
                   for _, transfer, referred, place, stored in shards]
        with self._lock:
            if self.closed:
                raise StreamClosed()
            self._waiting.extend(waiting)
            self._requests.put(sending)
        return waiting

    def cancel(self) -> None:
        self._call.cancel()

    def _messages(self) -> Iterator:
        # Not `yield from`: a failed stream's call keeps this generator, suspended; the shards it
        # was sending let go of their inputs when `_fail_all` drops their messages.
        while (sending := self._requests.get()) is not _END:
            while sending.messages is not None:
                message = next(sending.messages, _END)
                if message is _END:
                    break
                yield message
            del sending

    def _answers(self) -> Iterator:
        """The call's messages; the first batch among them says the worker takes batches."""
        told = False
        for message in self._call:
            if not told and message.WhichOneof("part") == "batch":
                told = True
                self._on_batches()
            yield message

    def _read(self) -> None:
        try:
            for part in unbatched(self._answers()):
                with self._lock:
                    if not self._waiting:
                        raise errors.InvalidArgument("the worker answered a shard that was not sent")
                    waiting = self._waiting[0]
                if waiting.transfer is not None and not waiting.transfer.settled:
                    self._held.arrived(waiting.transfer)  # any answer comes after the inputs were read
                kind = part.WhichOneof("part")
                if kind == "tensor":
                    waiting.outputs.header(part.tensor)
                elif kind == "chunk":
                    waiting.outputs.chunk(part.chunk)
                elif kind == "timings":
                    waiting.timings = part.timings
                    self._answered()
                elif kind == "failure":
                    code = STATUS_BY_CODE.get(part.failure.code, grpc.StatusCode.UNKNOWN)
                    cause = f"{code.name}: {part.failure.message}"
                    not_held = waiting.referred and part.failure.reason == errors.TENSOR_NOT_HELD
                    waiting.error = NotHeld(cause) if not_held else ShardFailed(cause, code.name)
                    self._answered()
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            reason = error_reason(exc)
            exc.__traceback__ = None  # the call's own error: its frames would hold the shards' inputs
            if code == grpc.StatusCode.UNAVAILABLE:
                details = self._on_unavailable(details)
            cause = f"{code.name}: {details}"
            with self._lock:
                head = self._waiting[0] if self._waiting else None

            def failure(waiting: _Waiting) -> Exception:
                if waiting is not head and code in SHARD_STATUSES:
                    return Unanswered(f"{cause} (a shard sent before it on the same stream)", code.name)
                if (waiting.referred and code == grpc.StatusCode.FAILED_PRECONDITION
                        and reason == errors.TENSOR_NOT_HELD):
                    return NotHeld(cause)
                return ShardFailed(cause, code.name)
            self._fail_all(failure)
        except errors.InvalidArgument as exc:  # a malformed answer: this stream is done
            self._call.cancel()
            malformed = f"worker sent a malformed result: {exc}"
            self._fail_all(lambda waiting: ShardFailed(malformed))
        finally:
            self._unregister()
            self._fail_all(lambda waiting: ShardFailed("worker ended the stream before answering the shard"))

    def _answered(self) -> None:
        """The shard at the head has its answer; an idle stream closes (the next shard opens another)."""
        with self._lock:
            waiting = self._waiting.popleft()
            waiting.sending.unanswered -= 1
            if not waiting.sending.unanswered:  # sent in full: nothing is left but the (exhausted) iterator
                waiting.sending.messages = None
            if not self._waiting and not self.closed:
                self.closed = True
                self._requests.put(_END)
        waiting.done.set()

    def _fail_all(self, error: Callable[[_Waiting], Exception]) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._requests.put(_END)
            failed, self._waiting = list(self._waiting), deque()
        for waiting in failed:
            waiting.sending.messages = None
            waiting.error = error(waiting)
            waiting.done.set()
