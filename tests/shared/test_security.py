"""The mesh's credentials in-process: certificates and the identity they name, static tokens and
JWTs, where a process finds its credentials, and certificates renewed under a running server."""

from __future__ import annotations

import time

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accelmesh import errors
from accelmesh.runtime.channels import open_channel
from accelmesh.runtime.server import Service, create_server
from accelmesh.security.access import ANYONE, BY_TICKET
from accelmesh.security.ca import CertificateAuthority
from accelmesh.security.config import INSECURE, Security, check_listen, security_from_env
from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.identity import Role, certificate_identity
from accelmesh.security.tls import TlsFiles
from accelmesh.security.tokens import JwtSettings, JwtVerifier, StaticTokens


def test_a_certificate_names_its_role_name_and_hosts(tmp_path):
    issued = CertificateAuthority(tmp_path).issue(Role.WORKER, "node-7", ["10.0.0.7", "node-7.example"])
    identity = certificate_identity(issued.cert_file.read_bytes())
    assert (identity.role, identity.name) == (Role.WORKER, "node-7")
    assert identity.names_host("10.0.0.7") and identity.names_host("NODE-7.example")
    assert identity.names_host("worker.accelmesh.internal")  # the name services dial workers by
    assert not identity.names_host("10.0.0.8")
    assert oct(issued.key_file.stat().st_mode & 0o777) == "0o600"


def test_static_tokens_keep_digests_only_and_take_changes_at_once(tmp_path):
    tokens = StaticTokens(tmp_path / "tokens.json")
    alice = tokens.add("alice", Role.USER)
    assert alice not in (tmp_path / "tokens.json").read_text()
    assert tokens.principal(alice).key == "user:alice"
    assert tokens.principal(alice + "x") is None
    bob = tokens.add("bob", Role.OPERATOR)  # a running server reads the file again on its next call
    assert tokens.principal(bob).key == "operator:bob"
    with pytest.raises(errors.InvalidArgument, match="certificates"):
        tokens.add("svc", Role.DISPATCH)  # people only: services prove themselves with certificates


@pytest.fixture
def idp(tmp_path):
    """A stand-in identity provider: an EC key pair, its public half where the mesh is told to look."""
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "idp.pem").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    verifier = JwtVerifier(JwtSettings(tmp_path / "idp.pem", issuer="https://idp.example"))

    def sign(claims: dict, signer=key) -> str:
        base = {"iss": "https://idp.example", "aud": "accelmesh", "sub": "carol", "exp": time.time() + 600}
        return jwt.encode({**base, **claims}, signer, algorithm="ES256")

    return verifier, sign


def test_a_jwt_from_the_identity_provider_names_its_subject_and_role(idp):
    verifier, sign = idp
    assert verifier.principal(sign({"roles": ["user"]})).key == "user:carol"
    assert verifier.principal(sign({"roles": "operator"})).key == "operator:carol"
    assert verifier.principal("not-a-jwt") is None  # a static token, for the next source to try


@pytest.mark.parametrize("claims, words", [
    ({"exp": 1}, "expired"),
    ({"aud": "someone-else"}, "(?i)audience"),
    ({"iss": "https://evil.example"}, "issuer"),
    ({"roles": ["admin"]}, "no accelmesh role"),
])
def test_a_jwt_that_does_not_verify_is_unauthenticated(idp, claims, words):
    verifier, sign = idp
    with pytest.raises(errors.Unauthenticated, match=words):
        verifier.principal(sign({"roles": ["user"], **claims}))


def test_a_jwt_signed_by_another_key_is_unauthenticated(idp):
    verifier, sign = idp
    with pytest.raises(errors.Unauthenticated, match="not accepted"):
        verifier.principal(sign({"roles": ["operator"]}, signer=ec.generate_private_key(ec.SECP256R1())))


