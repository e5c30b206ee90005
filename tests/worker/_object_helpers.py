"""Shared by the object-store method tests (test_object_methods.py): an in-process worker with a
store of its own in a test folder, tickets signed by the session's dispatcher certificate (or
forged with another role's), the messages of a put, a fetch collected into arrays, and the
google.rpc details of a refusal. A module of its own, not a conftest.py: a second conftest.py
would shadow the top-level one that tests import as `conftest`."""

from __future__ import annotations

import base64
import contextlib

import grpc
import jax
import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.tensors import TensorAssembler, split
from accelmesh.security.config import INSECURE, Security
from accelmesh.security.identity import Role
from accelmesh.security.tickets import TicketSigner, expiring_ticket
from accelmesh.worker.v1 import worker_service_pb2 as pb
from accelmesh.worker.v1 import worker_service_pb2_grpc
from worker_svc.agent import NodeAgent
from worker_svc.config import WorkerConfig
from worker_svc.server import build_worker

from conftest import CREDENTIALS
from fakes import host
from fakes.nvml import FakeNvml

CALL_TIMEOUT_S = 60.0
NODE = "127.0.0.1"  # the worker listens there, so it is its node ip
TENANT = "user:alice"
SIGNER = TicketSigner(CREDENTIALS.service(Role.DISPATCH))


def object_worker(root, *, store_bytes: int, compile_address: str = "127.0.0.1:1"):
    """A started worker on this process's first CPU device (described as a CPU without bf16, so
    programs run in fp32 and come back exact) whose store lives under `root`, and which refuses
    at once (store_wait_s=0) a put that does not fit."""
    (root / "store").mkdir()
    agent = NodeAgent(NODE, jax_devices=jax.devices("cpu")[:1], nvml=FakeNvml([]),
                      proc_root=str(host.proc_root(host.FP32_CPU)), env={}, hostname="node-objects")
    config = WorkerConfig(listen=f"{NODE}:0", store_bytes=store_bytes, store_root=str(root / "store"),
                          store_wait_s=0.0, artifact_dir=str(root / "artifacts"), compile=compile_address)
    return build_worker(config, agent=agent).start()


@contextlib.contextmanager
def stub_for(server, security: Security):
    """A stub over mutual TLS with `security`'s certificate (and token, where it has one)."""
    with open_channel(f"{NODE}:{server.port}", security=security) as channel:
        yield worker_service_pb2_grpc.WorkerServiceStub(channel)


def ticket(direction: str, job: str, *, prefix: str = "", tenant: str = TENANT, node: str = NODE,
           lifetime_s: float = 600.0) -> bytes:
    return SIGNER.sign(expiring_ticket(tenant, job, node, direction, prefix=prefix, lifetime_s=lifetime_s))


def _b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def forged_ticket(security: Security, direction: str, job: str) -> bytes:
    """A well-formed ticket signed with `security`'s key and certificate (TicketSigner signs only
    with a dispatcher's, so it is built by hand as tests/shared/test_tickets.py does)."""
    key = serialization.load_pem_private_key(security.tls.key_file.read_bytes(), password=None)
    der = x509.load_pem_x509_certificate(security.tls.cert_file.read_bytes()).public_bytes(serialization.Encoding.DER)
    unsigned = TicketSigner(INSECURE).sign(expiring_ticket(TENANT, job, NODE, direction))[:-2]
    return unsigned + b"." + _b64(key.sign(unsigned, ec.ECDSA(hashes.SHA256()))) + b"." + _b64(der)


def put_messages(token: bytes, objects: dict[str, np.ndarray], chunk_bytes: int = 1000):
    """PutObjects' stream: the ticket, then each object's header and chunks (none for 0 bytes, as
    accelmesh/object_client.py sends it)."""
    yield pb.PutObjectsRequest(ticket=token)
    for object_id, array in objects.items():
        header, chunks = split(object_id, array, chunk_bytes)
        yield pb.PutObjectsRequest(object=header)
        if array.nbytes:
            yield from (pb.PutObjectsRequest(chunk=chunk) for chunk in chunks)


def fetched(stub, token: bytes, object_ids) -> dict[str, np.ndarray]:
    assemblers: dict[str, TensorAssembler] = {}
    for message in stub.FetchObjects(pb.FetchObjectsRequest(ticket=token, object_ids=list(object_ids)),
                                     timeout=CALL_TIMEOUT_S):
        if message.WhichOneof("part") == "object":
            current = assemblers[message.object.name] = TensorAssembler(message.object, "object")
        else:
            current.add(message.chunk)
    return {name: assembler.result() for name, assembler in assemblers.items()}


def details(error: grpc.RpcError) -> tuple[str, dict[str, str], list[str]]:
    """A refusal's ErrorInfo reason and metadata ("" and {} without one) and its BadRequest fields."""
    reason, metadata, fields = "", {}, []
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Unpack(bad):
            fields += [violation.field for violation in bad.field_violations]
    return reason, metadata, fields
