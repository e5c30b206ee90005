"""The tensor codec: whole and chunked round trips over every DataType, every bad input
refused with InvalidArgument naming the tensor, and an assembler's memory following the bytes
that arrived rather than the bytes a header declares."""

from __future__ import annotations

import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.tensors import (
    Placed,
    TensorAssembler,
    TensorCollector,
    dtype_code,
    from_proto,
    serialized_or,
    split,
    split_frames,
    to_proto,
)

MIB = 1024 * 1024
CHUNK_OVERHEAD_BYTES = 64  # name, offset and field tags around a chunk's data
NAME = "weights"
FIELD = "inputs[0]"


def _rng():
    return np.random.default_rng(seed=7)


ARRAYS = {
    "float32": lambda: _rng().standard_normal((3, 4)).astype(np.float32),
    "float32-specials": lambda: np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32),
    "float16": lambda: _rng().standard_normal((2, 5)).astype(np.float16),
    "bfloat16": lambda: np.array([[1.0, -2.5, 3.140625], [0.0, 65280.0, -1e-3]], dtype=ml_dtypes.bfloat16),
    "float64": lambda: _rng().standard_normal((4,)),
    "int8": lambda: np.array([-128, -1, 0, 1, 127], dtype=np.int8),
    "int16": lambda: np.array([[-32768, 32767], [0, -2]], dtype=np.int16),
    "int32": lambda: np.arange(-6, 6, dtype=np.int32).reshape(2, 2, 3),
    "int64": lambda: np.array([np.iinfo(np.int64).min, -1, np.iinfo(np.int64).max], dtype=np.int64),
    "uint8": lambda: np.arange(256, dtype=np.uint8).reshape(16, 16),
    "uint32": lambda: np.array([0, 1, np.iinfo(np.uint32).max], dtype=np.uint32),
    "bool": lambda: np.array([[True, False, True], [False, False, True]]),
    "scalar-float32": lambda: np.float32(1.5),
    "scalar-int64": lambda: np.array(-42, dtype=np.int64),
    "python-float": lambda: 2.25,
    "empty-1d": lambda: np.zeros((0,), dtype=np.float32),
    "empty-2d": lambda: np.zeros((3, 0), dtype=np.int64),
    "big-endian-int32": lambda: np.arange(6, dtype=">i4").reshape(2, 3),
    "big-endian-float64": lambda: np.array([1.5, -2.0, np.pi], dtype=">f8"),
    "transposed-view": lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,
    "strided-view": lambda: np.arange(20, dtype=np.int16)[::3],
}
CHUNK_SIZES = [1, 7, MIB]


def assert_same_tensor(result: np.ndarray, original) -> None:
    """Same shape, the little-endian form of the same dtype, and bit-identical elements."""
    original = np.asarray(original)
    expected = original.astype(original.dtype.newbyteorder("<"), order="C")
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype
    assert result.tobytes() == expected.tobytes()  # bitwise: NaN payloads and -0.0 included


def reassemble(header, chunks) -> np.ndarray:
    assembler = TensorAssembler(header)
    for chunk in chunks:
        assembler.add(chunk)
    assert assembler.complete
    return assembler.result()


def test_every_data_type_is_in_the_round_trip_table():
    covered = {dtype_code(np.asarray(make()).dtype) for make in ARRAYS.values()}
    declared = set(common_pb2.DataType.values()) - {common_pb2.DATA_TYPE_UNSPECIFIED}
    assert covered == declared


@pytest.mark.parametrize("make", ARRAYS.values(), ids=ARRAYS.keys())
def test_whole_tensor_round_trip(make):
    original = make()
    tensor = to_proto(original)
    # Through the wire form, not just the message object.
    decoded = common_pb2.Tensor.FromString(tensor.SerializeToString())
    assert list(decoded.shape) == list(np.shape(original))
    assert_same_tensor(from_proto(decoded), original)


