"""A stream message's chunk read straight from its wire bytes (the reverse of
`tensors.split_frames`): its name, offset and a view of its data, with no copy of the data.

protobuf's Python messages copy a bytes field when a message is parsed and again when the field
is read, so a 1 MiB chunk parsed as a message and copied into its tensor was three copies of it;
read here, it is one (into the tensor). Any valid encoding of the message is read (fields in any
order, unknown ones skipped, the last of the oneof's members winning, as protobuf has it); a
message whose part is not the chunk is left to protobuf (`chunk_of` answers None), and bytes that
are not a valid message raise ValueError.
"""

from __future__ import annotations

from typing import NamedTuple

from accelmesh.common.v1 import common_pb2

_CHUNK = common_pb2.TensorChunk.DESCRIPTOR.fields_by_name
_NAME, _OFFSET, _DATA = _CHUNK["name"].number, _CHUNK["offset"].number, _CHUNK["data"].number
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class Chunk(NamedTuple):
    name: str
    offset: int
    data: memoryview  # a view of the frame's bytes: valid while the frame is


def chunk_of(frame: bytes, into) -> Chunk | None:
    """The chunk of `frame`, a serialized message of type `into` (a stream message whose oneof has
    a `chunk` field); None when its part is another field of that oneof, or none."""
    view = memoryview(frame)
    field = into.DESCRIPTOR.fields_by_name["chunk"]
    oneof = {f.number for f in field.containing_oneof.fields}
    last = body = None
    for number, wire, start, end in _fields(view):
        if number in oneof:
            last = number
            body = (start, end) if number == field.number and wire == _LENGTH else None
    if last != field.number:
        return None
    if body is None:
        raise ValueError("the chunk field is not length-delimited")
    name, offset, data = "", 0, view[0:0]
    inner = view[body[0]:body[1]]
    for number, wire, start, end in _fields(inner):
        if number == _NAME and wire == _LENGTH:
            try:
                name = str(inner[start:end], "utf-8")
            except UnicodeDecodeError:
                raise ValueError("the chunk's name is not UTF-8") from None
        elif number == _OFFSET and wire == _VARINT:
            offset = _varint(inner, start)[0]
            if offset >= 1 << 63:
                offset -= 1 << 64  # an int64 sent negative: the caller refuses it
        elif number == _DATA and wire == _LENGTH:
            data = inner[start:end]
    return Chunk(name, offset, data)


def _fields(view: memoryview):
    """(field number, wire type, start, end) of each field of a message's bytes; for a varint the
    span is the varint's own, for a length-delimited field its payload's."""
    position = 0
    while position < len(view):
        key, position = _varint(view, position)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == _VARINT:
            start = position
            _, position = _varint(view, position)
        elif wire == _LENGTH:
            size, start = _varint(view, position)
            position = start + size
        elif wire in (_FIXED64, _FIXED32):
            start, position = position, position + (8 if wire == _FIXED64 else 4)
        else:
            raise ValueError(f"wire type {wire} of field {number} is not one a message of these fields has")
        if position > len(view):
            raise ValueError(f"field {number} runs past the end of the message")
        yield number, wire, start, position


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while position < len(view):
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift >= 70:
            raise ValueError("a varint longer than 10 bytes")
    raise ValueError("the message ends inside a varint")
