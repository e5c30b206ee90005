"""The client's side of the data plane (docs/data-plane.md): a DATA_PATH_DIRECT job's input rows put
straight into the object stores of the workers that run its shards, and its outputs fetched from
them, with the tickets the dispatcher gave for each worker.

On the worker's own host the bytes go through shared memory: MapObjects creates (or opens) each
object's segment file, this process maps it and copies the rows in (or out), and SealObjects makes
an input readable. Elsewhere, and wherever the worker refuses to share memory or its segments
cannot be opened here (another host, another user, a container without the worker's /dev/shm),
they stream over gRPC: PutObjects and FetchObjects, chunks framed from views of the arrays. Which
way a worker takes is learnt on the first call to it and kept for the client's life.

Every worker of a batch is served at once, on a thread each: a job's puts and fetches take as
long as the slowest worker's, not their sum. A job's put, run and fetch overlap: its inputs go in
groups, each said to be stored as soon as it is sealed (a shard runs once its own are), and its
outputs are fetched as its shards finish (RunJobResponse.outputs comes once for each batch of them).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.channels import ChannelPool
from accelmesh.runtime.chunk_frames import chunk_of
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES
from accelmesh.runtime.tensors import DEFAULT_CHUNK_BYTES, dtype_code, numpy_dtype, serialized_or, split_frames
from accelmesh.security.config import Security
from accelmesh.security.identity import Role
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc

SHARED, STREAMED = "shared memory", "gRPC stream"
_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
CALL_TIMEOUT_S = 600.0  # one put or fetch of a worker's share of a job
RELEASE_TIMEOUT_S = 10.0  # a ReleaseObjects call, and close's wait for those not answered yet
MAX_RELEASE_IDS = 4096  # object ids one ReleaseObjects names (a worker takes up to 65,536)
# A worker's shards are put and said to be stored in groups of about this many bytes: the first
# runs while the next are put, and a job of small shards still takes a call or two a worker. The
# first group is of FIRST_PUT_BYTES and each next one twice the last, up to PUT_GROUP_BYTES, so
# the worker starts soon (200 shards of 32 KiB waited 15 ms for all of them to be put first).
FIRST_PUT_BYTES = 256 * 1024
PUT_GROUP_BYTES = 8 * 1024 * 1024
# A job's inputs put ahead of its finished shards, at most: the worker has that much to run while
# the rest waits in the client (and a store smaller than the job can take it).
PUT_AHEAD_BYTES = 256 * 1024 * 1024
FETCH_THREADS = 4  # a job's fetches going at once, each of a worker's shards that finished together


class ObjectClient:
    def __init__(self, security: Security, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, tracer_provider=None):
        self._channels = ChannelPool(security, Role.WORKER, tracer_provider=tracer_provider,
                                     max_message_bytes=max_message_bytes)
        self._chunk_bytes = min(chunk_bytes, max_message_bytes // 2)
        self._ways: dict[str, str] = {}  # worker address -> SHARED or STREAMED
        self._lock = threading.Lock()
        self._releasing: list[grpc.Future] = []  # ReleaseObjects calls not answered yet
        self.moved_bytes = {SHARED: 0, STREAMED: 0}  # what went each way, for a person to read

    def close(self) -> None:
        with self._lock:
            releasing, self._releasing = self._releasing, []
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        for future in releasing:  # closing the channels would cancel them
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # best effort, as release says
        self._channels.close()

    def way(self, address: str) -> str | None:
        with self._lock:
            return self._ways.get(address)

    def _stub(self, address: str) -> worker_service_pb2_grpc.WorkerServiceStub:
        return worker_service_pb2_grpc.WorkerServiceStub(self._channels.get(address))

    def _learnt(self, address: str, way: str, nbytes: int) -> None:
        with self._lock:
            self._ways[address] = way
            self.moved_bytes[way] += nbytes

    # --- putting ---------------------------------------------------------------------------

    def put(self, shards: Sequence, inputs: Sequence[np.ndarray],
            stored: Callable[[list[int]], None] | None = None, window: PutWindow | None = None) -> None:
        """Each shard's rows of `inputs` (the job's data inputs, in spec order) into the store of
        the worker its ShardObjects names, under its object ids. A worker's shards go in row order,
        in groups of about PUT_GROUP_BYTES, and `stored(indexes)` hears each group as it is sealed
        (from the worker's thread), so a shard can run while the next ones are still being put;
        each group waits for room in `window` first."""
        work = [(address, ticket, group, inputs, stored, window)
                for (address, ticket), group in _by_worker(shards).items()]
        _each(work, lambda item: self._put_groups(*item))

    def _put_groups(self, address: str, ticket: bytes, shards: list, inputs: Sequence[np.ndarray],
                    stored: Callable[[list[int]], None] | None, window: PutWindow | None) -> None:
        row_bytes = sum(array[:1].nbytes for array in inputs)
        for group in _groups(sorted(shards, key=lambda s: s.first_row), row_bytes):
            if window is not None:
                window.take({s.shard_index: s.rows * row_bytes for s in group})
            self._put_one(address, ticket, [(object_id, np.ascontiguousarray(array[s.first_row: s.first_row + s.rows]))
                                            for s in group for object_id, array in zip(s.object_ids, inputs)])
            if stored is not None:
                stored([s.shard_index for s in group])

    def _put_one(self, address: str, ticket: bytes, objects: list[tuple[str, np.ndarray]]) -> None:
        nbytes = sum(a.nbytes for _, a in objects)
        if self.way(address) != STREAMED and self._put_shared(address, ticket, objects):
            self._learnt(address, SHARED, nbytes)
            return
        channel = self._channels.get(address)
        call = channel.stream_unary(f"/{_SERVICE}/PutObjects",
                                    request_serializer=serialized_or(pb.PutObjectsRequest.SerializeToString),
                                    response_deserializer=pb.PutObjectsResponse.FromString)
        call(self._put_messages(ticket, objects), timeout=CALL_TIMEOUT_S)
        self._learnt(address, STREAMED, nbytes)

    def _put_messages(self, ticket: bytes, objects: list[tuple[str, np.ndarray]]):
        yield pb.PutObjectsRequest(ticket=ticket)
        for object_id, array in objects:
            header, chunks = split_frames(object_id, array, self._chunk_bytes, pb.PutObjectsRequest)
            yield pb.PutObjectsRequest(object=header)
            if array.nbytes:
                yield from chunks

    def _put_shared(self, address: str, ticket: bytes, objects: list[tuple[str, np.ndarray]]) -> bool:
        """Put through shared memory; False when the worker or this host will not (then stream)."""
        stub = self._stub(address)
        headers = [common_pb2.TensorHeader(name=object_id, dtype=dtype_code(a.dtype), shape=a.shape,
                                           total_bytes=a.nbytes) for object_id, a in objects]
        try:
            segments = stub.MapObjects(pb.MapObjectsRequest(ticket=ticket, create=headers),
                                       timeout=CALL_TIMEOUT_S).segments
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self.way(address) is None:
                return False  # another host: the worker shares memory with its own host alone
            raise
        try:
            for segment, (_, array) in zip(segments, objects):
                _copy_into(segment, array)
        except OSError:
            if self.way(address) is not None:
                raise
            # First contact, and its segments cannot be opened from here: what was made goes (nothing
            # else of this client's is there yet), and this worker is streamed to from now on.
            stub.ReleaseObjects(pb.ReleaseObjectsRequest(ticket=ticket), timeout=CALL_TIMEOUT_S)
            return False
        stub.SealObjects(pb.SealObjectsRequest(ticket=ticket, object_ids=[o for o, _ in objects]),
                         timeout=CALL_TIMEOUT_S)
        return True

    # --- fetching --------------------------------------------------------------------------

    def fetches(self, total_rows: int) -> Fetches:
        """Fetches of a job's outputs begun as its shards finish (`add`), gathered at its end."""
        return Fetches(self, total_rows)

    def _fetch_one(self, address: str, ticket: bytes, shards: list, target) -> None:
        places = {object_id: (shard, name) for shard in shards
                  for object_id, name in zip(shard.object_ids, shard.names)}
        if self.way(address) != STREAMED:
            try:
                segments = self._stub(address).MapObjects(pb.MapObjectsRequest(ticket=ticket, open=list(places)),
                                                          timeout=CALL_TIMEOUT_S).segments
                nbytes = 0
                for segment in segments:
                    shard, name = places[segment.object_id]
                    dtype, shape = numpy_dtype(segment.header.dtype), tuple(segment.header.shape)
                    out = target(name, dtype, shape)
                    _copy_from(segment, out[shard.first_row: shard.first_row + shard.rows], dtype, shape)
                    nbytes += segment.bytes
                self._learnt(address, SHARED, nbytes)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or self.way(address) is not None:
                    raise
            except OSError:
                if self.way(address) is not None:
                    raise
        self._fetch_streamed(address, ticket, places, target)

    def _fetch_frames(self, address: str):
        """The worker's FetchObjects, answering each message's bytes as they came (chunk_frames)."""
        return self._channels.get(address).unary_stream(
            f"/{_SERVICE}/FetchObjects", request_serializer=pb.FetchObjectsRequest.SerializeToString,
            response_deserializer=None)

    def _fetch_streamed(self, address: str, ticket: bytes, places: Mapping, target) -> None:
        nbytes, current, view = 0, None, None
        for frame in self._fetch_frames(address)(pb.FetchObjectsRequest(ticket=ticket, object_ids=list(places)),
                                                  timeout=CALL_TIMEOUT_S):
            chunk = chunk_of(frame, pb.FetchObjectsResponse)  # its data a view of the frame: copied once, below
            if chunk is None:
                header = pb.FetchObjectsResponse.FromString(frame).object
                shard, name = places[header.name]
                dtype, shape = numpy_dtype(header.dtype), tuple(header.shape)
                out = target(name, dtype, shape)
                rows = out[shard.first_row: shard.first_row + shard.rows]
                if rows.shape != shape:
                    raise ValueError(f"worker {address} sent {header.name} of shape {shape}, not {rows.shape}")
                current, view = header.name, memoryview(rows.reshape(-1).view(np.uint8))
                continue
            if chunk.name != current:
                raise ValueError(f"worker {address} sent a chunk of {chunk.name!r} inside {current!r}")
            if chunk.offset < 0 or chunk.offset + len(chunk.data) > len(view):
                raise ValueError(f"worker {address} sent {len(chunk.data)} bytes of {current!r} at offset "
                                 f"{chunk.offset}, outside its {len(view)}")
            view[chunk.offset: chunk.offset + len(chunk.data)] = chunk.data
            nbytes += len(chunk.data)
        self._learnt(address, STREAMED, nbytes)

    def release(self, shards: Iterable, named: bool = False) -> None:
        """Free the shards' objects in the workers' stores (`named`: those alone; else all that their
        tickets cover), without waiting for the answers (best effort: the stores' idle expiry frees
        the rest); `close` waits for any still on their way."""
        with self._lock:
            self._releasing = [f for f in self._releasing if not f.done()]
            for (address, ticket), group in _by_worker(shards).items():
                ids = [object_id for shard in group for object_id in shard.object_ids] if named else []
                for start in range(0, max(1, len(ids)), MAX_RELEASE_IDS):
                    self._releasing.append(self._stub(address).ReleaseObjects.future(pb.ReleaseObjectsRequest(
                        ticket=ticket, object_ids=ids[start: start + MAX_RELEASE_IDS]), timeout=RELEASE_TIMEOUT_S))


class PutWindow:
    """A job's input bytes put and not yet said finished, at most `limit` (PUT_AHEAD_BYTES): the
    puts run ahead of the shards by that much and no more, so a worker's store holds that much of
    the job's inputs, not all of them (the dispatcher frees a shard's inputs once it finished). A
    group larger than the window alone still goes, once nothing else is ahead; `close` lets every
    waiting put go (the job ended)."""

    def __init__(self, limit: int):
        self._limit, self._ahead = limit, 0
        self._taken: dict[int, int] = {}  # shard index -> bytes put for it and not yet given back
        self._changed = threading.Condition()
        self._closed = False
        self.waiting = 0  # puts waiting for room now

    def take(self, shards: Mapping[int, int]) -> None:
        """Wait for room for these shards' bytes (index -> bytes), then count them as ahead."""
        nbytes = sum(shards.values())
        with self._changed:
            while self._ahead and self._ahead + nbytes > self._limit and not self._closed:
                self.waiting += 1
                self._changed.notify_all()  # whoever watches `waiting`
                self._changed.wait()
                self.waiting -= 1
            self._ahead += nbytes
            for index, count in shards.items():
                self._taken[index] = self._taken.get(index, 0) + count

    def finished(self, indexes: Iterable[int]) -> None:
        """These shards finished: what was put for them (anywhere) is no longer ahead."""
        with self._changed:
            for index in indexes:
                self._ahead -= self._taken.pop(index, 0)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _each(items: list, run: Callable) -> None:
    """`run` on every item, at once on a thread each when there are several; the first error raised."""
    if len(items) <= 1:
        for item in items:
            run(item)
        return
    with ThreadPoolExecutor(max_workers=min(len(items), 16), thread_name_prefix="objects") as pool:
        for future in [pool.submit(run, item) for item in items]:
            future.result()


def _by_worker(shards: Iterable) -> dict[tuple[str, bytes], list]:
    """Shards by the (worker address, ticket) their objects are put or fetched with."""
    by_worker: dict[tuple[str, bytes], list] = {}
    for shard in shards:
        by_worker.setdefault((shard.worker_address, shard.ticket), []).append(shard)
    return by_worker


def _groups(shards: list, row_bytes: int) -> Iterator[list]:
    """Consecutive shards in groups of at least FIRST_PUT_BYTES, then twice that each, up to
    PUT_GROUP_BYTES (or what is left), of `row_bytes` a row."""
    group, nbytes, limit = [], 0, min(FIRST_PUT_BYTES, PUT_GROUP_BYTES)
    for shard in shards:
        group.append(shard)
        nbytes += shard.rows * row_bytes
        if nbytes >= limit:
            yield group
            group, nbytes, limit = [], 0, min(2 * limit, PUT_GROUP_BYTES)
    if group:
        yield group


class Fetches:
    """A job's output fetches, each begun at once on a thread of its own (at most FETCH_THREADS),
    copying into one array of the job's rows per output name, each batch freed in its store once
    fetched. `results` waits for them all and raises the first error; `close` waits for any still
    going, ignoring their errors (the job failed, say, and its objects went), then frees the
    objects of those that did not end so."""

    def __init__(self, client: ObjectClient, total_rows: int):
        self._client, self._rows = client, total_rows
        self._results: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="fetch")
        self._futures: list = []
        self.placed: list = []
        self._freed: list = []  # shards whose objects were fetched and freed

    def _target(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        with self._lock:
            if name not in self._results:
                self._results[name] = np.empty((self._rows, *shape[1:]), dtype)
            return self._results[name]

    def add(self, shards: Sequence) -> None:
        with self._lock:
            self.placed.extend(shards)
            self._futures.extend(self._pool.submit(self._fetch_and_free, address, ticket, group)
                                 for (address, ticket), group in _by_worker(shards).items())

    def _fetch_and_free(self, address: str, ticket: bytes, group: list) -> None:
        """One batch fetched, then freed in the store at once: a job's outputs do not wait there
        for its end, so the store holds the outputs not fetched yet, not all of them."""
        self._client._fetch_one(address, ticket, group, self._target)
        self._client.release(group, named=True)
        with self._lock:
            self._freed.extend(group)

    def results(self) -> dict[str, np.ndarray]:
        for future in list(self._futures):
            future.result()
        return self._results

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        freed = {id(shard) for shard in self._freed}
        left = [shard for shard in self.placed if id(shard) not in freed]  # a fetch failed, or never ran
        if left:
            self._client.release(left)


def _mapped(path: str, nbytes: int, writable: bool) -> mmap.mmap:
    """The segment mapped with MAP_POPULATE (where there is one): its pages mapped in one go, not
    a fault per 4 KiB page as the copy first touches each (a third of the copy's time here)."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)


def _copy_into(segment: pb.ObjectSegment, array: np.ndarray) -> None:
    if not segment.bytes:
        return
    mapped = _mapped(segment.path, segment.bytes, True)
    try:
        np.frombuffer(mapped, np.uint8, segment.bytes)[:] = array.reshape(-1).view(np.uint8)
    finally:
        mapped.close()


def _copy_from(segment: pb.ObjectSegment, out: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"object {segment.object_id} is {dtype}{list(shape)}, not {out.dtype}{list(out.shape)}")
    if not segment.bytes:
        return
    mapped = _mapped(segment.path, segment.bytes, False)
    try:
        out[...] = np.frombuffer(mapped, dtype, int(np.prod(shape, dtype=np.int64))).reshape(shape)
    finally:
        mapped.close()