def test_a_process_without_credentials_is_told_which_to_set(tmp_path):
    env = {"ACCELMESH_CREDENTIALS_DIR": str(tmp_path / "none")}
    with pytest.raises(errors.FailedPrecondition, match="ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE"):
        security_from_env(Role.DISPATCH, env)
    assert security_from_env(Role.DISPATCH, {**env, "ACCELMESH_INSECURE": "1"}) is INSECURE


def test_the_credentials_folder_serves_each_role_its_own_files(tmp_path):
    MeshCredentials(tmp_path)
    env = {"ACCELMESH_CREDENTIALS_DIR": str(tmp_path)}
    worker = security_from_env(Role.WORKER, env)
    assert worker.tls.cert_file == tmp_path / "worker.crt" and worker.tokens_file == tmp_path / "tokens.json"
    client = security_from_env(Role.CLIENT, env)
    assert client.tls.cert_file == tmp_path / "client.crt" and client.token_file == tmp_path / "token"
    explicit = security_from_env(Role.CLIENT, {**env, "ACCELMESH_TOKEN_FILE": str(tmp_path / "mine")})
    assert explicit.token_file == tmp_path / "mine"


@pytest.mark.parametrize("address, refused", [
    ("127.0.0.1:0", False), ("localhost:50051", False), ("[::1]:0", False),
    ("0.0.0.0:50051", True), ("10.0.0.7:50051", True),
])
def test_plaintext_is_refused_off_loopback(address, refused):
    if refused:
        with pytest.raises(errors.InvalidArgument, match="refused on"):
            check_listen(INSECURE, address)
    else:
        check_listen(INSECURE, address)


def _check(address: str, security: Security) -> grpc.StatusCode:
    with open_channel(address, security=security) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    """The server's files are replaced by ones from a new CA: connections made after that present
    the new certificate, so a client that trusts only the new CA gets in."""
    old, new = MeshCredentials(tmp_path / "old"), MeshCredentials(tmp_path / "new")
    served = TlsFiles(tmp_path / "served-ca.crt", tmp_path / "served.crt", tmp_path / "served.key")
    for source, target in zip(old.files("compile").__dict__.values(), served.__dict__.values()):
        target.write_bytes(source.read_bytes())
    service = Service("accelmesh.test.v1.Nothing", lambda servicer, server: None, None)
    server = create_server([service], security=Security(served), access={"Nothing": ANYONE}).start()
    try:
        address = f"127.0.0.1:{server.port}"
        assert _check(address, old.client()) == grpc.StatusCode.OK
        assert _check(address, new.client()) == grpc.StatusCode.UNAVAILABLE
        for source, target in zip(new.files("compile").__dict__.values(), served.__dict__.values()):
            target.write_bytes(source.read_bytes())
        assert _check(address, new.client()) == grpc.StatusCode.OK
        assert _check(address, old.client()) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


@pytest.mark.parametrize("module, service", [
    ("inventory", "accelmesh.inventory.v1.InventoryService"), ("compile", "accelmesh.compile.v1.CompileService"),
    ("dispatch", "accelmesh.dispatch.v1.DispatchService"), ("worker", "accelmesh.worker.v1.WorkerService"),
])
def test_every_method_of_every_service_has_an_access_entry_and_none_is_open_to_clients(module, service):
    """A method missing from the table is refused to everyone; one listed must not admit a bare client
    certificate, unless each call is authorised by the ticket it carries (a worker's object-store
    methods: tests/worker/test_object_methods.py refuses every call without a valid one)."""
    import importlib

    from google.protobuf import descriptor_pool

    access = importlib.import_module(f"{module}_svc.server").ACCESS
    importlib.import_module(f"{module}_svc.server")  # registers the service's descriptors
    methods = {m.name for m in descriptor_pool.Default().FindServiceByName(service).methods}
    assert set(access) == methods
    assert all(roles is BY_TICKET or (Role.CLIENT not in roles and roles) for roles in access.values())
    ticketed = {name for name, roles in access.items() if roles is BY_TICKET}
    assert ticketed <= {"PutObjects", "FetchObjects", "MapObjects", "SealObjects", "ReleaseObjects"}