def test_wire_bytes_are_little_endian_row_major():
    tensor = to_proto(np.array([[1, 2], [3, 4]], dtype=">i2").T)
    assert tensor.dtype == common_pb2.DATA_TYPE_INT16
    assert list(tensor.shape) == [2, 2]
    assert tensor.data == bytes([1, 0, 3, 0, 2, 0, 4, 0])


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
@pytest.mark.parametrize("make", ARRAYS.values(), ids=ARRAYS.keys())
def test_chunked_round_trip(make, chunk_bytes):
    original = make()
    header, chunks = split(NAME, original, chunk_bytes=chunk_bytes)
    chunks = [common_pb2.TensorChunk.FromString(c.SerializeToString()) for c in chunks]
    nbytes = np.asarray(original).nbytes
    assert header.name == NAME and header.total_bytes == nbytes
    assert list(header.shape) == list(np.shape(original))
    # At least one chunk, so an empty tensor still arrives; otherwise as few as the size allows.
    assert len(chunks) == max(1, math.ceil(nbytes / chunk_bytes))
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert [c.offset for c in chunks] == [i * chunk_bytes for i in range(len(chunks))]
    assert_same_tensor(reassemble(header, chunks), original)


def _wrapped(into, chunks, base_offset: int) -> list:
    """`split`'s chunks wrapped in stream messages by protobuf, placed `base_offset` further on."""
    return [into(chunk=common_pb2.TensorChunk(name=c.name, offset=c.offset + base_offset, data=c.data)) for c in chunks]


@pytest.mark.parametrize("chunk_bytes", [65_537, MIB])
def test_frames_carry_the_same_chunks_as_split_at_their_offsets(chunk_bytes):
    # Serialized by hand (split_frames): protobuf parses each frame to the message it would have
    # built around split's chunk; `base_offset` places a slab of rows in the larger tensor.
    from accelmesh.worker.v1 import worker_service_pb2 as worker_pb

    original = _rng().integers(0, 256, size=2 * MIB + 5, dtype=np.uint8)
    plain_header, plain = split(NAME, original, chunk_bytes=chunk_bytes)
    header, frames = split_frames(NAME, original, chunk_bytes, worker_pb.ExecuteRequest, base_offset=64)
    decoded = [worker_pb.ExecuteRequest.FromString(f) for f in frames]
    assert header == plain_header
    assert all(m.WhichOneof("part") == "chunk" for m in decoded)
    assert decoded == _wrapped(worker_pb.ExecuteRequest, plain, 64)


@pytest.mark.parametrize("base_offset", [0, 1, 2**40])
@pytest.mark.parametrize("make", ARRAYS.values(), ids=ARRAYS.keys())
def test_frames_are_the_wire_bytes_of_the_chunk_messages(make, base_offset):
    from accelmesh.dispatch.v1 import dispatch_service_pb2 as dispatch_pb

    original, name = make(), "tensor-\u00e9"  # a name beyond ASCII: its length is in bytes
    _, chunks = split(name, original, 5)
    _, frames = split_frames(name, original, 5, dispatch_pb.RunJobResponse, base_offset=base_offset)
    frames = list(frames)
    assert all(isinstance(f, bytes) for f in frames)
    assert [dispatch_pb.RunJobResponse.FromString(f) for f in frames] == _wrapped(
        dispatch_pb.RunJobResponse, chunks, base_offset)


def test_a_serializer_sends_frames_as_they_are_and_messages_through_protobuf():
    serialize = serialized_or(common_pb2.TensorChunk.SerializeToString)
    chunk = common_pb2.TensorChunk(name="a", offset=3, data=b"xyz")
    assert serialize(b"\x01\x02") == b"\x01\x02"
    assert serialize(chunk) == chunk.SerializeToString()


@pytest.mark.parametrize("extra_bytes", [0, 3])
def test_large_tensor_chunks_stay_under_the_message_limit(extra_bytes):
    original = _rng().integers(0, 256, size=5 * MIB + extra_bytes, dtype=np.uint8)
    header, chunks = split(NAME, original, chunk_bytes=MIB)
    chunks = list(chunks)
    assert len(chunks) == 5 + (extra_bytes > 0)
    assert max(c.ByteSize() for c in chunks) <= MIB + CHUNK_OVERHEAD_BYTES
    assert header.ByteSize() <= CHUNK_OVERHEAD_BYTES
    assert_same_tensor(reassemble(header, chunks), original)


