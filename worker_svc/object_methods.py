"""WorkerService's object-store methods (PutObjects, FetchObjects, MapObjects, SealObjects,
ReleaseObjects): tickets checked, requests turned into ObjectStore calls (objects.py).

Every call carries a ticket the job's dispatcher signed (accelmesh/security/tickets.py); it, not
the caller's role, says whose job's objects the call may touch, in which direction and which ids.
The store's scope is the ticket's (owner and job), so a ticket for one tenant's job never reaches
another's objects. Shared memory (MapObjects) is offered only to a caller on this node: its
connection comes from a loopback address or from this node's own address, over the mesh's mutual
TLS, and the segment files are this worker's user's alone (mode 0600), so the caller must also
run as that user on this host to open them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator

import numpy as np

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.tensors import dtype_code, numpy_dtype, split_frames
from accelmesh.security.tickets import GET, PUT, Ticket, TicketVerifier
from accelmesh.worker.v1 import worker_service_pb2 as pb
from worker_svc.objects import ObjectStore, StoredObject

MAX_OBJECTS_PER_CALL = 65536  # ids one FetchObjects, MapObjects or SealObjects names (each costs memory)


class ObjectMethods:
    def __init__(self, store: ObjectStore, verifier: TicketVerifier, node_ip: str, chunk_bytes: int):
        self.store, self._verifier, self._node, self._chunk_bytes = store, verifier, node_ip, chunk_bytes

    def _ticket(self, token: bytes, direction: str | None, object_ids: Iterable[str] = ()) -> Ticket:
        if not token:
            raise errors.Unauthenticated("ticket is required: pass the ticket the job's dispatcher gave for these "
                                         "objects (RunJobResponse.put_inputs or .outputs)", field="ticket")
        return self._verifier.verify(token, direction=direction, node=self._node, object_ids=list(object_ids))

    def put(self, requests: Iterator[pb.PutObjectsRequest]) -> pb.PutObjectsResponse:
        first = next(requests, None)
        if first is None or first.WhichOneof("part") != "ticket":
            raise errors.InvalidArgument("the first message of PutObjects must carry the ticket", field="ticket")
        ticket = self._ticket(first.ticket, PUT)
        count = total = 0
        current: StoredObject | None = None
        written = 0
        try:
            for message in requests:
                part = message.WhichOneof("part")
                if part == "object":
                    _check_whole(current, written)
                    self._ticket(first.ticket, PUT, [message.object.name])
                    current, written = self._create(ticket, message.object, "object"), 0
                    if current.nbytes == 0:
                        self.store.seal(ticket.scope, current.object_id)
                        count, current = count + 1, None
                elif part == "chunk" and current is not None:
                    chunk = message.chunk
                    if chunk.offset != written:
                        raise errors.InvalidArgument(
                            f"chunk of {errors.quoted(current.object_id)} at offset {chunk.offset}, but "
                            f"{written} bytes of it came so far: send each object's chunks in order",
                            field="chunk.offset")
                    data = chunk.data  # each read of a bytes field copies it (upb): once a chunk
                    current.write(chunk.offset, data)
                    written += len(data)
                    if written == current.nbytes:
                        self.store.seal(ticket.scope, current.object_id)
                        count, total, current = count + 1, total + written, None
                else:
                    raise errors.InvalidArgument(
                        f"unexpected {part or 'empty message'} in PutObjects: after the ticket, send each "
                        "object's header, then its chunks", field=part or "part")
            _check_whole(current, written)
        except BaseException:
            if current is not None:  # half written: never readable, and its room goes back now
                self.store.discard(ticket.scope, current.object_id)
            raise
        return pb.PutObjectsResponse(objects=count, bytes=total)

    def _create(self, ticket: Ticket, header: common_pb2.TensorHeader, field: str) -> StoredObject:
        dtype = numpy_dtype(header.dtype, f"{field}.dtype")
        shape = tuple(header.shape)
        if any(d < 0 for d in shape):
            raise errors.InvalidArgument(f"{field}.shape {errors.quoted(list(shape))} has a negative dimension",
                                         field=f"{field}.shape")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if header.total_bytes != nbytes:
            raise errors.InvalidArgument(
                f"{field}.total_bytes is {header.total_bytes} but dtype {dtype} and shape "
                f"{errors.quoted(list(shape))} take {nbytes}", field=f"{field}.total_bytes")
        return self.store.create(ticket.scope, header.name, dtype, shape)

    def fetch(self, request: pb.FetchObjectsRequest) -> Iterator:
        ids = _ids(request.object_ids, "object_ids")
        ticket = self._ticket(request.ticket, GET, ids)
        found = [self.store.get(ticket.scope, object_id) for object_id in ids]  # all there, or nothing sent
        for stored in found:
            header, chunks = split_frames(stored.object_id, stored.array(), self._chunk_bytes,
                                          pb.FetchObjectsResponse)
            yield pb.FetchObjectsResponse(object=header)
            yield from chunks

    def map(self, request: pb.MapObjectsRequest, peer: str) -> pb.MapObjectsResponse:
        if not self._local(peer):
            raise errors.FailedPrecondition(
                f"MapObjects shares memory with callers on this node only, and this call came from {peer}: "
                "use PutObjects and FetchObjects from another host")
        if request.create and request.open:
            raise errors.InvalidArgument("MapObjects either creates objects (put ticket) or opens them (get ticket), "
                                         "not both in one call", field="open")
        response = pb.MapObjectsResponse()
        if request.create:
            ticket = self._ticket(request.ticket, PUT, _ids([h.name for h in request.create], "create"))
            made: list[StoredObject] = []
            try:
                for index, header in enumerate(request.create):
                    made.append(self._create(ticket, header, f"create[{index}]"))
            except BaseException:
                for stored in made:
                    self.store.discard(ticket.scope, stored.object_id)
                raise
            response.segments.extend(_segment(s) for s in made)
            return response
        ids = _ids(request.open, "open")
        ticket = self._ticket(request.ticket, GET, ids)
        response.segments.extend(_segment(self.store.get(ticket.scope, object_id)) for object_id in ids)
        return response

    def seal(self, request: pb.SealObjectsRequest) -> pb.SealObjectsResponse:
        ids = _ids(request.object_ids, "object_ids")
        ticket = self._ticket(request.ticket, PUT, ids)
        for object_id in ids:
            self.store.seal(ticket.scope, object_id)
        return pb.SealObjectsResponse(sealed=len(ids))

    def release(self, request: pb.ReleaseObjectsRequest) -> pb.ReleaseObjectsResponse:
        ids = list(request.object_ids)
        if len(ids) > MAX_OBJECTS_PER_CALL:
            raise errors.InvalidArgument(f"object_ids names {len(ids)} objects, more than {MAX_OBJECTS_PER_CALL}: "
                                         "release them in several calls", field="object_ids")
        # A put ticket frees the job's inputs here, a get ticket its outputs: those it covers, or those named.
        ticket = self._ticket(request.ticket, None, ids)
        count, nbytes = (self.store.release_ids(ticket.scope, ids) if ids
                         else self.store.release(ticket.scope, ticket.prefix))
        return pb.ReleaseObjectsResponse(released_objects=count, released_bytes=nbytes)

    def _local(self, peer: str) -> bool:
        """Whether a call's peer ("ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:...") is on this node."""
        kind, _, rest = peer.partition(":")
        if kind == "unix":
            return True
        if kind not in ("ipv4", "ipv6"):
            return False
        host = rest.rsplit(":", 1)[0].strip("[]")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return address.is_loopback or host == self._node


def _check_whole(current: StoredObject | None, written: int) -> None:
    if current is not None:
        raise errors.InvalidArgument(
            f"object {errors.quoted(current.object_id)} ended after {written} of its {current.nbytes} bytes: send "
            "all of an object's chunks before the next header or the end of the stream", field="chunk")


def _ids(values, field: str) -> list[str]:
    ids = list(values)
    if not ids:
        raise errors.InvalidArgument(f"{field} is empty: name at least one object", field=field)
    if len(ids) > MAX_OBJECTS_PER_CALL:
        raise errors.InvalidArgument(f"{field} names {len(ids)} objects, more than the {MAX_OBJECTS_PER_CALL} one "
                                     "call may: split them over several calls", field=field)
    return ids


def _segment(stored: StoredObject) -> pb.ObjectSegment:
    header = common_pb2.TensorHeader(name=stored.object_id, dtype=dtype_code(stored.dtype), shape=stored.shape,
                                     total_bytes=stored.nbytes)
    return pb.ObjectSegment(object_id=stored.object_id, path=stored.path, bytes=stored.nbytes, header=header)
