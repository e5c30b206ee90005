"""The SubmitJob / RunJob request stream after its spec, read as the job's InputFeed: parameter
tensors, then row blocks, each checked against the spec and the limits as it arrives."""

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


class StreamFeed:
    """The request stream after its spec: parameter tensors, then row blocks, checked as they come.

    `read_ahead` takes the client's parameters (if it sends any) and the first block before the
    job is planned, so parameters over the limits or a block that can never fit the spec cost no
    planning, compiling or reserving; the parameters would be held from the plan on anyway. A
    stream that ends before its first block is left to the job: what planning finds wrong with
    the spec (an unknown program, a signature mismatch) is the more useful answer, and a batch of
    no rows needs no block. A stream that breaks (the client disconnected, or its deadline
    passed) raises Cancelled, saying how much of the input had arrived."""

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
        if (self._ended is not None and self._received < self._declared + self._announced
                and self._ended.wait(GONE_GRACE_S)):
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
            elif part == "block":
                self._held = message.block
                break
            else:
                raise errors.InvalidArgument(f"unexpected {part} after the spec; send parameters, then blocks")
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
        if block.first_row != expected:
            raise errors.InvalidArgument(f"block.first_row is {block.first_row}; the next row expected is {expected}")
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
        if rows <= 0 or expected + rows > decls[0].rows:
            raise errors.InvalidArgument(
                f"block at row {expected} carries {rows} rows; the spec declares {decls[0].rows} in all")
        return arrays

    def _all_blocks(self):
        if self._held is not None:
            held, self._held = self._held, None
            yield held
        for message in self._messages():
            if message.WhichOneof("part") != "block":
                raise errors.InvalidArgument(f"unexpected {message.WhichOneof('part')} among the blocks")
            yield message.block
