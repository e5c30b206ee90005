"""Fuzzing a running mesh with credentials: every method of every process, mutated requests sent
as raw bytes by a caller that the method's access table admits, so they reach the handlers
instead of bouncing off authorization.

Used by bench/fuzz.py (the full run, its JSON) and tests/e2e/test_fuzz_e2e.py (a small run);
both put this folder on sys.path and import this module as `fuzzing`.

Methods come from the generated service descriptors, so a method added to a .proto is fuzzed
without a change here (from the default message until someone adds seeds for it below). Each
call's request starts from a seed (the default message, or a realistic one naming a real device,
job, program or artifact of this mesh) and is mutated: hostile field values (extreme integers,
NaN, very long and odd strings, thousands of repeated elements), then for some calls damage to the
serialized bytes (truncation, bit flips, random bytes, overlong varints, deeply nested groups).
Client-streaming methods get a short stream of such messages, reordered, cut or duplicated.

What counts: INTERNAL or UNKNOWN from a service is a finding (a handler that let an error escape
untyped), in a call's status or in a ShardFailure an ExecuteMany stream answers a shard with (its
status stays OK), and so is INTERNAL "Exception deserializing request!", gRPC's own answer to
bytes that do not decode as the request message: the mesh's servers refuse those as INVALID_ARGUMENT
(accelmesh.runtime.errors.DecodeInterceptor), since the path through grpcio's deserializer also
keeps the call's state for good. Findings of that kind are counted apart as `undecodable_internal`.
A status the client never got because its trailers were over the client's metadata limit
(RESOURCE_EXHAUSTED "... metadata size exceeds ...") is a finding too (`status_lost`). A refusal
by the access check ("needs the role") or UNAUTHENTICATED is counted as `refused`: it means the
fuzz chose the wrong credential and did not test the handler. The worker's object-store methods
have no access check (BY_TICKET: the ticket each call carries, signed by a dispatcher, says what it
may do; fuzz_objects.py signs the seeds' own): a refusal of a call's ticket is the handler's
answer, counted as `ticket_refused`. `decoded` counts the requests whose every message this side
could decode too: those reached the handler's own code.
"""

from __future__ import annotations

import math
import random
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import import_module

import fuzz_objects
import grpc
import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.memory import TRIM_INTERVAL_S
from accelmesh.security.access import BY_TICKET
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import PEOPLE, Role

UNDECODABLE = "Exception deserializing request!"  # grpcio's own answer to bytes that do not parse
# The client's answer when a status's trailers are over its metadata limit: the real status is lost.
STATUS_LOST = "metadata size exceeds"
DEADLINE_S = 3.0
STREAM_IDLE_S = 0.3  # a response stream quiet this long is cancelled (watches never end by themselves)
MAX_STREAM_RESPONSES = 64
MAX_PAYLOAD_BYTES = 4 << 20  # mutations that grow past this are rolled again
MAX_VALUE_BYTES = 1 << 20  # no one string or bytes value is longer
MAX_STREAM_MESSAGES = 8
FINDINGS_KEPT_PER_METHOD = 5
CONCURRENCY = 4  # calls in flight per method
STREAM_CONCURRENCY = 8  # response streams mostly wait for STREAM_IDLE_S
FINAL_JOB_STATES = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}


@dataclass(frozen=True)
class Area:
    process: str  # the mesh process hosting the services of `proto_module`
    proto_module: str
    server_module: str  # where its access table, ACCESS, is
    role: Role  # the role the process's certificate names


AREAS = (
    Area("inventory", "accelmesh.inventory.v1.inventory_service_pb2", "inventory_svc.server", Role.INVENTORY),
    Area("compile", "accelmesh.compile.v1.compile_service_pb2", "compile_svc.server", Role.COMPILE),
    Area("dispatch", "accelmesh.dispatch.v1.dispatch_service_pb2", "dispatch_svc.server", Role.DISPATCH),
    Area("worker", "accelmesh.worker.v1.worker_service_pb2", "worker_svc.server", Role.WORKER),
)
# The inventory goes last: its ReserveDevices fuzz may hold devices (up to a day) that the
# dispatcher's jobs would then not get; `release_reservations` clears them after each phase.
RUN_ORDER = ("compile", "dispatch", "worker", "inventory")


@dataclass(frozen=True)
class Method:
    area: Area
    service: str  # full name, e.g. accelmesh.inventory.v1.InventoryService
    name: str
    request: type
    client_streaming: bool
    server_streaming: bool
    allowed: frozenset[Role] | None  # None: not in the access table (nobody may call it)

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def label(self) -> str:
        return f"{self.area.process}.{self.name}"


def methods() -> list[Method]:
    """Every method of every service in the four service protos, in RUN_ORDER."""
    found = []
    for area in sorted(AREAS, key=lambda a: RUN_ORDER.index(a.process)):
        descriptor = import_module(area.proto_module).DESCRIPTOR
        access = import_module(area.server_module).ACCESS
        for service in descriptor.services_by_name.values():
            for method in service.methods:
                found.append(Method(area, service.full_name, method.name,
                                    message_factory.GetMessageClass(method.input_type),
                                    method.client_streaming, method.server_streaming, access.get(method.name)))
    return found


def caller_role(allowed: frozenset[Role]) -> Role:
    """The operator where people may call, else a service role the table names."""
    for role in (Role.OPERATOR, Role.USER):
        if role in allowed:
            return role
    return min(allowed, key=lambda r: r.value)


# --- mutations ---------------------------------------------------------------------------------

_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1), FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-30, 1e308, -1e308, 3.4e38, 1.0, -1.0, 0.5,
           2.0, 1e9, -1e9, 1e18]
_STRINGS = [
    "", " ", "\x00", "\n", "\t", "..", ".", "/", "../../../../etc/passwd", "/etc/passwd", "-", "--help", "%s%s%n",
    "%(x)s", "{0}", "${jndi:ldap://x}", "'; DROP TABLE devices; --", '"', "\\", "*", "?", "NaN", "inf", "-1", "0",
    "99999999999999999999999999", "1e309", "0x7fffffff", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:1",
    "[::1]:1", "localhost:", ":", "a:b:c", "\u202e", "\ufeff", "\u00e9", "\U0001f600" * 50, "A" * 128, "a" * 129,
    'platform = "cuda" AND ' * 200, "capabilities:", "capabilities:bf16", "free_memory_bytes >= -1",
    "free_memory_bytes >= 1e400", "free_memory_bytes < nan", "health = lost", 'type != "', "AND", " AND ",
    "emulated = maybe", "0" * 16, "cpu:0", "127.0.0.1/cuda:0", "127.0.0.1/cpu:99999999999", "identity",
    "mlp_classifier", "transformer_encoder", "identity@1", "fp32", "bf16", "float32", "bfloat16", "int4", "x", "y",
]
_BYTES = [b"", b"\x00", b"\xff" * 8, b"\x80" * 16]


