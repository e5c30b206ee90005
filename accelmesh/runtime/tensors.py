"""Tensor codec: numpy/JAX arrays <-> accelmesh.common.v1 Tensor messages, whole or chunked.

Bytes are row-major little-endian; bfloat16 travels as its 2-byte pattern (ml_dtypes, which
JAX depends on). Chunking keeps every message below the channel limit, so a tensor of any
size crosses a stream without raising grpc.max_receive_message_length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from google.protobuf.message import Message

from accelmesh import errors
from accelmesh.common.v1 import common_pb2

# Every stream of tensor bytes (clients, dispatch, compile, workers) cuts them into chunks of this
# size unless the peer asks for less: well under the 16 MiB message limit, and large enough that
# per-message costs stay small next to the copy.
DEFAULT_CHUNK_BYTES = 1024 * 1024

_DTYPES: dict[int, np.dtype] = {
    common_pb2.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DATA_TYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    common_pb2.DATA_TYPE_FLOAT64: np.dtype("<f8"),
    common_pb2.DATA_TYPE_INT8: np.dtype("i1"),
    common_pb2.DATA_TYPE_INT16: np.dtype("<i2"),
    common_pb2.DATA_TYPE_INT32: np.dtype("<i4"),
    common_pb2.DATA_TYPE_INT64: np.dtype("<i8"),
    common_pb2.DATA_TYPE_UINT8: np.dtype("u1"),
    common_pb2.DATA_TYPE_UINT32: np.dtype("<u4"),
    common_pb2.DATA_TYPE_BOOL: np.dtype("?"),
}
_CODES: dict[np.dtype, int] = {dtype.newbyteorder("="): code for code, dtype in _DTYPES.items()}


_NAMES: dict[str, int] = {dtype.name: code for code, dtype in _DTYPES.items()}


def dtype_code_for_name(name: str, field: str = "dtype") -> int:
    """DataType of a dtype name as numpy spells it ("float32", "bfloat16", ...)."""
    try:
        return _NAMES[name]
    except KeyError:
        raise errors.InvalidArgument(f"{field}: {name!r} is not one of {', '.join(_NAMES)}") from None


def dtype_name(code: int, field: str = "dtype") -> str:
    return numpy_dtype(code, field).name


def dtype_code(dtype, field: str = "tensor") -> int:
    dtype = np.dtype(dtype).newbyteorder("=")
    try:
        return _CODES[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in _CODES)
        raise errors.InvalidArgument(f"{field}: dtype {dtype} cannot travel as a tensor; use one of {known}") from None


def numpy_dtype(code: int, field: str = "dtype") -> np.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise errors.InvalidArgument(f"{field}: {code} is not a supported DataType; set a DATA_TYPE_* value") from None


# Above numpy's and XLA's practical ranks; it also keeps the byte count of any shape a number
# that prints (Python refuses to format integers past 4,300 digits).
MAX_RANK = 32


def _little_endian(array) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns a 0-d scalar into shape (1,).
    return np.asarray(array, order="C")


def _expected_bytes(dtype: np.dtype, shape, field: str) -> int:
    if len(shape) > MAX_RANK:
        raise errors.InvalidArgument(
            f"{field}.shape has {len(shape)} dimensions; at most {MAX_RANK} are supported")
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"{field}.shape {errors.quoted(list(shape))} has a negative dimension")
    # Python ints: numpy's int64 product wraps silently, letting a huge shape pass as 0 bytes.
    check_array_shape(shape, dtype.itemsize, f"{field}.shape")
    return math.prod(int(d) for d in shape) * dtype.itemsize


def check_array_shape(shape, itemsize: int, field: str = "shape") -> None:
    """A shape with a zero dimension that numpy can still make an array of: numpy refuses one whose
    other dimensions' product, in bytes, passes an int64 ([0, 2**62] of float32) though it holds none."""
    if 0 in shape and math.prod(int(d) for d in shape if d) * itemsize >= 2**63:
        raise errors.InvalidArgument(f"{field} {errors.quoted(list(shape))} is too large an array even with a zero "
                                     "dimension: numpy counts the other dimensions' product", field=field)


def to_proto(array, field: str = "tensor") -> common_pb2.Tensor:
    array = _little_endian(array)
    return common_pb2.Tensor(dtype=dtype_code(array.dtype, field), shape=array.shape, data=array.tobytes())


