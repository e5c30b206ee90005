"""Several parts of a stream in one message, and back (ExecuteMany's `batch` part).

Python gRPC's cost is per message more than per byte: a bare two-hop relay carries a 32 KiB shard
sent as one message for about half what it costs as three (bench/dispatch.py,
`pipelined_relay_floor`). A stream whose message has a `batch` part (a message with one field,
`repeated <the stream's message> parts`) can carry a small shard's header, tensor headers and
chunks as one message; the reader takes the parts out in order, as if each had come on its own.

`batched` writes the batch by hand from each part's serialized bytes (a chunk from
`tensors.split_frames` is already serialized), so a part is copied once into its batch and a
part too large to share a message is sent as it is, not copied at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from google.protobuf.message import Message

from accelmesh import errors
from accelmesh.runtime.tensors import _length_delimited, _varint

FLUSH = object()  # among `batched`'s parts: send what is gathered now (the source is about to wait)


def batched(parts: Iterable[Message | bytes | object], into: type[Message], limit: int) -> Iterator[Message | bytes]:
    """`parts` (messages of type `into`, or their serialized bytes) as messages of at most about
    `limit` bytes: consecutive parts that fit together go as one `into(batch=...)`, serialized; a
    part alone goes as it came. Lazy: a part is serialized when the previous group is sent. A
    source that may wait between parts puts FLUSH before it waits, so nothing gathered waits too."""
    batch_field = into.DESCRIPTOR.fields_by_name["batch"]
    outer = _length_delimited(batch_field.number)
    inner = _length_delimited(batch_field.message_type.fields_by_name["parts"].number)
    group: list[tuple[Message | bytes, bytes]] = []
    size = 0

    def sent() -> Message | bytes:
        if len(group) == 1:
            return group[0][0]
        body = b"".join(b"".join((inner, _varint(len(data)), data)) for _, data in group)
        return b"".join((outer, _varint(len(body)), body))

    for part in parts:
        if part is FLUSH:
            if group:
                yield sent()
                group, size = [], 0
            continue
        data = part if isinstance(part, bytes) else part.SerializeToString()
        framed = len(data) + 2 * len(inner) + 10  # its tag and length within the batch, generously
        if group and size + framed > limit:
            yield sent()
            group, size = [], 0
        group.append((part, data))
        size += framed
    if group:
        yield sent()


def unbatched(messages: Iterable[Message]) -> Unbatched:
    """Every part of `messages` in order: a batch's parts one by one, any other message as it is.
    InvalidArgument for a batch inside a batch."""
    return Unbatched(messages)


class Unbatched:
    """`unbatched`'s iterator; `buffered` says how many parts of the batch being read are still
    to come, already received: a reader may hold its answers while it has more to read at once."""

    def __init__(self, messages: Iterable[Message]):
        self._messages = iter(messages)
        self._parts: deque[tuple[int, Message]] = deque()

    def __iter__(self) -> Unbatched:
        return self

    def __next__(self) -> Message:
        while not self._parts:
            message = next(self._messages)
            if message.WhichOneof("part") != "batch":
                return message
            self._parts.extend(enumerate(message.batch.parts))
        index, part = self._parts.popleft()
        if part.WhichOneof("part") == "batch":
            self._parts.clear()
            raise errors.InvalidArgument(f"batch.parts[{index}] is a batch itself; batches do not nest: "
                                         "send its parts in the outer batch")
        return part

    @property
    def buffered(self) -> int:
        return len(self._parts)