def _fit(count: int, unit_bytes: int, budget: int = MAX_PAYLOAD_BYTES) -> int:
    """`count`, or fewer, so that `count` values of `unit_bytes` stay within `budget`."""
    return max(1, min(count, budget // max(1, unit_bytes)))


def _repeated(f) -> bool:
    is_repeated = getattr(f, "is_repeated", None)
    return is_repeated if is_repeated is not None else f.label == FD.LABEL_REPEATED


def _is_map(f) -> bool:
    return f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def hostile_int(f, rng: random.Random, current: int = 0) -> int:
    lo, hi = _INT_RANGES[f.type]
    picks = [lo, hi, 0, -1, 1, 2, 3, 7, lo + 1, hi - 1, 2**8, 2**16, 2**20, 2**30, 2**31 - 1, 2**31, 2**32,
             2**53 + 1, 2**62, current + 1, current - 1, current * 2**20, -current, current * 1000]
    value = rng.choice(picks) if rng.random() < 0.8 else rng.randint(lo, hi) if rng.random() < 0.5 \
        else rng.randint(-1000, 1000)
    return min(hi, max(lo, value))


def hostile_string(rng: random.Random, current: str = "") -> str:
    op = rng.randrange(10)
    if op == 0:
        return "A" * rng.choice([129, 256, 4097, 65_536, 1 << 20])
    if op <= 3:
        return rng.choice(_STRINGS)
    if op == 4 and current:
        return current + rng.choice(_STRINGS)
    if op == 5 and current:
        return current[: rng.randrange(len(current) + 1)]
    if op == 6 and current:
        i = rng.randrange(len(current))
        odd = chr(rng.choice([0, 0x22, 0x2f, 0x3a, 0x40, 0x7f, 0xe9, 0x2028, 0x10FFFF]))
        return current[:i] + odd + current[i + 1:]
    if op == 7 and current:
        return current * _fit(rng.choice([2, 100, 10_000]), len(current), MAX_VALUE_BYTES)
    if op == 8:
        return "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0x80, 0xD800),
                                        rng.randrange(0xE000, 0x110000)])) for _ in range(rng.randrange(1, 64)))
    return "".join(chr(rng.randrange(0x20, 0x7f)) for _ in range(rng.randrange(0, 32)))


def hostile_bytes(rng: random.Random, current: bytes = b"") -> bytes:
    op = rng.randrange(5)
    if op == 0:
        return rng.choice(_BYTES)
    if op == 1:
        return rng.randbytes(rng.choice([1, 3, 64, 4096, 65_536]))
    if op == 2 and current:
        return current[: rng.randrange(len(current) + 1)]
    if op == 3 and current:
        return flip_bits(current, rng, rng.randint(1, 8))
    return current * _fit(rng.choice([2, 16]), len(current), MAX_VALUE_BYTES) if current \
        else rng.randbytes(rng.randrange(1, 32))


def hostile_scalar(f, rng: random.Random, current=None):
    if f.type == FD.TYPE_BOOL:
        return not current if rng.random() < 0.7 else rng.random() < 0.5
    if f.type == FD.TYPE_ENUM:
        valid = [v.number for v in f.enum_type.values]
        return rng.choice(valid + [-1, max(valid) + 1, 1000, 2**31 - 1, -(2**31)])
    if f.type in _INT_RANGES:
        return hostile_int(f, rng, int(current or 0))
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        value = rng.choice(_FLOATS) if rng.random() < 0.85 else rng.uniform(-1e6, 1e6)
        if f.type == FD.TYPE_FLOAT and math.isfinite(value) and abs(value) > 3.4e38:
            value = math.copysign(math.inf, value)
        return value
    if f.type == FD.TYPE_STRING:
        return hostile_string(rng, current or "")
    return hostile_bytes(rng, current or b"")


def _set_scalar(target, name: str, f, rng: random.Random) -> None:
    for _ in range(3):
        try:
            setattr(target, name, hostile_scalar(f, rng, getattr(target, name)))
            return
        except (ValueError, TypeError):  # e.g. a closed enum refusing an unknown number
            continue


def _append_scalars(container, f, rng: random.Random) -> None:
    op = rng.randrange(4)
    try:
        if op == 0:
            del container[:]
        elif op == 1:
            container.extend(hostile_scalar(f, rng) for _ in range(rng.randint(1, 5)))
        elif op == 2:
            value = hostile_scalar(f, rng)
            unit = len(value) if isinstance(value, (str, bytes)) else 8
            container.extend([value] * _fit(rng.choice([100, 1000, 10_000]), unit))
        elif len(container):
            container[rng.randrange(len(container))] = hostile_scalar(f, rng, container[0])
        else:
            container.append(hostile_scalar(f, rng))
    except (ValueError, TypeError):
        pass


def _mutate_map(container, f, rng: random.Random) -> None:
    key_field, value_field = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
    added = 0
    for _ in range(rng.choice([1, 3, 1000])):
        if added > MAX_PAYLOAD_BYTES:
            return
        try:
            key = hostile_scalar(key_field, rng)
            if value_field.type == FD.TYPE_MESSAGE:
                mutate_message(container[key], rng, 1)
                added += container[key].ByteSize()
            else:
                value = container[key] = hostile_scalar(value_field, rng)
                added += len(value) if isinstance(value, (str, bytes)) else 8
            added += len(key) if isinstance(key, (str, bytes)) else 8
        except (ValueError, TypeError):
            pass