def from_proto(tensor: common_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    dtype = numpy_dtype(tensor.dtype, f"{field}.dtype")
    expected = _expected_bytes(dtype, tensor.shape, field)
    if len(tensor.data) != expected:
        raise errors.InvalidArgument(
            f"{field}.data has {len(tensor.data)} bytes but dtype {dtype} and shape "
            f"{errors.quoted(list(tensor.shape))} need {expected}"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tuple(tensor.shape))


def _prepared(name: str, array, chunk_bytes: int) -> tuple[common_pb2.TensorHeader, memoryview]:
    """The header announcing the tensor, and its little-endian bytes to cut into chunks."""
    if chunk_bytes <= 0:
        raise errors.InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    array = _little_endian(array)
    header = common_pb2.TensorHeader(
        name=name, dtype=dtype_code(array.dtype, f"tensor '{name}'"), shape=array.shape, total_bytes=array.nbytes
    )
    return header, memoryview(array.reshape(-1).view(np.uint8))


def _pieces(view: memoryview, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) of each chunk: at least one, so an empty tensor arrives too."""
    offset = 0
    while True:
        piece = view[offset : offset + chunk_bytes]
        yield offset, piece
        offset += len(piece)
        if offset >= len(view):
            return


def split(
    name: str, array, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[common_pb2.TensorHeader, Iterator[common_pb2.TensorChunk]]:
    """A header announcing the tensor, and its chunks (at least one, so empty tensors arrive too)."""
    header, view = _prepared(name, array, chunk_bytes)
    chunks = (common_pb2.TensorChunk(name=name, offset=offset, data=piece.tobytes())
              for offset, piece in _pieces(view, chunk_bytes))
    return header, chunks


_SMALL_VARINTS = tuple(bytes((value,)) for value in range(0x80))  # tags and short lengths: most of a frame's


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(field_number: int) -> bytes:
    return _varint(field_number << 3 | 2)


_CHUNK = common_pb2.TensorChunk.DESCRIPTOR.fields_by_name
_NAME_TAG, _DATA_TAG = _length_delimited(_CHUNK["name"].number), _length_delimited(_CHUNK["data"].number)
_OFFSET_TAG = _varint(_CHUNK["offset"].number << 3)


def split_frames(name: str, array, chunk_bytes: int, into: type[Message], *,
                 base_offset: int = 0) -> tuple[common_pb2.TensorHeader, Iterator[bytes]]:
    """`split`'s header, and each chunk as a message of type `into` (a stream message with a
    ``chunk`` field) already serialized: the bytes a stream sends as they are (a method whose
    serializer takes them, `serialized_or`). ``base_offset`` is added to every chunk's offset (a
    slab of rows placed in a larger tensor). protobuf's Python messages copy a bytes field when
    it is set, again when a chunk is wrapped in its stream message, and again when that is
    serialized; here a chunk's bytes are copied once, from a view of the tensor into its frame.
    The wire format is protobuf's own (the chunk as a length-delimited field of `into` whose
    number its descriptor gives); tests/shared/test_tensors.py parses every frame back with
    protobuf and compares it with the message built from `split`'s chunk."""
    header, view = _prepared(name, array, chunk_bytes)
    field_tag = _length_delimited(into.DESCRIPTOR.fields_by_name["chunk"].number)
    encoded_name = name.encode()
    name_field = _NAME_TAG + _varint(len(encoded_name)) + encoded_name

    def frames() -> Iterator[bytes]:
        for offset, piece in _pieces(view, chunk_bytes):
            at = base_offset + offset
            fields = name_field + (_OFFSET_TAG + _varint(at) if at else b"") + _DATA_TAG + _varint(len(piece))
            yield b"".join((field_tag, _varint(len(fields) + len(piece)), fields, piece))

    return header, frames()


def serialized_or(serializer: Callable[[Message], bytes]) -> Callable[[Message | bytes], bytes]:
    """A gRPC serializer that sends bytes (`split_frames`) as they are and messages as `serializer` does."""
    def serialize(message):
        return message if isinstance(message, bytes) else serializer(message)

    return serialize


WriteAt = Callable[[int, bytes], None]  # write(offset in the tensor's bytes, data)
# place(index, dtype, shape): where the stream's index-th tensor (from 0, in the order announced), of
# that dtype and shape, goes as its chunks arrive (None: kept in memory)
PlaceTensor = Callable[[int, np.dtype, tuple[int, ...]], WriteAt | None]


