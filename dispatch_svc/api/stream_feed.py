"""The SubmitJob / RunJob request stream after its spec, read as the job's InputFeed: parameter
tensors, then row blocks, each checked against the spec and the limits as it arrives.

`BlockHeaders` checks each block's place (its first row, how many rows it carries) as soon as the
stream's reader takes it from the transport, before the job reads it: a job plans and compiles
between its first block and the next, and a block that can never fit the spec must stop it then,
not cost it the build and a reservation first."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np

from accelmesh import errors
from accelmesh.runtime.tensors import TensorCollector, from_proto
from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.limits import JobLimits
from dispatch_svc.jobs.validation import check_parameter_header, input_bytes

# A stream that ends short of its declared input may be a client killed mid-upload: gRPC can end
# the request iterator before it marks the call cancelled. This long is waited for the call's end.
GONE_GRACE_S = 1.0


def misplaced(first_row: int, rows: int, expected: int, declared: int, name: str) -> errors.InvalidArgument | None:
    """Why a block of `rows` rows at `first_row` cannot be the next one (`expected`) of an input of
    `declared` rows in all (`name`: the first input's), or None if it can; rows below 1 are the
    feed's to refuse."""
    if first_row != expected:
        return errors.InvalidArgument(
            f"block.first_row is {first_row}; the next row expected is {expected}: send the blocks in order, each "
            "starting at the row after the last one sent", field="block.first_row")
    if rows > 0 and expected + rows > declared:
        return errors.InvalidArgument(
            f"block at row {expected} carries {rows} rows; the spec declares {declared} in all "
            f"(spec.inputs[0].shape[0] of input {errors.quoted(name)}): send at most {declared - expected} more "
            "rows, or declare every row in the spec", field="block.tensors[0].shape")
    return None


class BlockHeaders:
    """Checks each block's place in the input as the stream's reader takes it (`watch`), one
    message ahead of the job: the block after the one the job read waits there while the job plans,
    compiles or waits for room in its in-flight budget. A block that cannot fit the spec is refused
    at once: the job is stopped (`stops`), FAILED with INVALID_ARGUMENT, and the stream ends with
    that error where the job would read the block. Only the header is looked at (first_row, the
    first tensor's rows): the rest of each block is checked by the feed as the job reads it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._refused: errors.InvalidArgument | None = None
        self._live = None

    def watch(self, requests: Iterator) -> Iterator:
        """`requests` with each block's header checked as it is taken; the first message declares
        the rows (a spec), else nothing is checked here (the handler refuses the stream)."""
        declared, name, expected, first = None, "", 0, True
        for message in requests:
            part = message.WhichOneof("part")
            if first and part == "spec":
                inputs = message.spec.inputs
                if inputs and inputs[0].shape:
                    declared, name = inputs[0].shape[0], inputs[0].name
            elif part == "block" and declared is not None:
                block = message.block
                rows = block.tensors[0].shape[0] if block.tensors and block.tensors[0].shape else 0
                refused = misplaced(block.first_row, rows, expected, declared, name)
                if refused is not None:
                    self._refuse(refused)
                    del message, block  # the raised error's frames do not hold the refused block
                    raise errors.InvalidArgument(str(refused), field=refused.field)
                if rows <= 0:
                    declared = None  # the feed refuses it: nothing after it is read
                expected += rows
            first = False
            yield message

    def check(self) -> None:
        """Raise the refusal of a block read so far, if any (before the job is recorded)."""
        with self._lock:
            refused = self._refused
        if refused is not None:
            raise errors.InvalidArgument(str(refused), field=refused.field)

    def stops(self, live) -> None:
        """A block refused from now on (or already) stops `live`, the stream's job (LiveJob.refuse)."""
        with self._lock:
            self._live, refused = live, self._refused
        if refused is not None:
            live.refuse(refused)

    def _refuse(self, error: errors.InvalidArgument) -> None:
        with self._lock:
            self._refused, live = self._refused or error, self._live
        if live is not None:
            live.refuse(error)


class StreamFeed:
    """The request stream after its spec: parameter tensors, then row blocks, checked as they come.

    `read_ahead` takes the client's parameters (if it sends any) and the first block before the
    job is planned, so parameters over the limits or a block that can never fit the spec cost no
    planning, compiling or reserving; the parameters would be held from the plan on anyway. A
    stream that ends before its first block is left to the job: what planning finds wrong with
    the spec (an unknown program, a signature mismatch) is the more useful answer, and a batch of
    no rows needs no block. A stream that breaks (the client disconnected, or its deadline
    passed) raises Cancelled, saying how much of the input had arrived."""

    after_parameters = "block"  # the part that ends the parameters (held for what reads on)

    def __init__(self, requests: Iterator, spec: m.JobSpec, max_parameter_bytes: int,
                 limits: JobLimits | None = None, ended: threading.Event | None = None):
        """`ended`: set once the call ended (its client went, or it was answered)."""
        self._requests = requests
        self._ended = ended
        self._spec = spec
        self._max_parameter_bytes = max_parameter_bytes
        self._limits = limits or JobLimits()
        self._declared = input_bytes(spec)  # what the client will send, parameters aside
        self._announced = 0  # parameter bytes their headers announced
        self._received = 0  # bytes of parameters and blocks received so far
        self._held = None  # the first block, read while looking for the end of the parameters
        self._first: tuple[int, list[np.ndarray]] | None = None  # the first block, read and checked ahead
        self._parameters: list[tuple[str, np.ndarray]] | None = None  # read ahead, until the job takes them

    @property
    def short(self) -> bool:
        """Whether the job has read less than the client declared it would send."""
        return self._received < self._declared + self._announced

    def gone(self) -> str:
        """Why the job stops when its client went away: how much of its input had arrived."""
        total = self._declared + self._announced
        if self._received < total:
            return f"the client disconnected while sending input ({self._received:,} of {total:,} bytes received)"
        return "the client disconnected"

    def close(self) -> None:
        """The job ended: let go of the stream and of anything read ahead."""
        self._requests, self._held, self._first, self._parameters = iter(()), None, None, None

    def _messages(self) -> Iterator:
        try:
            for message in self._requests:
                part = message.WhichOneof("part")
                if part == "parameter_chunk":
                    self._received += len(message.parameter_chunk.data)
                elif part == "block":
                    self._received += sum(len(t.data) for t in message.block.tensors)
                yield message
        except grpc.RpcError:  # the transport's word for a client that is gone: no status to send it
            raise errors.Cancelled(self.gone()) from None
        if self._ended is not None and self.short and self._ended.wait(GONE_GRACE_S):
            raise errors.Cancelled(self.gone())

    def read_ahead(self) -> None:
        if self._first is not None:
            return
        if self._spec.client_parameters:
            self._parameters = self._read_parameters()
            block = self._held
            self._held = None
        else:
            message = next(self._messages(), None)
            part = message.WhichOneof("part") if message is not None else None
            if part is not None and part != "block":
                raise errors.InvalidArgument(f"unexpected {part} among the blocks" + (
                    "; send parameters only with spec.client_parameters set" if part.startswith("parameter") else ""))
            block = message.block if message is not None else None
        if block is not None:
            self._first = (block.first_row, self._checked(block, 0))
        else:
            self._requests = iter(())  # ended: the job's feed finds no block, after its spec is checked

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        if self._parameters is not None:
            taken, self._parameters = self._parameters, None  # the job holds them from now on, not the feed
            return taken
        return self._read_parameters()

    def _read_parameters(self) -> list[tuple[str, np.ndarray]]:
        leaves, count = TensorCollector("parameter"), 0
        for message in self._messages():
            part = message.WhichOneof("part")
            if part == "parameter":
                header = message.parameter
                count += 1
                check_parameter_header(header.name, count, self._announced + max(0, header.total_bytes),
                                       self._declared, self._limits, self._max_parameter_bytes)
                leaves.header(header)  # checks total_bytes against the dtype and shape
                self._announced += header.total_bytes
            elif part == "parameter_chunk":
                leaves.chunk(message.parameter_chunk)
            elif part == self.after_parameters:
                self._held = message.block if part == "block" else message
                break
            else:
                raise errors.InvalidArgument(f"unexpected {part} after the spec; send parameters, then "
                                             f"{self.after_parameters} messages")
        return list(leaves.results().items())

    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        expected = 0
        if self._first is not None:
            first, self._first = self._first, None
            expected = first[1][0].shape[0]
            yield first
        for block in self._all_blocks():
            arrays = self._checked(block, expected)
            expected += arrays[0].shape[0]
            yield block.first_row, arrays

    def _checked(self, block, expected: int) -> list[np.ndarray]:
        """The block's tensors, if they are the next rows of the declared inputs."""
        decls = self._spec.inputs
        if not decls:
            raise errors.InvalidArgument(
                "a block arrived but spec.inputs declares no inputs; declare them (rows first)")
        refused = misplaced(block.first_row, 0, expected, decls[0].rows, decls[0].name)
        if refused is not None:
            raise refused
        if len(block.tensors) != len(decls):
            raise errors.InvalidArgument(
                f"block at row {expected} has {len(block.tensors)} tensors, the spec declares {len(decls)}")
        arrays = [from_proto(t, f"block[{expected}].tensors[{i}]") for i, t in enumerate(block.tensors)]
        rows = arrays[0].shape[0] if arrays[0].ndim else -1
        for decl, array in zip(decls, arrays):
            if (array.ndim == 0 or array.dtype != np.dtype(decl.dtype) or array.shape[1:] != tuple(decl.shape[1:])
                    or array.shape[0] != rows):
                raise errors.InvalidArgument(
                    f"block at row {expected}: input '{decl.name}' is {array.dtype}{list(array.shape)}, "
                    f"expected {decl.dtype}[{rows}, {', '.join(map(str, decl.shape[1:]))}]")
        if rows <= 0:
            raise errors.InvalidArgument(
                f"block at row {expected} carries {rows} rows; the spec declares {decls[0].rows} in all")
        refused = misplaced(block.first_row, rows, expected, decls[0].rows, decls[0].name)
        if refused is not None:  # what BlockHeaders refused as the reader took it, if the stream had one
            raise refused
        return arrays

    def _all_blocks(self):
        if self._held is not None:
            held, self._held = self._held, None
            yield held
        for message in self._messages():
            if message.WhichOneof("part") != "block":
                raise errors.InvalidArgument(f"unexpected {message.WhichOneof('part')} among the blocks")
            yield message.block