def mutate_message(msg: Message, rng: random.Random, depth: int = 0) -> None:
    """One hostile change somewhere in `msg` (a field of it, or of a message inside it)."""
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return
    f = rng.choice(fields)
    if _is_map(f):
        _mutate_map(getattr(msg, f.name), f, rng)
    elif _repeated(f) and f.type == FD.TYPE_MESSAGE:
        container = getattr(msg, f.name)
        op = rng.random()
        if op < 0.35 and len(container) and depth < 4:
            mutate_message(container[rng.randrange(len(container))], rng, depth + 1)
        elif op < 0.6:  # many elements: copies of one there, or defaults
            template = container[0] if len(container) else None
            unit = template.ByteSize() if template is not None else 2
            for _ in range(_fit(rng.choice([2, 10, 100, 1000]), unit)):
                item = container.add()
                if template is not None:
                    item.CopyFrom(template)
            if depth < 4:
                mutate_message(container[rng.randrange(len(container))], rng, depth + 1)
        elif op < 0.75:
            del container[:]
        else:
            item = container.add()
            for _ in range(rng.randint(0, 3)):
                mutate_message(item, rng, depth + 1)
    elif _repeated(f):
        _append_scalars(getattr(msg, f.name), f, rng)
    elif f.type == FD.TYPE_MESSAGE:
        op = rng.random()
        if op < 0.15:
            msg.ClearField(f.name)
        else:
            sub = getattr(msg, f.name)
            sub.SetInParent()
            if op >= 0.25 and depth < 4:
                mutate_message(sub, rng, depth + 1)
    else:
        _set_scalar(msg, f.name, f, rng)


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def flip_bits(data: bytes, rng: random.Random, count: int) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    for _ in range(count):
        i = rng.randrange(len(out) * 8)
        out[i // 8] ^= 1 << (i % 8)
    return bytes(out)


def damage(data: bytes, rng: random.Random) -> bytes:
    """Wire-level damage to a serialized message: some of it still decodes, most does not."""
    op = rng.randrange(11)
    if op == 0:  # truncation
        return data[: rng.randrange(len(data))] if data else b"\x0a"
    if op == 1:
        return flip_bits(data, rng, rng.choice([1, 1, 2, 4, 8]))
    if op == 2 and data:  # interesting bytes
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, 0x0A, 0x12])
        return bytes(out)
    if op == 3:
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.randbytes(rng.randint(1, 16)) + data[i:]
    if op == 4:
        return rng.randbytes(rng.choice([1, 2, 3, 8, 64, 512]))
    if op == 5 and data:  # a slice twice
        i = rng.randrange(len(data))
        j = rng.randrange(i, len(data) + 1)
        return data[:j] + data[i:j] + data[j:]
    if op == 6:  # an unknown field: decodes, and must be ignored
        number = rng.choice([100, 1000, 2**29 - 1])
        wire = rng.choice([0, 1, 2, 5])
        body = {0: _varint(rng.choice([0, 2**63, 2**64 - 1])), 1: struct.pack("<d", math.nan), 2: _varint(3) + b"abc",
                5: struct.pack("<f", math.inf)}[wire]
        return data + _varint(number << 3 | wire) + body
    if op == 7:  # an overlong varint
        return data + b"\x08" + b"\xff" * 10 + b"\x01"
    if op == 8:  # a length far past the end
        return data + b"\x0a" + _varint(rng.choice([2**31 - 1, 2**32, 2**63]))
    if op == 9:  # groups nested deeper than any parser's limit
        depth = rng.choice([64, 101, 1000, 10_000])
        return data + b"\x7b" * depth + b"\x7c" * depth  # field 15, start and end group
    # a known field again with the wrong wire type (a decoder keeps it as unknown)
    return data + bytes([0x0D]) + struct.pack("<I", rng.getrandbits(32))


def mutated_bytes(seed: Message, rng: random.Random) -> bytes:
    """A seed serialized after 0-3 hostile changes, its bytes damaged for about a third of calls."""
    for _ in range(4):
        msg = seed.__class__()
        msg.CopyFrom(seed)
        r = rng.random()
        if r >= 0.05:
            if r < 0.75 or not msg.DESCRIPTOR.fields:
                for _ in range(rng.choice([1, 1, 1, 2, 3])):
                    mutate_message(msg, rng)
            data = msg.SerializeToString()
            if r >= 0.6:
                for _ in range(rng.choice([1, 1, 2])):
                    data = damage(data, rng)
        else:
            data = msg.SerializeToString()
        if len(data) <= MAX_PAYLOAD_BYTES:
            return data
    return seed.SerializeToString()


def mutated_stream(seed: Sequence[Message], request: type, rng: random.Random) -> list[bytes]:
    """A short request stream from a seed stream: messages mutated, dropped, doubled or swapped."""
    msgs = list(seed)
    r = rng.random()
    if r < 0.3 and msgs:
        op = rng.randrange(6)
        if op == 0:
            msgs.pop(rng.randrange(len(msgs)))
        elif op == 1:
            i = rng.randrange(len(msgs))
            msgs.insert(i, msgs[i])
        elif op == 2 and len(msgs) > 1:
            i, j = rng.sample(range(len(msgs)), 2)
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif op == 3:
            msgs = msgs[: rng.randrange(len(msgs))]  # down to no message at all
        elif op == 4:
            msgs.insert(rng.randrange(len(msgs) + 1), request())
        else:
            msgs = msgs + [msgs[-1]] * rng.randint(1, MAX_STREAM_MESSAGES)
    msgs = msgs[:MAX_STREAM_MESSAGES]
    out = [m.SerializeToString() for m in msgs]
    if out and r >= 0.05:
        for _ in range(rng.choice([1, 1, 2])):
            i = rng.randrange(len(out))
            out[i] = mutated_bytes(msgs[i], rng)
    return out


# --- seeds -------------------------------------------------------------------------------------

SEED_ROWS = 4


@dataclass
class Facts:
    """What this mesh has, for realistic seeds."""

    device: object = None  # a common_pb2.Device of the first worker
    device_ids: list[str] = field(default_factory=list)
    worker_address: str = ""
    page_token: str = ""
    programs: list[tuple[str, str]] = field(default_factory=list)
    build: object = None  # a compile_pb.TargetBuild of identity for `device`, SEED_ROWS rows
    job_id: str = ""
    upload: bytes = b""  # a jax.export artifact
    objects: fuzz_objects.ObjectFacts | None = None  # the fuzz's tickets and objects in the worker's store
    notes: list[str] = field(default_factory=list)


