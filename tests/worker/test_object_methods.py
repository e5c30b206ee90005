"""WorkerService's object-store methods (PutObjects, FetchObjects, MapObjects, SealObjects,
ReleaseObjects) through real gRPC over mutual TLS, against an in-process worker whose store lives in
a test folder: objects round trip bit for bit whatever the caller's certificate, since the
dispatcher-signed ticket authorises; same-host callers write and read through the segment files;
every refusal has its status code and google.rpc details; the store's byte bound refuses a put
until a release frees room; ExecuteMany runs a shard on stored inputs and keeps its outputs in the
store. ObjectMethods._local (who counts as on this node) is a unit table."""

from __future__ import annotations

import mmap
import os
import stat

import grpc
import numpy as np
import pytest
from _execute_helpers import Model, compile_for, compile_service_fixture, header  # noqa: F401  (fixture)
from _object_helpers import (
    CALL_TIMEOUT_S,
    TENANT,
    details,
    fetched,
    forged_ticket,
    object_worker,
    put_messages,
    stub_for,
    ticket,
)

from accelmesh import errors
from accelmesh.common.v1 import common_pb2
from accelmesh.runtime.tensors import split
from accelmesh.security.identity import Role
from accelmesh.security.tickets import GET, PUT
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from compile_svc.programs.builtin import IDENTITY_WIDTH
from worker_svc.object_methods import MAX_OBJECTS_PER_CALL, ObjectMethods
from worker_svc.objects import BYTES_ENV

from conftest import CREDENTIALS, mesh_stub, rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.fixture_cpu]

STORE_BYTES = 8 * 1024 * 1024
ROWS = 8  # the identity program's batch size here
RNG = np.random.default_rng(7)


def with_nan_payload(array: np.ndarray) -> np.ndarray:
    """`array` with a NaN of a payload of its own: only a bit-for-bit copy keeps it."""
    array.view(np.uint32).reshape(-1)[0] = 0x7FC0_0123
    return array


@pytest.fixture(scope="module")
def worker(tmp_path_factory, compile_service):
    server = object_worker(tmp_path_factory.mktemp("worker"), store_bytes=STORE_BYTES,
                           compile_address=compile_service[0])
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def user(worker):
    with stub_for(worker, CREDENTIALS.issue(Role.USER, "alice")) as stub:
        yield stub


def put(stub, token: bytes, objects: dict[str, np.ndarray]) -> pb.PutObjectsResponse:
    return stub.PutObjects(put_messages(token, objects), timeout=CALL_TIMEOUT_S)


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, array in want.items():
        assert (got[name].dtype, got[name].shape, got[name].tobytes()) == (array.dtype, array.shape, array.tobytes())


# -- round trips -----------------------------------------------------------------------------------

CALLERS = {"a user's certificate": lambda: CREDENTIALS.issue(Role.USER, "alice"),
           "a client certificate and the operator's token": CREDENTIALS.client,
           "a worker's certificate": lambda: CREDENTIALS.service(Role.WORKER)}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_objects_put_come_back_bit_for_bit_whatever_role_the_callers_certificate_has(worker, caller):
    job = f"round-trip-{caller}"
    objects = {"in/matrix": with_nan_payload(RNG.normal(size=(37, 300)).astype(np.float32)),
               "in/counts": np.arange(-500, 1500, dtype=np.int32), "in/empty": np.zeros((0, 4), np.float32)}
    with stub_for(worker, CALLERS[caller]()) as stub:
        answer = put(stub, ticket(PUT, job, prefix="in/"), objects)
        assert (answer.objects, answer.bytes) == (3, sum(a.nbytes for a in objects.values()))
        assert_identical(fetched(stub, ticket(GET, job, prefix="in/"), objects), objects)


