"""runtime/chunk_frames.py: a stream message's chunk read from its wire bytes equals what protobuf
parses, whatever valid encoding the sender chose; another part is left to protobuf; bytes that are
not a message are refused with ValueError, never a crash or a wrong chunk."""

from __future__ import annotations

import numpy as np
import pytest

from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.chunk_frames import chunk_of
from accelmesh.runtime.tensors import split, split_frames
from accelmesh.worker.v1 import worker_service_pb2 as pb

ARRAY = np.arange(3000, dtype=np.float32)


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload  # small fields: one-byte tag and length


def _as_parsed(frame: bytes):
    return pb.FetchObjectsResponse.FromString(frame).chunk


def test_every_frame_split_frames_makes_reads_as_protobuf_parses_it():
    _, frames = split_frames("out/1.1/0", ARRAY, 4096, pb.FetchObjectsResponse, base_offset=64)
    for frame in frames:
        chunk, parsed = chunk_of(frame, pb.FetchObjectsResponse), _as_parsed(frame)
        assert (chunk.name, chunk.offset, bytes(chunk.data)) == (parsed.name, parsed.offset, parsed.data)


def test_fields_in_another_order_and_unknown_fields_read_the_same():
    inner = (_field(3, b"\x01\x02\x03") + bytes([2 << 3, 0x96, 0x01])  # data, then offset 150
             + bytes([9 << 3 | 5]) + b"\0\0\0\0"  # an unknown fixed32 field
             + _field(1, b"x"))
    frame = _field(2, inner)
    chunk = chunk_of(frame, pb.FetchObjectsResponse)
    assert (chunk.name, chunk.offset, bytes(chunk.data)) == ("x", 150, b"\x01\x02\x03") == (
        _as_parsed(frame).name, _as_parsed(frame).offset, _as_parsed(frame).data)


def test_another_part_is_left_to_protobuf_and_the_last_member_of_the_oneof_wins():
    header = pb.FetchObjectsResponse(object=split("out/1.1/0", ARRAY, 4096)[0]).SerializeToString()
    chunk = pb.FetchObjectsResponse(chunk=common_pb2.TensorChunk(name="a", data=b"z")).SerializeToString()
    assert chunk_of(header, pb.FetchObjectsResponse) is None
    assert chunk_of(b"", pb.FetchObjectsResponse) is None
    assert chunk_of(chunk + header, pb.FetchObjectsResponse) is None  # protobuf keeps the header
    assert chunk_of(header + chunk, pb.FetchObjectsResponse).name == "a"


@pytest.mark.parametrize("frame, match", [
    (bytes([2 << 3 | 2, 50]) + b"short", "past the end"),
    (bytes([2 << 3 | 2, 0x80]), "ends inside a varint"),
    (bytes([0x80] * 11), "longer than 10 bytes"),
    (bytes([2 << 3 | 3]), "wire type 3"),
    (bytes([0]), "field number 0"),
    (bytes([2 << 3 | 0, 1]), "not length-delimited"),
    (_field(2, _field(1, b"\xff")), "not UTF-8"),
], ids=["a length past the end", "a cut varint", "an endless varint", "a group", "field 0", "a varint chunk",
        "a name not UTF-8"])
def test_bytes_that_are_not_a_message_are_refused(frame, match):
    with pytest.raises(ValueError, match=match):
        chunk_of(frame, pb.FetchObjectsResponse)