def exported_double() -> bytes:
    """x * 2 over a symbolic batch of 4-wide float32 rows, serialized for the CPU."""
    import jax
    import jax.numpy as jnp

    b = jax.export.symbolic_shape("b")
    arg = jax.ShapeDtypeStruct((b[0], 4), jnp.float32)
    return bytes(jax.export.export(jax.jit(lambda x: (x * 2,)), platforms=["cpu"])(arg).serialize())


def gather_facts(mesh, callers: Callers) -> Facts:
    """Real ids from the running mesh: a device, a succeeded job, an artifact, the programs; the
    fuzz's tickets for the worker's object store and the objects the seeds name there."""
    from accelmesh.client import MeshClient
    from accelmesh.compile.v1 import compile_service_pb2 as compile_pb
    from accelmesh.compile.v1 import compile_service_pb2_grpc
    from accelmesh.inventory.v1 import inventory_service_pb2 as inv_pb
    from accelmesh.inventory.v1 import inventory_service_pb2_grpc

    facts = Facts(worker_address=mesh.workers[0].address)
    inventory = inventory_service_pb2_grpc.InventoryServiceStub(callers.channel("inventory", Role.OPERATOR))
    devices = [d for d in inventory.ListDevices(inv_pb.ListDevicesRequest(), timeout=30).devices]
    facts.device_ids = [d.id for d in devices]
    mine = [d for d in devices if d.node_address == facts.worker_address]
    facts.device = (mine or devices)[0]
    facts.page_token = inventory.ListDevices(inv_pb.ListDevicesRequest(page_size=1), timeout=30).next_page_token
    compile_stub = compile_service_pb2_grpc.CompileServiceStub(callers.channel("compile", Role.OPERATOR))
    facts.programs = [(p.name, p.version) for p in
                      compile_stub.ListPrograms(compile_pb.ListProgramsRequest(), timeout=30).programs]
    (facts.build,) = compile_stub.Compile(compile_pb.CompileRequest(
        program="identity", targets=[facts.device], batch_sizes=[SEED_ROWS]), timeout=300).builds
    x = np.arange(SEED_ROWS * 1024, dtype=np.float32).reshape(SEED_ROWS, 1024)
    with MeshClient(mesh.dispatch.address, security=callers.security(Role.OPERATOR)) as client:
        facts.job_id = client.run("identity", {"x": x}, timeout=300).job.job_id
    facts.objects = fuzz_objects.gather(callers, facts.worker_address)
    facts.notes += facts.objects.notes
    try:
        facts.upload = exported_double()
    except Exception as exc:  # noqa: BLE001 - no jax here: UploadProgram is fuzzed from a header alone
        facts.notes.append(f"no jax.export artifact for the UploadProgram seed: {type(exc).__name__}: {exc}")
    return facts