def through_file(path: str, nbytes: int, data: bytes | None = None) -> bytes:
    """What a same-host client does with a segment: map the file it was handed, write or read it."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, nbytes) as mapping:
            if data is not None:
                mapping[:] = data
            return bytes(mapping)
    finally:
        os.close(fd)


def test_objects_written_through_their_segment_files_are_read_back_so_and_by_fetch_and_the_files_are_private(
        worker, user):
    objects = {"in/x": RNG.normal(size=(16, 64)).astype(np.float32), "in/y": np.arange(10, dtype=np.int32)}
    put_ticket, get_ticket = ticket(PUT, "mapped", prefix="in/"), ticket(GET, "mapped", prefix="in/")
    created = user.MapObjects(pb.MapObjectsRequest(ticket=put_ticket, create=[
        split(name, array)[0] for name, array in objects.items()]), timeout=CALL_TIMEOUT_S)
    assert [s.object_id for s in created.segments] == list(objects)
    for segment, array in zip(created.segments, objects.values(), strict=True):
        assert segment.bytes == array.nbytes and stat.S_IMODE(os.stat(segment.path).st_mode) == 0o600
        through_file(segment.path, segment.bytes, array.tobytes())
    # Written but not sealed: no reader sees it yet.
    assert rpc_error(fetched, user, get_ticket, ["in/x"]).code() == grpc.StatusCode.NOT_FOUND
    sealed = user.SealObjects(pb.SealObjectsRequest(ticket=put_ticket, object_ids=list(objects)),
                              timeout=CALL_TIMEOUT_S)
    assert sealed.sealed == 2
    opened = user.MapObjects(pb.MapObjectsRequest(ticket=get_ticket, open=list(objects)), timeout=CALL_TIMEOUT_S)
    for segment, (name, array) in zip(opened.segments, objects.items(), strict=True):
        assert (segment.object_id, list(segment.header.shape)) == (name, list(array.shape))
        assert through_file(segment.path, segment.bytes) == array.tobytes()
    assert_identical(fetched(user, get_ticket, objects), objects)


# -- refusals --------------------------------------------------------------------------------------

JOB = "refusals"
X = np.arange(12, dtype=np.float32).reshape(3, 4)
UNAUTHENTICATED, PERMISSION_DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND, INVALID_ARGUMENT = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def stored(user):
    """The object "in/x" of job JOB, for the refusals to aim at."""
    put(user, ticket(PUT, JOB, prefix="in/"), {"in/x": X})


def fetching(make_ticket, ids=("in/x",)):
    return lambda stub: fetched(stub, make_ticket(), ids)


def putting(make_ticket, objects=None):
    return lambda stub: put(stub, make_ticket(), objects or {"in/new": X})


def wrong_total(stub):
    header, _ = split("in/short", X)
    header.total_bytes -= 4
    messages = [pb.PutObjectsRequest(ticket=ticket(PUT, JOB)), pb.PutObjectsRequest(object=header)]
    return stub.PutObjects(iter(messages), timeout=CALL_TIMEOUT_S)


def releasing(token, object_ids=()):
    return lambda stub: stub.ReleaseObjects(pb.ReleaseObjectsRequest(ticket=token(), object_ids=list(object_ids)),
                                            timeout=CALL_TIMEOUT_S)


def creating_and_opening(stub):
    return stub.MapObjects(pb.MapObjectsRequest(ticket=ticket(PUT, JOB), create=[split("in/m", X)[0]], open=["in/x"]),
                           timeout=CALL_TIMEOUT_S)


REFUSALS = {
    # case: (the call on a stub, code, ErrorInfo reason, BadRequest fields)
    "a fetch without a ticket": (fetching(lambda: b""), UNAUTHENTICATED, "", ["ticket"]),
    "a put whose ticket is empty": (putting(lambda: b""), UNAUTHENTICATED, "", ["ticket"]),
    "a map without a ticket": (lambda s: s.MapObjects(pb.MapObjectsRequest(open=["in/x"]), timeout=CALL_TIMEOUT_S),
                               UNAUTHENTICATED, "", ["ticket"]),
    "a seal without a ticket": (lambda s: s.SealObjects(pb.SealObjectsRequest(object_ids=["in/x"]),
                                                        timeout=CALL_TIMEOUT_S), UNAUTHENTICATED, "", ["ticket"]),
    "a release without a ticket": (lambda s: s.ReleaseObjects(pb.ReleaseObjectsRequest(), timeout=CALL_TIMEOUT_S),
                                   UNAUTHENTICATED, "", ["ticket"]),
    "a ticket signed with a worker's certificate": (
        fetching(lambda: forged_ticket(CREDENTIALS.service(Role.WORKER), GET, JOB)), UNAUTHENTICATED, "", ["ticket"]),
    "a ticket signed with a user's certificate": (
        putting(lambda: forged_ticket(CREDENTIALS.issue(Role.USER, "mallory"), PUT, JOB)),
        UNAUTHENTICATED, "", ["ticket"]),
    "an expired ticket": (fetching(lambda: ticket(GET, JOB, lifetime_s=-10)), UNAUTHENTICATED,
                          errors.TICKET_EXPIRED, ["ticket"]),
    "a get ticket used to put": (putting(lambda: ticket(GET, JOB)), PERMISSION_DENIED, "", ["ticket"]),
    "a put ticket used to fetch": (fetching(lambda: ticket(PUT, JOB)), PERMISSION_DENIED, "", ["ticket"]),
    "a ticket for another node": (fetching(lambda: ticket(GET, JOB, node="10.0.0.9")), PERMISSION_DENIED, "",
                                  ["ticket"]),
    "a put of an id outside the ticket's prefix": (
        putting(lambda: ticket(PUT, JOB, prefix="in/"), {"out/0": X}), PERMISSION_DENIED, "", ["ticket"]),
    "a fetch of an id outside the ticket's prefix": (
        fetching(lambda: ticket(GET, JOB, prefix="out/")), PERMISSION_DENIED, "", ["ticket"]),
    "a put of an id the job has already": (putting(lambda: ticket(PUT, JOB), {"in/x": X}),
                                           grpc.StatusCode.ALREADY_EXISTS, "", ["object_id"]),
    "total_bytes that dtype and shape do not take": (wrong_total, INVALID_ARGUMENT, "", ["object.total_bytes"]),
    "a map that both creates and opens": (creating_and_opening, INVALID_ARGUMENT, "", ["open"]),
    "a fetch of an id never put": (fetching(lambda: ticket(GET, JOB), ["in/x", "in/unknown"]), NOT_FOUND, "",
                                   ["object_id"]),
    "a release of an id outside the ticket's prefix": (
        releasing(lambda: ticket(PUT, JOB, prefix="out/"), ["in/x"]), PERMISSION_DENIED, "", ["ticket"]),
    "a release with a put ticket for another node": (
        releasing(lambda: ticket(PUT, JOB, node="10.0.0.9")), PERMISSION_DENIED, "", ["ticket"]),
    "a release of more ids than a call may name": (
        releasing(lambda: ticket(PUT, JOB), ["in/x"] * (MAX_OBJECTS_PER_CALL + 1)), INVALID_ARGUMENT, "",
        ["object_ids"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_has_its_status_reason_and_field(user, stored, case):
    call, code, reason, fields = REFUSALS[case]
    error = rpc_error(call, user)
    assert error.code() == code, error.details()
    assert details(error)[::2] == (reason, fields)
    assert_identical(fetched(user, ticket(GET, JOB), ["in/x"]), {"in/x": X})  # the object is as it was


def test_another_tenants_ticket_for_the_same_job_id_cannot_reach_the_first_tenants_objects(user, stored):
    """Scopes are "<tenant>|<job>": the same job id under another owner is another scope."""
    error = rpc_error(fetched, user, ticket(GET, JOB, tenant="user:mallory"), ["in/x"])
    assert error.code() == NOT_FOUND and "user:mallory|refusals" in error.details()
    assert put(user, ticket(PUT, JOB, tenant="user:mallory"), {"in/x": X + 1}).objects == 1
    assert_identical(fetched(user, ticket(GET, JOB), ["in/x"]), {"in/x": X})


def chunks_of(array: np.ndarray, offsets):
    data = array.tobytes()
    return [pb.PutObjectsRequest(chunk=common_pb2.TensorChunk(name="in/partial", offset=start, data=data[start:end]))
            for start, end in offsets]


CUT = {  # case: (the chunks of X's 48 bytes sent, then whatever follows, the field named)
    "a chunk out of order": ([(0, 16), (32, 48), (16, 32)], [], "chunk.offset"),
    "an object cut short by the end of the stream": ([(0, 16), (16, 32)], [], "chunk"),
    "an object cut short by the next header": ([(0, 16)], [pb.PutObjectsRequest(object=split("in/next", X)[0])],
                                               "chunk"),
}


@pytest.mark.parametrize("case", list(CUT))
def test_a_half_written_object_is_refused_and_not_left_behind(user, case):
    offsets, after, field = CUT[case]
    job = f"cut-{case}"
    messages = [pb.PutObjectsRequest(ticket=ticket(PUT, job)), pb.PutObjectsRequest(object=split("in/partial", X)[0]),
                *chunks_of(X, offsets), *after]
    error = rpc_error(user.PutObjects, iter(messages), timeout=CALL_TIMEOUT_S)
    assert error.code() == INVALID_ARGUMENT and details(error)[2] == [field]
    assert rpc_error(fetched, user, ticket(GET, job), ["in/partial"]).code() == NOT_FOUND
    assert put(user, ticket(PUT, job), {"in/partial": X}).objects == 1
    assert_identical(fetched(user, ticket(GET, job), ["in/partial"]), {"in/partial": X})


# -- the store's bound -----------------------------------------------------------------------------

def test_a_put_past_the_store_bound_is_refused_naming_its_variable_until_a_release_frees_room(tmp_path):
    server = object_worker(tmp_path, store_bytes=4096)
    put_ticket, first, second = ticket(PUT, "bound", prefix="in/"), np.zeros(768, np.float32), np.ones(768, np.int32)
    try:
        with stub_for(server, CREDENTIALS.issue(Role.USER, "alice")) as stub:
            assert put(stub, put_ticket, {"in/a": first}).bytes == 3072
            error = rpc_error(put, stub, put_ticket, {"in/b": second})
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and BYTES_ENV in error.details()
            reason, metadata, _ = details(error)
            assert (reason, metadata) == (errors.STORE_FULL, {"limit_bytes": "4096", "variable": BYTES_ENV})
            released = stub.ReleaseObjects(pb.ReleaseObjectsRequest(ticket=put_ticket), timeout=CALL_TIMEOUT_S)
            assert (released.released_objects, released.released_bytes) == (1, 3072)
            assert put(stub, put_ticket, {"in/b": second}).objects == 1
            assert_identical(fetched(stub, ticket(GET, "bound"), ["in/b"]), {"in/b": second})
    finally:
        server.stop(0)


def test_a_release_naming_objects_frees_those_alone_and_one_freed_already_is_no_error(user):
    job, objects = "release-some", {f"in/{i}": np.full(64, i, np.float32) for i in range(3)}
    put(user, ticket(PUT, job), objects)
    named = pb.ReleaseObjectsRequest(ticket=ticket(GET, job), object_ids=["in/0", "in/2", "in/0"])
    released = user.ReleaseObjects(named, timeout=CALL_TIMEOUT_S)  # a get ticket frees as a put ticket does
    assert (released.released_objects, released.released_bytes) == (2, 2 * 256)
    assert rpc_error(fetched, user, ticket(GET, job), ["in/0"]).code() == NOT_FOUND
    assert_identical(fetched(user, ticket(GET, job), ["in/1"]), {"in/1": objects["in/1"]})
    again = user.ReleaseObjects(named, timeout=CALL_TIMEOUT_S)
    assert (again.released_objects, again.released_bytes) == (0, 0)


# -- shards on stored inputs -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def identity(worker, compile_service):
    """The identity program built for the worker's one device, as a Model the helpers' `header` takes."""
    address = f"127.0.0.1:{worker.port}"
    (device,) = mesh_stub(worker_service_pb2_grpc.WorkerServiceStub, address).DescribeNode(
        pb.DescribeNodeRequest(), timeout=CALL_TIMEOUT_S).devices
    return device.id, Model(compile_for(compile_service[1], "identity", [device], [ROWS]), [], None)


def stored_shard(identity, job: str, index: int, object_id: str) -> pb.ExecuteManyRequest:
    device_id, model = identity
    return pb.ExecuteManyRequest(header=header(
        model, device_id, ROWS, job_id=job, shard_index=index, input_count=0, report_stages=False,
        object_scope=f"{TENANT}|{job}", stored_inputs=[pb.StoredInput(name="x", object_id=object_id)],
        output_prefix=f"out/0.{index}/"))


def run_many(worker, shards) -> list[pb.ExecuteManyResponse]:
    with stub_for(worker, CREDENTIALS.service(Role.DISPATCH)) as dispatcher:
        return list(dispatcher.ExecuteMany(iter(shards), timeout=CALL_TIMEOUT_S))


def test_a_shard_runs_on_a_stored_input_and_keeps_its_output_in_the_store(worker, user, identity):
    x = RNG.normal(size=(ROWS, IDENTITY_WIDTH)).astype(np.float32)
    put(user, ticket(PUT, "stored-run", prefix="in/"), {"in/x": x})
    answer = run_many(worker, [stored_shard(identity, "stored-run", 1, "in/x")])
    assert [part.WhichOneof("part") for part in answer] == ["tensor", "timings"]
    assert (answer[0].tensor.name, list(answer[0].tensor.shape)) == ("out/0.1/0", [ROWS, IDENTITY_WIDTH])
    assert_identical(fetched(user, ticket(GET, "stored-run", prefix="out/"), ["out/0.1/0"]), {"out/0.1/0": x})


def test_a_shard_whose_stored_input_is_missing_fails_alone_and_the_stream_goes_on(worker, user, identity):
    x = RNG.normal(size=(ROWS, IDENTITY_WIDTH)).astype(np.float32)
    put(user, ticket(PUT, "missing-input", prefix="in/"), {"in/x": x})
    answer = run_many(worker, [stored_shard(identity, "missing-input", 1, "in/absent"),
                               stored_shard(identity, "missing-input", 2, "in/x")])
    assert [part.WhichOneof("part") for part in answer] == ["failure", "tensor", "timings"]
    assert answer[0].failure.code == grpc.StatusCode.NOT_FOUND.value[0] and "in/absent" in answer[0].failure.message
    assert answer[1].tensor.name == "out/0.2/0"
    got = fetched(user, ticket(GET, "missing-input", prefix="out/"), ["out/0.2/0"])
    assert_identical(got, {"out/0.2/0": x})
    assert rpc_error(fetched, user, ticket(GET, "missing-input"), ["out/0.1/0"]).code() == NOT_FOUND


def batch(shards: list[pb.ExecuteManyRequest]) -> pb.ExecuteManyRequest:
    return pb.ExecuteManyRequest(batch=pb.ExecuteManyRequestBatch(parts=shards))


def accepting(shard: pb.ExecuteManyRequest) -> pb.ExecuteManyRequest:
    shard.header.accept_batches = True
    return shard


def test_a_batch_of_stored_shards_is_answered_in_one_message_once_all_ran(worker, user, identity):
    """A caller that sends shards as one batch hears of them as one: each answer (outputs kept in
    the store, or a failure) waits while the shards after it in the batch run; a shard sent alone
    after the batch is answered on its own."""
    xs = [RNG.normal(size=(ROWS, IDENTITY_WIDTH)).astype(np.float32) for _ in range(3)]
    put(user, ticket(PUT, "batched-run", prefix="in/"), {f"in/{k}": x for k, x in enumerate(xs)})
    shards = [accepting(stored_shard(identity, "batched-run", 1, "in/0")),
              accepting(stored_shard(identity, "batched-run", 2, "in/absent")),
              accepting(stored_shard(identity, "batched-run", 3, "in/1"))]
    answer = run_many(worker, [batch(shards), accepting(stored_shard(identity, "batched-run", 4, "in/2"))])
    assert [part.WhichOneof("part") for part in answer] == ["batch", "batch"]
    parts = [[p.WhichOneof("part") for p in message.batch.parts] for message in answer]
    assert parts == [["tensor", "timings", "failure", "tensor", "timings"], ["tensor", "timings"]]
    assert answer[0].batch.parts[2].failure.code == grpc.StatusCode.NOT_FOUND.value[0]
    got = fetched(user, ticket(GET, "batched-run", prefix="out/"), ["out/0.1/0", "out/0.3/0", "out/0.4/0"])
    assert_identical(got, {"out/0.1/0": xs[0], "out/0.3/0": xs[1], "out/0.4/0": xs[2]})


def test_answers_held_for_a_batch_go_before_the_status_a_later_shard_of_it_ends_the_call_with(
        worker, user, identity):
    """A shard whose header cannot be taken ends the call; the shards before it in the batch ran,
    and their answers reach the caller ahead of the status, so it takes the status for that shard."""
    put(user, ticket(PUT, "batched-end", prefix="in/"), {"in/0": np.ones((ROWS, IDENTITY_WIDTH), np.float32)})
    stray = pb.ExecuteManyRequest(held=pb.TensorRef(name="x", key="k"))  # where a header belongs
    with stub_for(worker, CREDENTIALS.service(Role.DISPATCH)) as dispatcher:
        call = dispatcher.ExecuteMany(iter([batch([accepting(stored_shard(identity, "batched-end", 1, "in/0")),
                                                    stray])]), timeout=CALL_TIMEOUT_S)
        first = next(call)
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
    assert [p.WhichOneof("part") for p in first.batch.parts] == ["tensor", "timings"]
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ShardHeader" in ended.value.details()


# -- who is on this node ---------------------------------------------------------------------------

@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5", True), ("ipv4:127.8.9.1:5", True), ("ipv6:[::1]:5", True), ("unix:/x", True),
    ("ipv4:10.1.2.3:5", True),  # the node's own address
    ("ipv4:10.0.0.9:5", False), ("ipv6:[fe80::1]:5", False), ("weird", False), ("ipv4:not-an-ip:5", False),
])
def test_a_peer_is_local_when_it_calls_from_loopback_a_unix_socket_or_the_nodes_own_address(peer, local):
    assert ObjectMethods(None, None, "10.1.2.3", 1)._local(peer) is local