def _chunks(array, chunk_bytes):
    header, chunks = split(NAME, array, chunk_bytes=chunk_bytes)
    return header, list(chunks)


def _data_length_mismatch():
    from_proto(common_pb2.Tensor(dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[2, 3], data=bytes(23)), FIELD)


def _unknown_dtype_code():
    from_proto(common_pb2.Tensor(dtype=99, shape=[1], data=bytes(4)), FIELD)


def _unspecified_dtype():
    from_proto(common_pb2.Tensor(shape=[1], data=bytes(4)), FIELD)


def _negative_dim():
    from_proto(common_pb2.Tensor(dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[-1, 2], data=b""), FIELD)


def _shape_overflowing_int64():
    # 2**64 elements: an int64 product wraps to 0 and would match empty data.
    from_proto(common_pb2.Tensor(dtype=common_pb2.DATA_TYPE_UINT8, shape=[2**32, 2**32], data=b""), FIELD)


def _header(**fields):
    values = {"name": NAME, "dtype": common_pb2.DATA_TYPE_FLOAT32, "shape": [2], "total_bytes": 8} | fields
    return common_pb2.TensorHeader(**values)


def _header_total_bytes_mismatch():
    TensorAssembler(_header(total_bytes=7))


def _header_unknown_dtype():
    TensorAssembler(_header(dtype=42))


def _shape_of_thousands_of_dimensions():
    # Their byte count has more digits than Python formats into a message.
    from_proto(common_pb2.Tensor(dtype=common_pb2.DATA_TYPE_UINT8, shape=[2**40] * 400, data=b"x"), FIELD)


def _header_of_thousands_of_dimensions():
    TensorAssembler(_header(dtype=common_pb2.DATA_TYPE_UINT8, shape=[2**40] * 400, total_bytes=1))


def _header_negative_dim():
    TensorAssembler(_header(shape=[2, -4], total_bytes=0))


def _header_shape_overflowing_int64():
    TensorAssembler(_header(dtype=common_pb2.DATA_TYPE_UINT8, shape=[2**32, 2**32], total_bytes=0))


def _chunk_out_of_order():
    header, chunks = _chunks(np.zeros(3, dtype=np.float32), 4)
    TensorAssembler(header).add(chunks[1])


def _chunk_repeated():
    header, chunks = _chunks(np.zeros(3, dtype=np.float32), 4)
    assembler = TensorAssembler(header)
    assembler.add(chunks[0])
    assembler.add(chunks[0])


def _more_bytes_than_declared():
    assembler = TensorAssembler(_header())
    assembler.add(common_pb2.TensorChunk(name=NAME, offset=0, data=bytes(12)))


def _chunk_for_another_tensor():
    TensorAssembler(_header()).add(common_pb2.TensorChunk(name="bias", offset=0, data=bytes(8)))


def _stream_ends_early():
    header, chunks = _chunks(np.zeros(3, dtype=np.float32), 4)
    assembler = TensorAssembler(header)
    assembler.add(chunks[0])
    assert not assembler.complete
    assembler.result()


def _unsupported_dtype_whole():
    to_proto(np.zeros(2, dtype=np.complex64), FIELD)


def _unsupported_dtype_chunked():
    split(NAME, np.zeros(2, dtype=np.complex64))


def _non_positive_chunk_size():
    split(NAME, np.zeros(2, dtype=np.float32), chunk_bytes=0)