def seeds(facts: Facts) -> dict[str, list]:
    """Seed requests by "process.Method": a message each, or a list of messages for a client stream."""
    from accelmesh.client import job_spec, request_parts
    from accelmesh.compile.v1 import compile_service_pb2 as c
    from accelmesh.dispatch.v1 import dispatch_service_pb2 as d
    from accelmesh.dispatch.v1 import job_pb2, plan_pb2
    from accelmesh.inventory.v1 import inventory_service_pb2 as i
    from accelmesh.runtime.tensors import split
    from accelmesh.worker.v1 import worker_service_pb2 as w

    dev, ids = facts.device, facts.device_ids
    out: dict[str, list] = {}
    out["inventory.RegisterNode"] = [i.RegisterNodeRequest(address=facts.worker_address)]
    out["inventory.ListDevices"] = [i.ListDevicesRequest(filter='platform = "cpu" AND free_memory_bytes >= 1',
                                                         page_size=1),
                                    i.ListDevicesRequest(page_size=1, page_token=facts.page_token),
                                    i.ListDevicesRequest(filter="capabilities:bf16 AND emulated = true")]
    out["inventory.GetDevice"] = [i.GetDeviceRequest(device_id=dev.id, history_limit=5)]
    out["inventory.RefreshDevices"] = [i.RefreshDevicesRequest(device_ids=ids)]
    out["inventory.WatchDevices"] = [i.WatchDevicesRequest(include_existing=True),
                                     i.WatchDevicesRequest(filter='health = "lost"', include_existing=True)]
    task = i.TaskProfile(kind=i.TASK_KIND_TRAINING, precision="bf16", arithmetic_intensity=10,
                         weights=i.TaskWeights(compute=0.5, memory=0.3, bandwidth=0.2))
    out["inventory.ScoreDevices"] = [i.ScoreDevicesRequest(task=task, device_ids=ids, limit=2),
                                     i.ScoreDevicesRequest(task=i.TaskProfile(kind=i.TASK_KIND_INFERENCE),
                                                           filter="platform = cpu")]
    claim = i.DeviceClaim(device_id=dev.id, memory_bytes=1 << 20, compute_fraction=0.1)
    out["inventory.ReserveDevices"] = [i.ReserveDevicesRequest(job_id="fuzz-job", claims=[claim], ttl_seconds=5)]
    out["inventory.RenewReservations"] = [i.RenewReservationsRequest(job_id="fuzz-job", ttl_seconds=5,
                                                                     device_ids=[dev.id]),
                                          i.RenewReservationsRequest(job_id="fuzz-job")]
    out["inventory.ReleaseDevices"] = [i.ReleaseDevicesRequest(job_id="fuzz-job", device_ids=[dev.id])]
    out["inventory.ListReservations"] = [i.ListReservationsRequest(job_id="fuzz-job"),
                                         i.ListReservationsRequest(device_id=dev.id)]

    out["compile.DescribeProgram"] = [c.DescribeProgramRequest(name=n, version=v) for n, v in facts.programs]
    # Nested messages and enums by field and value name (as a message's constructor takes them):
    # right wherever the protos define their types.
    data = facts.upload or bytes(16)
    header = {"name": "fuzz-double", "version": "1", "input_names": ["x"], "description": "fuzz seed",
              "output_combine": ["COMBINE_RULE_CONCAT"], "total_bytes": len(data)}
    half = len(data) // 2
    out["compile.UploadProgram"] = [[c.UploadProgramRequest(header=header), c.UploadProgramRequest(chunk=data[:half]),
                                     c.UploadProgramRequest(chunk=data[half:])]]
    out["compile.DeleteProgram"] = [c.DeleteProgramRequest(name="fuzz-double", version="1")]
    out["compile.ExplainRule"] = [c.ExplainRuleRequest(device=dev)]
    build = facts.build
    out["compile.Compile"] = [
        c.CompileRequest(program="identity", targets=[dev], batch_sizes=[SEED_ROWS]),
        c.CompileRequest(program="mlp_classifier", targets=[dev], batch_sizes=[8],
                         inputs=[{"name": "x", "dtype": "DATA_TYPE_FLOAT32", "shape": [-1, 64]}]),
        c.CompileRequest(program="transformer_encoder", targets=[dev], layers={"first": 0, "count": 1}),
    ]
    artifacts = [a for a in [build.portable, *build.executables] if a.key]
    out["compile.FetchArtifact"] = [c.FetchArtifactRequest(key=a.key, chunk_bytes=65_536) for a in artifacts]
    out["compile.FetchParameters"] = [c.FetchParametersRequest(program="mlp_classifier", seed=1)]

    x = np.ones((SEED_ROWS, 1024), np.float32)
    identity = job_spec("identity", {"x": x}, name="fuzz")
    mlp_x = np.ones((8, 64), np.float32)
    mlp = job_spec("mlp_classifier", {"x": mlp_x}, max_devices=1,
                   placement=plan_pb2.PlacementOptions(strategy=plan_pb2.PLACEMENT_STRATEGY_AUTO, device_count=1))
    training = job_spec("mlp_train_step", {"x": mlp_x, "y": np.zeros(8, np.int32)},
                        training=job_pb2.TrainingOptions(epochs=1, batch_size=4, learning_rate=0.1))
    out["dispatch.PlanJob"] = [d.PlanJobRequest(spec=identity), d.PlanJobRequest(spec=mlp),
                               d.PlanJobRequest(spec=training)]
    for method, cls in (("SubmitJob", d.SubmitJobRequest), ("RunJob", d.RunJobRequest)):
        out[f"dispatch.{method}"] = [[cls(**{k: v}) for k, v in request_parts(spec, inputs, None, 8192)]
                                     for spec, inputs in ((identity, {"x": x}), (mlp, {"x": mlp_x}))]
    # DATA_PATH_DIRECT: no rows on the stream, `stored` parts saying which shards' inputs the client
    # put (none of these did: the dispatcher's put_inputs go unanswered, or name shards never asked).
    direct = job_spec("identity", {"x": x}, name="fuzz-direct", data_path="direct")
    direct_mlp = job_spec("mlp_classifier", {"x": mlp_x}, max_devices=1, data_path="direct")
    direct_params = job_spec("mlp_classifier", {"x": mlp_x}, client_parameters=True, data_path="direct")
    training_direct = job_pb2.JobSpec()
    training_direct.CopyFrom(training)
    training_direct.data_path = job_pb2.DATA_PATH_DIRECT
    w_header, w_chunks = split("w", np.zeros((64, 10), np.float32), 8192)
    stored = d.InputsStored
    out["dispatch.RunJob"] += [
        [d.RunJobRequest(spec=direct, accept_batches=True)],
        [d.RunJobRequest(spec=direct, accept_batches=True), d.RunJobRequest(stored=stored())],
        [d.RunJobRequest(spec=direct), d.RunJobRequest(stored=stored(shard_indexes=[0]))],
        [d.RunJobRequest(spec=direct), d.RunJobRequest(stored=stored()),
         d.RunJobRequest(stored=stored(shard_indexes=[7, 99, -1, 2**31 - 1]))],  # never asked
        [d.RunJobRequest(spec=direct), *(d.RunJobRequest(**{k: v})
                                         for k, v in request_parts(identity, {"x": x}, None, 8192) if k != "spec")],
        [d.RunJobRequest(spec=direct_mlp), d.RunJobRequest(stored=stored())],
        [d.RunJobRequest(spec=direct_params), d.RunJobRequest(parameter=w_header),
         *(d.RunJobRequest(parameter_chunk=c) for c in w_chunks), d.RunJobRequest(stored=stored(shard_indexes=[0]))],
        [d.RunJobRequest(spec=training_direct)],  # training: refused before reserving
    ]
    out["dispatch.SubmitJob"].append([d.SubmitJobRequest(spec=direct)])  # RunJob only
    out["dispatch.PlanJob"].append(d.PlanJobRequest(spec=direct))
    for method, cls in (("WatchJob", d.WatchJobRequest), ("GetJob", d.GetJobRequest), ("CancelJob", d.CancelJobRequest),
                        ("FetchResult", d.FetchResultRequest)):
        out[f"dispatch.{method}"] = [cls(job_id=facts.job_id)]
    out["dispatch.ListJobs"] = [d.ListJobsRequest(page_size=5)]

    out["worker.DescribeNode"] = [w.DescribeNodeRequest(device_ids=[dev.id])]
    artifact = build.executables[0] if build.executables else build.portable
    shard = w.ShardHeader(job_id="fuzz-job", shard_index=0, attempt=1, device_id=dev.id, target_type=build.target_type,
                          artifact_key=artifact.key, artifact_digest=artifact.digest,
                          artifact_format=artifact.format, rule=build.rule, input_count=1, batch_size=SEED_ROWS)
    tensor, chunks = split("x", x, 8192)
    chunks = list(chunks)  # for Execute's seeds and ExecuteMany's
    parts = [w.ExecuteRequest(tensor=tensor), *(w.ExecuteRequest(chunk=chunk) for chunk in chunks)]
    keep = w.ShardHeader()
    keep.CopyFrom(shard)
    keep.report_stages = True
    keep.keep_tensors.append(w.TensorRef(name="x", key="fuzz-x"))
    out["worker.Execute"] = [[w.ExecuteRequest(header=shard), *parts], [w.ExecuteRequest(header=keep), *parts],
                             [w.ExecuteRequest(header=shard),
                              w.ExecuteRequest(held=w.TensorRef(name="x", key="fuzz-x"))]]
    many_parts = [w.ExecuteManyRequest(tensor=tensor), *(w.ExecuteManyRequest(chunk=c) for c in chunks)]
    out["worker.ExecuteMany"] = [[w.ExecuteManyRequest(header=shard), *many_parts],
                                 [w.ExecuteManyRequest(header=shard), *many_parts,
                                  w.ExecuteManyRequest(header=shard), *many_parts]]
    if facts.objects is not None:  # shards on stored inputs, outputs kept in the store (fuzz_objects.py)
        heads = fuzz_objects.shard_variants(w, shard, facts.objects)
        sent = {"stored_and_sent", "out", "out_no_scope"}  # these send x in the call too
        out["worker.Execute"] += [[w.ExecuteRequest(header=heads[name]), *(parts if name in sent else [])]
                                  for name in ("stored", "stored_missing", "stored_twice", "stored_no_scope",
                                               "stored_other_scope", "stored_and_sent", "out_no_scope")]
        out["worker.ExecuteMany"] += [[w.ExecuteManyRequest(header=heads[name]), *(many_parts if name in sent else [])]
                                      for name in heads]
        out["worker.ExecuteMany"].append([w.ExecuteManyRequest(header=heads["stored"]),
                                          w.ExecuteManyRequest(header=heads["stored_missing"]),
                                          w.ExecuteManyRequest(header=heads["out_no_scope"]), *many_parts])
        out.update(fuzz_objects.object_seeds(facts.objects))
    return out