@dataclass(frozen=True)
class Placed:
    """A tensor whose bytes were written where `PlaceTensor` said as they arrived: what it was."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


class TensorAssembler:
    """Rebuilds one tensor from its header and chunks, refusing gaps, overlaps and overflow.

    Memory follows the bytes that arrived, never the bytes a header declares: a peer can announce
    a gigabyte in a 150-byte header and then send nothing (or go away). The chunks' bytes are kept
    as they came (no copy) until half the tensor has arrived; then a buffer of exactly its size is
    allocated (its pages become resident as they are written), the chunks so far are copied into
    it and let go, and every later chunk is copied straight in. So what is allocated is at most
    twice what arrived, what is resident about what arrived (a chunk more at the switch), every
    byte is copied once, and a finished tensor (which a worker may hold for a job's later shards)
    carries no growth margin. The result is a writable numpy view of that buffer.

    `write_through` sends every chunk to a writer instead (a file the tensor is placed in, such as
    a job's result rows): nothing of the tensor is held, and the result is its `Placed` record.
    """

    def __init__(self, header: common_pb2.TensorHeader, field: str = "tensor"):
        self.name = header.name
        self.field = field
        label = f"{field} '{self.name}'"
        self.dtype = numpy_dtype(header.dtype, f"{label} dtype")
        self.shape = tuple(header.shape)
        expected = _expected_bytes(self.dtype, self.shape, label)
        if header.total_bytes != expected:
            raise errors.InvalidArgument(
                f"{field} '{self.name}': total_bytes {header.total_bytes} does not match dtype {self.dtype} "
                f"and shape {errors.quoted(list(self.shape))} ({expected} bytes)"
            )
        self.total_bytes = expected  # declared, checked against dtype and shape; nothing allocated for it
        self._chunks: list[bytes] = []
        self._whole: np.ndarray | None = None  # bytes of exactly total_bytes, once half of them arrived
        self._write: WriteAt | None = None  # set by write_through: chunks go there, not here
        self.received_bytes = 0  # what this assembler holds (or wrote through)

    @property
    def complete(self) -> bool:
        return self.received_bytes == self.total_bytes

    def write_through(self, write: WriteAt) -> None:
        """Send every chunk from now on to `write(offset, data)` (the offset in the tensor's bytes)."""
        if self.received_bytes:
            raise ValueError(f"{self.field} '{self.name}': write_through after chunks arrived")
        self._write = write

    def add(self, chunk: common_pb2.TensorChunk) -> None:
        if chunk.name != self.name:
            raise errors.InvalidArgument(f"{self.field}: chunk for '{chunk.name}' arrived while '{self.name}' is open")
        received = self.received_bytes
        if chunk.offset != received:
            raise errors.InvalidArgument(
                f"{self.field} '{self.name}': chunk offset {chunk.offset}, expected {received}; send chunks in order"
            )
        data = chunk.data
        if received + len(data) > self.total_bytes:
            raise errors.InvalidArgument(
                f"{self.field} '{self.name}': chunks carry more than the declared {self.total_bytes} bytes"
            )
        if not data:
            return
        if self._write is not None:
            self._write(received, data)
            self.received_bytes += len(data)
            return
        if self._whole is not None:
            self._whole[received:received + len(data)] = np.frombuffer(data, np.uint8)
        else:
            self._chunks.append(data)
        self.received_bytes += len(data)
        if self._whole is None and 2 * self.received_bytes >= self.total_bytes:
            self._gather()

    def result(self) -> np.ndarray | Placed:
        if not self.complete:
            raise errors.InvalidArgument(
                f"{self.field} '{self.name}': stream ended after {self.received_bytes} of {self.total_bytes} bytes"
            )
        if self._write is not None:
            return Placed(self.name, self.dtype, self.shape)
        if self._whole is None:  # nothing arrived: an empty tensor
            self._gather()
        return self._whole.view(self.dtype).reshape(self.shape)

    def _gather(self) -> None:
        """The buffer of the whole tensor, with the chunks so far copied into it and let go."""
        self._whole, at = np.empty(self.total_bytes, np.uint8), 0
        for data in self._chunks:
            self._whole[at:at + len(data)] = np.frombuffer(data, np.uint8)
            at += len(data)
        self._chunks = []


class TensorCollector:
    """Rebuilds every tensor of a stream: a TensorHeader opens one, TensorChunks (which name their
    tensor, so tensors may interleave) fill it; results keep the order the headers came in. A
    tensor that `place` gives a writer for goes there as it arrives (TensorAssembler.write_through)."""

    def __init__(self, field: str = "tensor", place: PlaceTensor | None = None):
        self.field = field
        self._place = place
        self._open: dict[str, TensorAssembler] = {}

    def header(self, header: common_pb2.TensorHeader) -> None:
        if header.name in self._open:
            raise errors.InvalidArgument(f"{self.field} '{header.name}' was announced twice")
        assembler = TensorAssembler(header, self.field)
        write = self._place(len(self._open), assembler.dtype, assembler.shape) if self._place is not None else None
        if write is not None:
            assembler.write_through(write)
        self._open[header.name] = assembler

    def chunk(self, chunk: common_pb2.TensorChunk) -> None:
        assembler = self._open.get(chunk.name)
        if assembler is None:
            raise errors.InvalidArgument(f"{self.field}: a chunk of '{chunk.name}' came before its header")
        assembler.add(chunk)

    def results(self) -> dict[str, np.ndarray | Placed]:
        return {name: assembler.result() for name, assembler in self._open.items()}

    def collect(self, messages: Iterable) -> dict[str, np.ndarray]:
        """Every tensor of a stream whose messages are each a `tensor` header or a `chunk` (the
        `part` oneof of FetchResult, FetchParameters and the like)."""
        for message in messages:
            if message.WhichOneof("part") == "tensor":
                self.header(message.tensor)
            else:
                self.chunk(message.chunk)
        return self.results()
