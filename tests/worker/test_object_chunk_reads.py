"""The streamed path's chunks copied as few times as may be: protobuf's Python messages (upb) copy
a bytes field at every read, so the worker's PutObjects (ObjectMethods.put into a store in a
test folder) reads a chunk's data once; the client's FetchObjects (ObjectClient._fetch_streamed,
from a call that answers frames made here) reads each chunk straight from its frame. Both place
every byte. No server, no network, nothing timed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from _object_helpers import NODE, TENANT, ticket

from accelmesh.object_client import STREAMED, ObjectClient
from accelmesh.runtime.tensors import split, split_frames
from accelmesh.security.config import INSECURE
from accelmesh.security.identity import Role
from accelmesh.security.tickets import GET, PUT, TicketVerifier
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc.object_methods import ObjectMethods
from worker_svc.objects import ObjectStore

from conftest import CREDENTIALS

CHUNK_BYTES = 4096
ROWS, WIDTH = 16, 256  # 16 KiB of float32: four chunks


class Counted:
    """A chunk message that counts the reads of its `data`; every other field as the message has it."""

    def __init__(self, chunk, reads: list[int]):
        self._chunk, self._reads = chunk, reads

    @property
    def data(self) -> bytes:
        self._reads.append(1)
        return self._chunk.data

    def __getattr__(self, name):
        return getattr(self._chunk, name)


class Message:
    """A stream message whose chunk, when it has one, is Counted."""

    def __init__(self, message, reads: list[int]):
        self._message, self._reads = message, reads

    @property
    def chunk(self) -> Counted:
        return Counted(self._message.chunk, self._reads)

    def __getattr__(self, name):
        return getattr(self._message, name)


def stream(into, head, object_id: str, array: np.ndarray, reads: list[int]) -> list[Message]:
    header, chunks = split(object_id, array, CHUNK_BYTES)
    return [Message(m, reads) for m in (head, into(object=header), *(into(chunk=c) for c in chunks))]


def test_the_worker_reads_each_put_chunks_data_once(tmp_path):
    array = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
    store = ObjectStore(1 << 20, root=str(tmp_path))
    methods = ObjectMethods(store, TicketVerifier(CREDENTIALS.service(Role.WORKER)), NODE, CHUNK_BYTES)
    reads: list[int] = []
    head = pb.PutObjectsRequest(ticket=ticket(PUT, "job-1", prefix="in/"))
    answer = methods.put(iter(stream(pb.PutObjectsRequest, head, "in/0/0", array, reads)))
    assert (answer.objects, answer.bytes) == (1, array.nbytes)
    assert len(reads) == array.nbytes // CHUNK_BYTES
    assert store.get(f"{TENANT}|job-1", "in/0/0").array().tobytes() == array.tobytes()
    store.close()


def test_the_client_places_each_fetched_chunk_read_straight_from_its_frame():
    """The client's fetch takes the worker's frames as bytes (runtime/chunk_frames.py): the data is
    copied once, from the frame into the job's output, and never parsed into a message."""
    array = np.random.default_rng(2).standard_normal((ROWS, WIDTH)).astype(np.float32)
    header, chunks = split_frames("out/3.1/0", array, CHUNK_BYTES, pb.FetchObjectsResponse)
    frames = [pb.FetchObjectsResponse(object=header).SerializeToString(), *chunks]
    objects = ObjectClient(INSECURE)
    objects._fetch_frames = lambda address: lambda request, timeout: iter(frames)
    out = np.zeros((2 * ROWS, WIDTH), np.float32)  # the job's rows; this shard is the second half
    shard = SimpleNamespace(first_row=ROWS, rows=ROWS)
    objects._fetch_streamed("10.0.0.2:1", ticket(GET, "job-1"), {"out/3.1/0": (shard, "y")},
                            lambda name, dtype, shape: out)
    assert out[ROWS:].tobytes() == array.tobytes() and not out[:ROWS].any()
    assert objects.moved_bytes[STREAMED] == array.nbytes and len(frames) == 1 + array.nbytes // CHUNK_BYTES
    objects.close()


def test_a_fetched_chunk_outside_its_object_is_refused_naming_it():
    array = np.ones((ROWS, WIDTH), np.float32)
    header, _ = split_frames("out/0.1/0", array, CHUNK_BYTES, pb.FetchObjectsResponse)
    _, beyond = split_frames("out/0.1/0", array, CHUNK_BYTES, pb.FetchObjectsResponse, base_offset=array.nbytes)
    frames = [pb.FetchObjectsResponse(object=header).SerializeToString(), next(beyond)]
    objects = ObjectClient(INSECURE)
    objects._fetch_frames = lambda address: lambda request, timeout: iter(frames)
    out = np.zeros((ROWS, WIDTH), np.float32)
    with pytest.raises(ValueError, match=r"'out/0.1/0' at offset 16384, outside its 16384"):
        objects._fetch_streamed("10.0.0.2:1", ticket(GET, "job-1"),
                                {"out/0.1/0": (SimpleNamespace(first_row=0, rows=ROWS), "y")},
                                lambda name, dtype, shape: out)
    objects.close()