# --- calling -----------------------------------------------------------------------------------


class Callers:
    """One channel per (process, caller role), with that role's credentials."""

    def __init__(self, mesh, credentials: MeshCredentials):
        self._mesh, self._credentials = mesh, credentials
        self._addresses = {"inventory": mesh.inventory.address, "compile": mesh.compile.address,
                           "dispatch": mesh.dispatch.address, "worker": mesh.workers[0].address}
        self._roles = {a.process: a.role for a in AREAS}
        self._channels: dict[tuple[str, Role], grpc.Channel] = {}
        self._user_token = None
        self._lock = threading.Lock()

    def address(self, process: str) -> str:
        return self._addresses[process]

    def security(self, role: Role):
        if role is Role.OPERATOR:
            return self._credentials.client()
        if role is Role.USER:
            if self._user_token is None:
                self._user_token = self._credentials.add_user("fuzz-user")
            return self._credentials.client(self._user_token)
        return self._credentials.service(role)

    def channel(self, process: str, role: Role) -> grpc.Channel:
        with self._lock:
            key = (process, role)
            if key not in self._channels:
                server_role = None if role in PEOPLE else self._roles[process]  # services check whom they dial
                self._channels[key] = open_channel(self._addresses[process], security=self.security(role),
                                                   role=server_role)
            return self._channels[key]

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


@dataclass
class Outcome:
    code: str  # a status code name, or CANCELLED_BY_FUZZER
    details: str


def _drain(call, inspect: Callable[[bytes], Outcome | None] | None = None) -> Outcome | None:
    """Read a response stream until it ends, goes quiet for STREAM_IDLE_S or passes MAX_STREAM_RESPONSES;
    `inspect` may find an answer inside a response (the first it finds is the call's outcome)."""
    ours = threading.Event()
    timer: list[threading.Timer] = []

    def cancel():
        ours.set()
        call.cancel()

    def arm():
        if timer:
            timer.pop().cancel()
        t = threading.Timer(STREAM_IDLE_S, cancel)
        t.daemon = True
        t.start()
        timer.append(t)

    arm()
    found = None
    try:
        for count, response in enumerate(call, 1):
            if inspect is not None and found is None:
                found = inspect(response)
            if count >= MAX_STREAM_RESPONSES:
                cancel()
                break
            arm()
    except grpc.RpcError as exc:
        if found is not None:
            return found
        if ours.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
            return Outcome("CANCELLED_BY_FUZZER", "")
        raise
    finally:
        if timer:
            timer.pop().cancel()
    return found or (Outcome("CANCELLED_BY_FUZZER", "") if ours.is_set() else None)


_UNTYPED = {grpc.StatusCode.INTERNAL.value[0]: "INTERNAL", grpc.StatusCode.UNKNOWN.value[0]: "UNKNOWN"}


def _shard_failures(data: bytes) -> Outcome | None:
    """An ExecuteMany answer's ShardFailure (alone or in a batch) whose code is INTERNAL or UNKNOWN:
    a shard's error that escaped untyped, which the stream's OK status would hide."""
    from accelmesh.worker.v1 import worker_service_pb2 as w

    try:
        response = w.ExecuteManyResponse.FromString(data)
    except DecodeError:
        return Outcome("UNDECODABLE_RESPONSE", data[:64].hex())
    parts = response.batch.parts if response.WhichOneof("part") == "batch" else [response]
    for part in parts:
        if part.WhichOneof("part") == "failure" and part.failure.code in _UNTYPED:
            return Outcome(_UNTYPED[part.failure.code], f"in a ShardFailure: {part.failure.message}")
    return None


INSPECTED = {"worker.ExecuteMany": _shard_failures}  # response streams whose messages can hide a finding


def call_raw(channel: grpc.Channel, method: Method, payload: bytes | list[bytes]) -> Outcome:
    """One call with raw bytes (no serializers): the status the server answered."""
    try:
        if method.client_streaming and method.server_streaming:
            done = _drain(channel.stream_stream(method.path)(iter(payload), timeout=DEADLINE_S),
                          INSPECTED.get(method.label))
        elif method.client_streaming:
            channel.stream_unary(method.path)(iter(payload), timeout=DEADLINE_S)
            done = None
        elif method.server_streaming:
            done = _drain(channel.unary_stream(method.path)(payload, timeout=DEADLINE_S))
        else:
            channel.unary_unary(method.path)(payload, timeout=DEADLINE_S)
            done = None
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "")
    return done or Outcome("OK", "")


def decodes(method: Method, payload: bytes | list[bytes]) -> bool:
    try:
        for data in payload if isinstance(payload, list) else [payload]:
            method.request.FromString(data)
    except DecodeError:
        return False
    return True


