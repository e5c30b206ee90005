"""The worker's object store, for fuzzing.py: tickets, the objects the seeds name, and seeds for
PutObjects, FetchObjects, MapObjects, SealObjects and ReleaseObjects, and for shards that run on
stored inputs or keep their outputs in the store (ShardHeader.object_scope, stored_inputs,
output_prefix).

The five methods take any caller the mesh CA issued a certificate to; what a call may do is in
the ticket it carries, which only a dispatcher signs (accelmesh/security/tickets.py). The fuzz
signs its own with the mesh's dispatch credentials (`Callers.security(Role.DISPATCH)`), for a job
of its own at the worker's node (the host of its address, which the worker checks the ticket's
node against), so seeds reach past the ticket check into the store. A mutated ticket no longer
matches its signature: those calls test the check itself. Each ticket covers one prefix of ids,
so the seeds of one method do not free or overwrite what another's name:

    in/   objects put once here (`gather`) and named by the Fetch, Map-open and Execute seeds
    put/  what the PutObjects fuzz puts          map/  what the MapObjects fuzz creates
    out/  outputs ExecuteMany keeps in the store

`restore` frees the fuzz's job whole and puts in/ back (Fuzzer.settle): memory is measured with
the store as it was after gathering, not with what the calls before left there until the
store's idle expiry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from accelmesh.security.identity import Role, address_host
from accelmesh.security.tickets import GET, PUT, TicketSigner, expiring_ticket

TENANT, JOB = "user:fuzz", "fuzz-objects"  # the fuzz's own job; its objects are the scope TENANT|JOB
OTHER_TENANT, OTHER_JOB = "user:fuzz-other", "fuzz-other-job"  # a scope no seed puts into
ELSEWHERE = "10.255.0.1"  # a node that is not the worker's
TICKET_S = 24 * 3600.0  # outlives the longest run
STORED_ROWS, STORED_COLS = 4, 1024  # in/x: the identity build's input, SEED_ROWS rows
STORED_ID, PENDING_ID = "in/x", "map/pending"  # put and sealed; created, never sealed


@dataclass
class ObjectFacts:
    node: str  # the worker's node: what a valid ticket names
    scope: str  # "<tenant>|<job>", as ShardHeader.object_scope names the fuzz's objects
    tickets: dict[str, bytes] = field(default_factory=dict)  # by name, see `sign_tickets`
    notes: list[str] = field(default_factory=list)


def sign_tickets(security, node: str) -> dict[str, bytes]:
    """The tickets the seeds carry: valid ones for each prefix, and some the worker must refuse."""
    signer = TicketSigner(security)

    def sign(direction: str, prefix: str, *, tenant: str = TENANT, job: str = JOB, at: str = node,
             lifetime_s: float = TICKET_S) -> bytes:
        return signer.sign(expiring_ticket(tenant, job, at, direction, prefix=prefix, lifetime_s=lifetime_s))

    return {
        "put_in": sign(PUT, "in/"), "put": sign(PUT, "put/"), "map": sign(PUT, "map/"),
        "get": sign(GET, ""), "get_out": sign(GET, "out/"), "put_all": sign(PUT, ""),
        "expired": sign(PUT, "put/", lifetime_s=-60.0), "get_expired": sign(GET, "", lifetime_s=-60.0),
        "elsewhere": sign(GET, "", at=ELSEWHERE), "put_elsewhere": sign(PUT, "put/", at=ELSEWHERE),
        "other_job": sign(PUT, "", tenant=OTHER_TENANT, job=OTHER_JOB),
        "other_get": sign(GET, "", tenant=OTHER_TENANT, job=OTHER_JOB),
    }


def _stub(callers):
    from accelmesh.worker.v1 import worker_service_pb2_grpc

    return worker_service_pb2_grpc.WorkerServiceStub(callers.channel("worker", Role.OPERATOR))


def _put_fixed(stub, tickets: dict[str, bytes]) -> None:
    """in/x put and sealed, map/pending created and left unsealed (for the SealObjects seeds)."""
    from accelmesh.runtime.tensors import split
    from accelmesh.worker.v1 import worker_service_pb2 as w

    x = np.arange(STORED_ROWS * STORED_COLS, dtype=np.float32).reshape(STORED_ROWS, STORED_COLS)
    header, chunks = split(STORED_ID, x, 8192)
    stub.PutObjects(iter([w.PutObjectsRequest(ticket=tickets["put_in"]), w.PutObjectsRequest(object=header),
                          *(w.PutObjectsRequest(chunk=c) for c in chunks)]), timeout=30)
    stub.MapObjects(w.MapObjectsRequest(ticket=tickets["map"], create=[_header(PENDING_ID, (4, 4))]), timeout=30)


def _header(name: str, shape: tuple[int, ...], dtype: str = "DATA_TYPE_FLOAT32", itemsize: int = 4):
    from accelmesh.common.v1 import common_pb2

    return common_pb2.TensorHeader(name=name, dtype=dtype, shape=list(shape),
                                   total_bytes=int(np.prod(shape, dtype=np.int64)) * itemsize)


def gather(callers, worker_address: str) -> ObjectFacts:
    """The fuzz's tickets for the first worker, and in/x and map/pending in its store (afresh:
    what an earlier fuzz of this mesh left of the job is freed first)."""
    node = address_host(worker_address)
    facts = ObjectFacts(node=node, scope=f"{TENANT}|{JOB}")
    facts.tickets = sign_tickets(callers.security(Role.DISPATCH), node)
    trouble = restore(callers, facts)
    if trouble:  # the seeds still go; those naming in/x get NOT_FOUND
        facts.notes.append(trouble)
    return facts


def restore(callers, facts: ObjectFacts | None) -> str | None:
    """Free every object of the fuzz's job on the worker, then put in/x and map/pending again;
    what went wrong, or None."""
    from accelmesh.worker.v1 import worker_service_pb2 as w

    if facts is None:
        return None
    stub = _stub(callers)
    try:
        stub.ReleaseObjects(w.ReleaseObjectsRequest(ticket=facts.tickets["get"]), timeout=30)
        _put_fixed(stub, facts.tickets)
    except grpc.RpcError as exc:
        return f"could not reset the fuzz's objects: {exc.code().name} {exc.details()}"
    return None


def object_seeds(facts: ObjectFacts) -> dict[str, list]:
    """Seeds of the five object-store methods, by "worker.Method"."""
    from accelmesh.common.v1 import common_pb2
    from accelmesh.worker.v1 import worker_service_pb2 as w

    t = facts.tickets
    small = np.arange(16, dtype=np.float32).tobytes()  # a [4, 4] float32 object

    def put(ticket: str, name: str, *chunks: tuple[int, bytes], shape=(4, 4)) -> list:
        parts = [w.PutObjectsRequest(ticket=t[ticket])] if ticket else []
        parts.append(w.PutObjectsRequest(object=_header(name, shape)))
        parts += [w.PutObjectsRequest(chunk=common_pb2.TensorChunk(name=name, offset=o, data=d)) for o, d in chunks]
        return parts

    whole = (0, small)
    out: dict[str, list] = {}
    out["worker.PutObjects"] = [
        put("put", "put/a", whole),  # valid: put and sealed (ALREADY_EXISTS until released)
        put("put", "put/b", (0, small[:16]), (16, small[16:32])),  # header, then short chunks: ends short
        put("put", "put/c", (0, small[:32]), (0, small[32:])),  # a chunk at the wrong offset
        put("put", "put/d", (0, small + small)),  # more bytes than the header says
        [*put("put", "put/e", whole), *put("", "put/f", whole)],  # two objects on one stream
        put("put", "put/empty", shape=(0, 4)),  # no bytes: sealed at its header
        put("", "put/g", whole),  # no ticket
        [w.PutObjectsRequest(ticket=t["put"])],  # the ticket alone
        [w.PutObjectsRequest(ticket=t["put"]), w.PutObjectsRequest(chunk=common_pb2.TensorChunk(data=small))],
        put("put", "in/y", whole),  # an id outside the ticket's prefix
        put("put_in", STORED_ID, (0, bytes(STORED_ROWS * STORED_COLS * 4)), shape=(STORED_ROWS, STORED_COLS)),
        put("expired", "put/h", whole), put("get", "put/i", whole), put("put_elsewhere", "put/j", whole),
        put("other_job", "put/k", whole),
    ]
    fetch = w.FetchObjectsRequest
    out["worker.FetchObjects"] = [
        fetch(ticket=t["get"], object_ids=[STORED_ID]),  # valid: put by `gather`
        fetch(ticket=t["get"], object_ids=[STORED_ID, "put/a", STORED_ID]),  # and one the PutObjects seed put
        fetch(ticket=t["get"], object_ids=["in/never-put"]), fetch(ticket=t["get"], object_ids=[PENDING_ID]),
        fetch(ticket=t["get"], object_ids=[]), fetch(object_ids=[STORED_ID]),
        fetch(ticket=t["get_out"], object_ids=[STORED_ID]),  # outside the ticket's prefix
        fetch(ticket=t["put_in"], object_ids=[STORED_ID]), fetch(ticket=t["get_expired"], object_ids=[STORED_ID]),
        fetch(ticket=t["elsewhere"], object_ids=[STORED_ID]), fetch(ticket=t["other_get"], object_ids=[STORED_ID]),
    ]
    mapped = w.MapObjectsRequest
    out["worker.MapObjects"] = [
        mapped(ticket=t["map"], create=[_header("map/a", (4, 4))]),  # valid create (this host: the fuzz's)
        mapped(ticket=t["map"], create=[_header("map/b", (2,), "DATA_TYPE_INT32"), _header("map/c", (0,))]),
        mapped(ticket=t["get"], open=[STORED_ID]),  # valid open
        mapped(ticket=t["get"], open=[STORED_ID, PENDING_ID]), mapped(ticket=t["get"], open=["in/never-put"]),
        mapped(ticket=t["map"], create=[_header("map/d", (4, 4))], open=[STORED_ID]),  # both at once
        mapped(ticket=t["get"], create=[_header("map/e", (4, 4))]), mapped(ticket=t["map"]),
        mapped(create=[_header("map/f", (4, 4))]), mapped(ticket=t["map"], create=[_header("in/z", (4, 4))]),
    ]
    seal = w.SealObjectsRequest
    out["worker.SealObjects"] = [
        seal(ticket=t["map"], object_ids=[PENDING_ID]),  # valid: created by `gather`, sealed once
        seal(ticket=t["map"], object_ids=["map/a", "map/b"]),  # created by the MapObjects seeds
        seal(ticket=t["map"], object_ids=["map/never-created"]), seal(ticket=t["put"], object_ids=["put/a"]),
        seal(ticket=t["map"], object_ids=[]), seal(object_ids=[PENDING_ID]),
        seal(ticket=t["get"], object_ids=[PENDING_ID]), seal(ticket=t["expired"], object_ids=["put/a"]),
    ]
    release = w.ReleaseObjectsRequest
    out["worker.ReleaseObjects"] = [release(ticket=t[name]) for name in (
        "put", "map", "get_out", "other_job", "other_get", "expired", "elsewhere")] + [release()]
    return out


def shard_variants(w, shard, facts: ObjectFacts) -> dict[str, object]:
    """ShardHeaders of `shard` (the identity build's, one input x) using the store's fields."""

    def variant(**fields):
        head = w.ShardHeader()
        head.CopyFrom(shard)
        stored = fields.pop("stored", ())
        for key, value in fields.items():
            setattr(head, key, value)
        head.stored_inputs.extend(w.StoredInput(name="x", object_id=object_id) for object_id in stored)
        return head

    return {
        # runs on in/x where it lies: no tensor in the call
        "stored": variant(input_count=0, object_scope=facts.scope, stored=[STORED_ID]),
        "stored_missing": variant(input_count=0, object_scope=facts.scope, stored=["in/never-put"]),
        "stored_twice": variant(input_count=0, object_scope=facts.scope, stored=[STORED_ID, STORED_ID]),
        "stored_no_scope": variant(input_count=0, stored=[STORED_ID]),
        "stored_other_scope": variant(input_count=0, object_scope=f"{OTHER_TENANT}|{OTHER_JOB}", stored=[STORED_ID]),
        "stored_and_sent": variant(object_scope=facts.scope, stored=[STORED_ID]),  # x sent and stored
        # ExecuteMany keeps the outputs as out/fuzz/<index> (ALREADY_EXISTS once there)
        "stored_out": variant(input_count=0, object_scope=facts.scope, stored=[STORED_ID], output_prefix="out/fuzz/"),
        "out": variant(object_scope=facts.scope, output_prefix="out/sent/"),
        "out_no_scope": variant(output_prefix="out/no-scope/"),
    }