@pytest.mark.parametrize(
    ("action", "fragments"),
    [
        pytest.param(_data_length_mismatch, [FIELD, "23 bytes", "24"], id="data-length-mismatch"),
        pytest.param(_unknown_dtype_code, [FIELD, "99", "DATA_TYPE_"], id="unknown-dtype-code"),
        pytest.param(_unspecified_dtype, [FIELD, "DATA_TYPE_"], id="unspecified-dtype"),
        pytest.param(_negative_dim, [FIELD, "[-1, 2]", "negative"], id="negative-dim"),
        pytest.param(_shape_overflowing_int64, [FIELD, "0 bytes"], id="shape-overflows-int64"),
        pytest.param(_shape_of_thousands_of_dimensions, [FIELD, "400 dimensions", "at most 32"], id="rank-400"),
        pytest.param(_header_of_thousands_of_dimensions, [NAME, "400 dimensions"], id="header-rank-400"),
        pytest.param(_header_total_bytes_mismatch, [NAME, "total_bytes 7", "8 bytes"], id="header-total-bytes"),
        pytest.param(_header_unknown_dtype, [NAME, "42"], id="header-unknown-dtype"),
        pytest.param(_header_negative_dim, [NAME, "negative"], id="header-negative-dim"),
        pytest.param(_header_shape_overflowing_int64, [NAME, "total_bytes 0"], id="header-shape-overflows"),
        pytest.param(_chunk_out_of_order, [NAME, "offset 4, expected 0", "in order"], id="chunk-out-of-order"),
        pytest.param(_chunk_repeated, [NAME, "offset 0, expected 4"], id="chunk-repeated"),
        pytest.param(_more_bytes_than_declared, [NAME, "more than the declared 8 bytes"], id="too-many-bytes"),
        pytest.param(_chunk_for_another_tensor, [NAME, "bias"], id="chunk-for-another-tensor"),
        pytest.param(_stream_ends_early, [NAME, "4 of 12 bytes"], id="stream-ends-early"),
        pytest.param(_unsupported_dtype_whole, [FIELD, "complex64", "float32"], id="complex64-whole"),
        pytest.param(_unsupported_dtype_chunked, [NAME, "complex64", "float32"], id="complex64-chunked"),
        pytest.param(_non_positive_chunk_size, ["chunk_bytes", "0"], id="chunk-bytes-zero"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_tensor(action, fragments):
    with pytest.raises(errors.InvalidArgument) as info:
        action()
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"{str(info.value)!r} lacks {missing}"


def test_a_collector_rebuilds_interleaved_tensors_in_header_order():
    a, b = np.arange(10, dtype=np.float32), np.arange(6, dtype=np.int32).reshape(2, 3)
    (ha, ca), (hb, cb) = split("a", a, 8), split("b", b, 8)
    collector = TensorCollector("output")
    collector.header(ha)
    collector.header(hb)
    chunks_a, chunks_b = list(ca), list(cb)
    for pair in zip(chunks_a, chunks_b):  # interleaved: each chunk names its tensor
        for chunk in pair:
            collector.chunk(chunk)
    for chunk in chunks_a[len(chunks_b):]:
        collector.chunk(chunk)
    results = collector.results()
    assert list(results) == ["a", "b"]
    np.testing.assert_array_equal(results["a"], a)
    np.testing.assert_array_equal(results["b"], b)
    with pytest.raises(errors.InvalidArgument, match="announced twice"):
        collector.header(ha)
    with pytest.raises(errors.InvalidArgument, match="before its header"):
        TensorCollector("output").chunk(chunks_a[0])


# -- memory: what arrived, never what was declared ---------------------------------------------------

GIB = 1024 * MIB
GROWTH_CHUNKS = 16


def _gib_header(name: str = NAME) -> common_pb2.TensorHeader:
    return common_pb2.TensorHeader(name=name, dtype=common_pb2.DATA_TYPE_UINT8, shape=[GIB], total_bytes=GIB)


def _traced(action) -> tuple[int, int]:
    """Bytes `action` allocated and kept, and its peak, as tracemalloc counts them (deterministic)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        kept_alive = action()  # noqa: F841 - held while the memory is read
        current, peak = tracemalloc.get_traced_memory()
        return current - before, peak - before
    finally:
        tracemalloc.stop()


def test_a_placed_tensor_goes_to_its_writer_as_it_arrives_and_the_others_are_kept():
    a, b = np.arange(1000, dtype=np.float32).reshape(250, 4), np.arange(10, dtype=np.int32)
    written, asked, sizes = bytearray(a.nbytes), [], []

    def place(index, dtype, shape):
        asked.append((index, dtype, shape))
        if index:
            return None

        def write(offset, data):
            sizes.append(len(data))
            written[offset:offset + len(data)] = data
        return write

    collector = TensorCollector("output", place)
    (ha, ca), (hb, cb) = split("a", a, 512), split("b", b, 8)
    collector.header(ha)
    collector.header(hb)
    for chunk in [*ca, *cb]:
        collector.chunk(chunk)
    results = collector.results()
    assert asked == [(0, np.dtype("<f4"), (250, 4)), (1, np.dtype("<i4"), (10,))]
    assert results["a"] == Placed("a", np.dtype("<f4"), (250, 4))  # nothing of it was kept
    assert bytes(written) == a.tobytes() and sizes == [512] * 7 + [a.nbytes - 7 * 512]
    np.testing.assert_array_equal(results["b"], b)


def test_a_placed_tensor_cut_short_is_refused_and_placing_comes_before_any_chunk():
    a = np.arange(64, dtype=np.float32)
    header, chunks = split("a", a, 64)
    collector = TensorCollector("output", lambda index, dtype, shape: lambda offset, data: None)
    collector.header(header)
    collector.chunk(next(chunks))
    with pytest.raises(errors.InvalidArgument, match=r"stream ended after 64 of 256 bytes"):
        collector.results()
    assembler = TensorAssembler(split("a", a, 64)[0])
    assembler.add(next(split("a", a, 64)[1]))
    with pytest.raises(ValueError, match="after chunks arrived"):
        assembler.write_through(lambda offset, data: None)


def test_a_header_declaring_a_gibibyte_allocates_nothing():
    collector = TensorCollector("output")

    def announce():
        collector.header(_gib_header("big"))
        return collector

    assembler_kept, _ = _traced(lambda: TensorAssembler(_gib_header()))
    collector_kept, _ = _traced(announce)
    assert assembler_kept < 64 * 1024 and collector_kept < 64 * 1024  # bookkeeping only, not a GiB
    assert TensorAssembler(_gib_header()).received_bytes == 0


def test_an_assembler_grows_with_the_chunks_that_arrive_and_at_most_doubles_them():
    assembler = TensorAssembler(_gib_header())

    def receive():  # each chunk a message of its own, as a stream delivers them
        for i in range(GROWTH_CHUNKS):
            assembler.add(common_pb2.TensorChunk(name=NAME, offset=i * MIB, data=bytes(MIB)))
        return assembler

    kept, peak = _traced(receive)
    received = GROWTH_CHUNKS * MIB
    assert assembler.received_bytes == received and not assembler.complete
    assert received <= kept <= received * 5 // 4, f"{kept} bytes held for {received} received"
    assert peak <= 2 * received + 2 * MIB, f"peak {peak} bytes while receiving {received}"  # + a chunk in flight
    with pytest.raises(errors.InvalidArgument, match=f"after {received} of {GIB} bytes"):
        assembler.result()


def test_a_complete_tensor_is_one_writable_buffer_made_once():
    original = np.arange(3 * MIB // 4, dtype=np.float32)
    header, chunks = split(NAME, original, chunk_bytes=MIB // 2)
    assembler = TensorAssembler(header)
    for chunk in chunks:
        assembler.add(chunk)
    first = assembler.result()
    kept, _ = _traced(assembler.result)
    assert kept < 64 * 1024, "result() copied the buffer"
    assert first.flags.writeable and np.shares_memory(first, assembler.result())
    np.testing.assert_array_equal(first, original)


def test_a_zero_byte_tensor_numpy_cannot_make_is_refused_as_invalid():
    """A fuzzing finding: [0, 2**62] float32 declares 0 bytes, but numpy refuses such an array."""
    header = common_pb2.TensorHeader(name="x", dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[0, 2**62], total_bytes=0)
    with pytest.raises(errors.InvalidArgument, match="too large"):
        TensorAssembler(header)
    with pytest.raises(errors.InvalidArgument, match="too large"):
        from_proto(common_pb2.Tensor(dtype=common_pb2.DATA_TYPE_FLOAT32, shape=[0, 2**62]))