def _hex(payload: bytes | list[bytes], limit: int = 256):
    if isinstance(payload, list):
        return {"messages": len(payload), "hex": [p[:limit // 2].hex() for p in payload[:4]],
                "bytes": [len(p) for p in payload]}
    return {"bytes": len(payload), "hex": payload[:limit].hex()}


@dataclass
class MethodStats:
    caller: str
    calls: int = 0
    decoded: int = 0  # requests whose every message decodes: they reached the handler
    codes: Counter = field(default_factory=Counter)
    undecodable: int = 0
    refused: int = 0
    ticket_refused: int = 0  # a method authorised by ticket: refused by the ticket check (its handler's own)
    findings: list[dict] = field(default_factory=list)
    finding_count: int = 0  # INTERNAL or UNKNOWN from the service
    status_lost: int = 0  # the service's status never reached the caller (trailers too big)
    examples: dict[str, str] = field(default_factory=dict)  # code -> the first details seen with it
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {"caller": self.caller, "calls": self.calls, "decoded": self.decoded,
                "codes": dict(sorted(self.codes.items())),
                "undecodable_internal": self.undecodable, "refused": self.refused,
                "ticket_refused": self.ticket_refused, "findings": self.finding_count,
                "status_lost": self.status_lost,
                "wall_s": round(self.wall_s, 1), "examples": dict(sorted(self.examples.items()))}


def _server_log(process, details: str) -> list[str]:
    """The service's log lines for the incident a generic INTERNAL names (its traceback)."""
    match = re.search(r"incident ([0-9a-f]+)", details)
    if process is None or not match:
        return []
    lines = list(process.output)
    for n, line in enumerate(lines):
        if f"incident {match[1]}" in line:
            tail = []
            for follow in lines[n + 1: n + 60]:
                if re.match(r"^\d{4}-\d\d-\d\d ", follow):  # the next log record
                    break
                tail.append(follow)
            return [line, *tail[-25:]]
    return []


class Fuzzer:
    def __init__(self, mesh, *, seed: int = 0, progress: Callable[[str], None] = lambda _message: None,
                 only: Sequence[str] = ()):
        self.mesh, self.seed, self.progress = mesh, seed, progress
        self.only = frozenset(only)  # processes whose methods `run` calls; empty: all
        self.callers = Callers(mesh, mesh.credentials)
        self.methods = methods()
        self.facts = gather_facts(mesh, self.callers)
        self.seeds = seeds(self.facts)
        self.phases: dict[str, dict[str, MethodStats]] = {}  # phase -> "process.Method" -> its stats
        self._lock = threading.Lock()

    def process(self, name: str):
        return self.mesh.workers[0] if name == "worker" else getattr(self.mesh, name)

    def payload(self, method: Method, rng: random.Random) -> bytes | list[bytes]:
        choices = self.seeds.get(method.label) or [[method.request()] if method.client_streaming else method.request()]
        seed = rng.choice(choices)
        if method.client_streaming:
            return mutated_stream(seed, method.request, rng)
        return mutated_bytes(seed, rng)

    def run(self, phase: str, per_method: int, first_index: int = 0) -> None:
        """`per_method` calls of every method; call k's payload comes from Random(seed:method:k)."""
        phase_stats = self.phases.setdefault(phase, {})
        for method in self.methods:
            if self.only and method.area.process not in self.only:
                continue
            if method.allowed is None or not method.allowed:
                phase_stats.setdefault(method.label, MethodStats(caller="nobody: not in the access table"))
                continue
            role = caller_role(method.allowed)
            stats = phase_stats.setdefault(method.label, MethodStats(caller=role.value))
            channel = self.callers.channel(method.area.process, role)
            started = time.perf_counter()

            def one(index: int, method=method, stats=stats, channel=channel) -> None:
                rng = random.Random(f"{self.seed}:{method.label}:{index}")
                payload = self.payload(method, rng)
                outcome = call_raw(channel, method, payload)
                self._record(method, stats, index, payload, outcome)

            workers = STREAM_CONCURRENCY if method.server_streaming else CONCURRENCY
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fuzz") as pool:
                list(pool.map(one, range(first_index, first_index + per_method)))
            stats.wall_s += time.perf_counter() - started
            self.progress(f"{phase}: {method.label} as {role.value}: {per_method} calls in "
                          f"{time.perf_counter() - started:.1f} s, {_brief(stats.codes)}")
        self.settle()

    def _record(self, method: Method, stats: MethodStats, index: int, payload, outcome: Outcome) -> None:
        decoded = decodes(method, payload)
        with self._lock:
            stats.calls += 1
            stats.decoded += decoded
            stats.codes[outcome.code] += 1
            if outcome.code != "OK" and outcome.code not in stats.examples:
                stats.examples[outcome.code] = outcome.details[:200]
            if outcome.code in ("INTERNAL", "UNKNOWN"):
                stats.finding_count += 1
                kind = "internal"
                if outcome.code == "INTERNAL" and outcome.details == UNDECODABLE:
                    stats.undecodable += 1  # gRPC's own answer: no interceptor took the bytes
                    kind = "undecodable"
                self._keep(method, stats, index, payload, outcome, decoded, kind)
            elif outcome.code == "RESOURCE_EXHAUSTED" and STATUS_LOST in outcome.details:
                stats.status_lost += 1
                self._keep(method, stats, index, payload, outcome, decoded, "status_lost")
            elif method.allowed is BY_TICKET and outcome.code in ("UNAUTHENTICATED", "PERMISSION_DENIED") \
                    and "ticket" in outcome.details:
                stats.ticket_refused += 1  # no access check runs first: the ticket is the handler's to check
            elif outcome.code == "UNAUTHENTICATED" or (
                    outcome.code == "PERMISSION_DENIED" and "needs the role" in outcome.details):
                stats.refused += 1

    def _keep(self, method: Method, stats: MethodStats, index: int, payload, outcome: Outcome, decoded: bool,
              kind: str) -> None:
        if len(stats.findings) >= FINDINGS_KEPT_PER_METHOD:
            return
        stats.findings.append({"kind": kind, "process": method.area.process, "method": method.name,
                               "code": outcome.code, "details": outcome.details[:1000], "index": index,
                               "decoded": decoded, "payload": _hex(payload),
                               "server_log": _server_log(self.process(method.area.process), outcome.details)})
        self.progress(f"FINDING ({kind}) {method.label} #{index}: {outcome.code} {outcome.details[:300]!r} "
                      f"payload {_hex(payload, 64)}")

    def settle(self, timeout_s: float = 60.0) -> None:
        """Until the dispatcher runs no job the fuzz started, then reservations the fuzz made are released."""
        from accelmesh.dispatch.v1 import dispatch_service_pb2 as d
        from accelmesh.dispatch.v1 import dispatch_service_pb2_grpc, job_pb2

        stub = dispatch_service_pb2_grpc.DispatchServiceStub(self.callers.channel("dispatch", Role.OPERATOR))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                jobs = stub.ListJobs(d.ListJobsRequest(page_size=1000), timeout=10).jobs
            except grpc.RpcError:
                break
            if all(job_pb2.JobState.Name(j.state) in FINAL_JOB_STATES for j in jobs):
                break
            time.sleep(0.5)
        self.release_reservations()
        trouble = fuzz_objects.restore(self.callers, self.facts.objects)
        if trouble:
            self.progress(trouble)

    def release_reservations(self) -> int:
        from accelmesh.inventory.v1 import inventory_service_pb2 as i
        from accelmesh.inventory.v1 import inventory_service_pb2_grpc

        stub = inventory_service_pb2_grpc.InventoryServiceStub(self.callers.channel("inventory", Role.DISPATCH))
        released = 0
        try:
            held = stub.ListReservations(i.ListReservationsRequest(), timeout=10).reservations
            for job_id in {r.job_id for r in held}:
                released += stub.ReleaseDevices(i.ReleaseDevicesRequest(job_id=job_id), timeout=10).released_count
        except grpc.RpcError as exc:
            self.progress(f"could not release the fuzz's reservations: {exc.code().name} {exc.details()}")
        return released

    def health(self) -> dict[str, dict]:
        """Each process: still running, and its health service says SERVING for all and for its service."""
        out = {}
        for area in AREAS:
            process = self.process(area.process)
            services = sorted({m.service for m in self.methods if m.area is area})
            statuses = {}
            with open_channel(process.address, security=self.callers.security(Role.OPERATOR)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ["", *services]:
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                        statuses[service or "(server)"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                    except grpc.RpcError as exc:
                        statuses[service or "(server)"] = exc.code().name
            alive = process.process.poll() is None
            out[area.process] = {"alive": alive, "health": statuses,
                                 "healthy": alive and all(s == "SERVING" for s in statuses.values())}
            if not alive:
                out[area.process].update(exit_code=process.process.returncode, output_tail=list(process.output)[-30:])
        return out

    def rss(self) -> dict[str, int]:
        return {area.process: rss_bytes(self.process(area.process).process.pid) for area in AREAS}

    def close(self) -> None:
        self.callers.close()


def _brief(codes: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in codes.most_common())


def settled_rss(fuzzer: Fuzzer) -> dict[str, int]:
    """Each process's VmRSS once a trim pass has run since the calls ended: the services hand
    freed memory back every TRIM_INTERVAL_S (accelmesh/runtime/memory.py), and what is measured
    is what they hold, not what they have yet to hand back."""
    time.sleep(TRIM_INTERVAL_S + 0.5)
    return fuzzer.rss()


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (VmRSS)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0
    return 0


def summary(fuzzer: Fuzzer, health: dict, rss_before: dict | None, rss_after: dict | None, *, phase: str = "fuzz",
            max_rss_ratio: float = 1.10) -> dict:
    """Per process: the calls and status codes of `phase`, findings of every phase, health,
    memory; and the verdicts over them all."""
    processes, findings = {}, []
    every = [s for stats in fuzzer.phases.values() for s in stats.values()]
    for stats in every:
        findings.extend(stats.findings)
    main = fuzzer.phases.get(phase, {})
    for area in AREAS:
        mine = {m.name: main[m.label] for m in fuzzer.methods if m.area is area and m.label in main}
        codes = Counter()
        for stats in mine.values():
            codes.update(stats.codes)
        entry = {
            "calls": sum(s.calls for s in mine.values()),
            "codes": dict(sorted(codes.items())),
            "findings": sum(s.finding_count for s in mine.values()),
            "undecodable_internal": sum(s.undecodable for s in mine.values()),
            **health[area.process],
            "methods": {name: s.as_dict() for name, s in mine.items()},
        }
        if rss_before is not None and rss_after is not None:
            before, after = rss_before[area.process], rss_after[area.process]
            entry.update(rss_before_mib=round(before / 2**20, 1), rss_after_mib=round(after / 2**20, 1),
                         rss_ratio=round(after / before, 3) if before else None)
        processes[area.process] = entry
    uncovered = [m.label for m in fuzzer.methods if not m.allowed]
    refused = Counter()
    for stats in fuzzer.phases.values():
        refused.update({label: s.refused for label, s in stats.items() if s.refused})
    ratios = [p["rss_ratio"] for p in processes.values() if p.get("rss_ratio") is not None]
    return {
        "methods": len(fuzzer.methods),
        "calls": sum(p["calls"] for p in processes.values()),
        "calls_by_phase": {name: sum(s.calls for s in stats.values()) for name, stats in fuzzer.phases.items()},
        "finding_count": sum(s.finding_count for s in every),
        "status_lost_count": sum(s.status_lost for s in every),
        "undecodable_internal": sum(p["undecodable_internal"] for p in processes.values()),
        "healthy": all(p["healthy"] for p in processes.values()),
        "rss_within_10_percent": all(r <= max_rss_ratio for r in ratios) if ratios else None,
        "max_rss_ratio": max(ratios) if ratios else None,
        "uncovered_methods": uncovered,
        "refused_by_access": dict(refused),
        "seed_notes": fuzzer.facts.notes,
        "processes": processes,
        "findings": findings,
    }


def fuzz(mesh, per_method: int, *, warmup: int = 0, seed: int = 0, progress: Callable[[str], None] = lambda _m: None,
         measure_memory: bool = True, only: Sequence[str] = ()) -> dict:
    """Warm up (`warmup` calls a method), take each process's RSS, fuzz `per_method` calls a
    method, take it again, check health: the summary() of it all. `only`: the processes whose
    methods are called (all when empty); every process's health and memory are read still."""
    fuzzer = Fuzzer(mesh, seed=seed, progress=progress, only=only)
    try:
        if warmup:
            fuzzer.run("warm-up", warmup, first_index=per_method)
        rss_before = settled_rss(fuzzer) if measure_memory else None
        fuzzer.run("fuzz", per_method)
        rss_after = settled_rss(fuzzer) if measure_memory else None
        health = fuzzer.health()
        return summary(fuzzer, health, rss_before, rss_after)
    finally:
        fuzzer.close()


__all__ = ["AREAS", "Fuzzer", "Method", "caller_role", "damage", "fuzz", "methods", "mutated_bytes",
           "mutated_stream", "rss_bytes", "summary"]
