"""Tickets for direct puts and fetches at a worker (security/tickets.py): the dispatcher signs,
the worker verifies the signer's certificate against the mesh CA, the signature, the expiry, and
that the ticket covers this direction, this node and these object ids. CAs and certificates are
made in tmp_path; the clock is a fake one; no server, no mesh."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from accelmesh import errors
from accelmesh.security.ca import CertificateAuthority
from accelmesh.security.config import INSECURE, Security
from accelmesh.security.identity import Role, spiffe_id
from accelmesh.security.tickets import (
    DEFAULT_TICKET_S,
    GET,
    MAX_TICKET_BYTES,
    PUT,
    Ticket,
    TicketSigner,
    TicketVerifier,
    directly_issued,
    expiring_ticket,
)
from accelmesh.security.tls import TlsFiles

NODE = "10.0.0.7"
NOW = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _security(ca: CertificateAuthority, role: Role, name: str) -> Security:
    issued = ca.issue(role, name, stem=f"{role.value}-{name}")
    return Security(TlsFiles(ca.cert_file, issued.cert_file, issued.key_file))


@pytest.fixture
def mesh(tmp_path):
    """A mesh CA with its dispatcher's and a worker's security, and a clock a few minutes on."""
    ca = CertificateAuthority(tmp_path / "ca")
    clock = Clock(time.time() + 60)
    return ca, _security(ca, Role.DISPATCH, "dispatch"), _security(ca, Role.WORKER, "node-7"), clock


def _ticket(clock, *, direction=PUT, prefix="in/", lifetime_s=DEFAULT_TICKET_S) -> Ticket:
    return expiring_ticket("user:alice", "job-1", NODE, direction, prefix=prefix, lifetime_s=lifetime_s, clock=clock)


def _b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def _claims(token: bytes) -> dict:
    part = token.split(b".")[1]
    return json.loads(base64.urlsafe_b64decode(part + b"=" * (-len(part) % 4)))


def _with_claims(token: bytes, **changes) -> bytes:
    version, _claims_part, signature, cert = token.split(b".")
    claims = json.dumps({**_claims(token), **changes}, sort_keys=True, separators=(",", ":")).encode()
    return b".".join([version, _b64(claims), signature, cert])


@pytest.mark.parametrize("direction", [PUT, GET])
def test_a_signed_ticket_verifies_at_its_worker_as_the_ticket_signed(mesh, direction):
    _ca, dispatch, worker, clock = mesh
    ticket = _ticket(clock, direction=direction)
    token = TicketSigner(dispatch, clock=clock).sign(ticket)
    assert token.startswith(b"amt1.") and token.count(b".") == 3
    verified = TicketVerifier(worker, clock=clock).verify(token, direction=direction, node=NODE,
                                                          object_ids=["in/x", "in/y"])
    assert verified == ticket and verified.scope == "user:alice|job-1"


def test_the_claims_are_canonical_json_with_a_fresh_nonce_each_signing(mesh):
    _ca, dispatch, _worker, clock = mesh
    signer, ticket = TicketSigner(dispatch, clock=clock), _ticket(clock)
    first, second = signer.sign(ticket), signer.sign(ticket)
    raw = base64.urlsafe_b64decode(first.split(b".")[1] + b"==")
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert _claims(first)["nonce"] != _claims(second)["nonce"] and first != second


def _unsigned(claims) -> bytes:
    return b"amt1." + _b64(json.dumps(claims).encode()) + b".."


GOOD = {"tenant": "user:alice", "job_id": "j", "node": NODE, "prefix": "", "direction": PUT, "expires": NOW + 60,
        "nonce": "n"}


@pytest.mark.parametrize(("token", "says"), [
    (b"", "not amt1"),
    (b"amt2." + _b64(b"{}") + b"..", "not amt1"),
    (b"amt1.eyJ9.sig", "not amt1"),
    (b"amt1.a+b/..", "not amt1"),
    (b"amt1.abcde..", "bad base64"),
    (b"amt1." + _b64(b"{not json") + b"..", "bad base64 or JSON"),
    (b"amt1." + _b64(b"[" * 5000) + b"..", "bad base64 or JSON"),
    (_unsigned([GOOD]), "exactly"),
    (_unsigned({k: v for k, v in GOOD.items() if k != "node"}), "exactly"),
    (_unsigned({**GOOD, "max_bytes": 1}), "exactly"),
    (_unsigned({**GOOD, "expires": "soon"}), "'expires' is not a number"),
    (_unsigned({**GOOD, "expires": True}), "'expires' is not a number"),
    (_unsigned({**GOOD, "prefix": None}), "'prefix' is not a string"),
    (_unsigned({**GOOD, "direction": "delete"}), "direction or expiry"),
    (_unsigned({**GOOD, "expires": 1e300}), "direction or expiry"),
    (b"amt1." + _b64(json.dumps(GOOD).encode()) + b".c2ln.", "signature without a certificate"),
    (b"amt1." + b"A" * MAX_TICKET_BYTES + b"..", "over 16384"),
], ids=lambda value: None if isinstance(value, bytes) else value)
@pytest.mark.parametrize("secure", [True, False], ids=["secure", "insecure"])
def test_a_malformed_ticket_is_refused_as_unauthenticated_naming_the_ticket(mesh, token, says, secure):
    _ca, _dispatch, worker, clock = mesh
    verifier = TicketVerifier(worker if secure else INSECURE, clock=Clock(NOW))
    with pytest.raises(errors.Unauthenticated, match="not a ticket of this mesh") as refused:
        verifier.verify(token, direction=PUT, node=NODE)
    assert refused.value.field == "ticket" and says in str(refused.value)


def test_a_ticket_signed_under_another_meshs_ca_is_refused(mesh, tmp_path):
    _ca, _dispatch, worker, clock = mesh
    stranger = _security(CertificateAuthority(tmp_path / "other"), Role.DISPATCH, "dispatch")
    token = TicketSigner(stranger, clock=clock).sign(_ticket(clock))
    with pytest.raises(errors.Unauthenticated, match="not signed by a dispatcher of this mesh.*not issued by"):
        TicketVerifier(worker, clock=clock).verify(token, direction=PUT, node=NODE)


@pytest.mark.parametrize("role", [Role.WORKER, Role.USER, Role.CLIENT])
def test_a_ticket_signed_with_another_roles_certificate_of_the_same_ca_is_refused(mesh, role):
    ca, _dispatch, worker, clock = mesh
    impostor = _security(ca, role, "mallory")
    # The signer itself refuses to sign without a dispatcher's certificate ...
    with pytest.raises(errors.FailedPrecondition, match="not a dispatcher's certificate"):
        TicketSigner(impostor, clock=clock).sign(_ticket(clock))
    # ... and a ticket made with that key and certificate anyway is refused by the worker.
    files = impostor.tls
    key = serialization.load_pem_private_key(files.key_file.read_bytes(), password=None)
    der = x509.load_pem_x509_certificate(files.cert_file.read_bytes()).public_bytes(serialization.Encoding.DER)
    unsigned = TicketSigner(INSECURE).sign(_ticket(clock))[:-2]
    token = unsigned + b"." + _b64(key.sign(unsigned, ec.ECDSA(hashes.SHA256()))) + b"." + _b64(der)
    with pytest.raises(errors.Unauthenticated, match=f"not signed by a dispatcher.*a {role.value}'s"):
        TicketVerifier(worker, clock=clock).verify(token, direction=PUT, node=NODE)


@pytest.mark.parametrize("changes", [{"prefix": ""}, {"direction": GET}, {"node": "10.0.0.8"},
                                     {"expires": NOW + 10 * DEFAULT_TICKET_S}, {"tenant": "user:bob"}])
def test_a_ticket_whose_claims_were_altered_after_signing_is_refused(mesh, changes):
    _ca, dispatch, worker, clock = mesh
    token = _with_claims(TicketSigner(dispatch, clock=clock).sign(_ticket(clock)), **changes)
    with pytest.raises(errors.Unauthenticated, match="signature does not match its claims") as refused:
        TicketVerifier(worker, clock=clock).verify(token, direction=_claims(token)["direction"],
                                                   node=_claims(token)["node"])
    assert refused.value.field == "ticket"


def test_an_expired_ticket_is_refused_with_its_reason_even_once_verified_before(mesh):
    _ca, dispatch, worker, clock = mesh
    token = TicketSigner(dispatch, clock=clock).sign(_ticket(clock, lifetime_s=30))
    verifier = TicketVerifier(worker, clock=clock)
    verifier.verify(token, direction=PUT, node=NODE)
    clock.now += 31
    with pytest.raises(errors.Unauthenticated, match="ticket expired 1 s ago.*ask the dispatcher for a new one") \
            as refused:
        verifier.verify(token, direction=PUT, node=NODE)
    assert refused.value.reason == errors.TICKET_EXPIRED == "TICKET_EXPIRED"


def test_a_ticket_is_refused_once_its_signers_certificate_is_no_longer_valid_even_once_verified_before(mesh):
    _ca, dispatch, worker, clock = mesh
    later = Clock(clock.now + 100 * 86400)  # past the leaf's 90 days
    token = TicketSigner(dispatch, clock=clock).sign(_ticket(later))
    with pytest.raises(errors.Unauthenticated, match="not signed by a dispatcher.*not valid now"):
        TicketVerifier(worker, clock=later).verify(token, direction=PUT, node=NODE)
    with pytest.raises(errors.FailedPrecondition, match="has expired.*renew it"):
        TicketSigner(dispatch, clock=later).sign(_ticket(later))
    # A ticket outliving its signer's certificate, verified while both were valid, is refused after.
    verifier, long_lived = TicketVerifier(worker, clock=clock), _ticket(clock, lifetime_s=200 * 86400)
    token = TicketSigner(dispatch, clock=clock).sign(long_lived)
    verifier.verify(token, direction=PUT, node=NODE)
    clock.now = later.now
    with pytest.raises(errors.Unauthenticated, match="not signed by a dispatcher.*certificate has expired"):
        verifier.verify(token, direction=PUT, node=NODE)


@pytest.mark.parametrize(("direction", "node", "object_ids", "says"), [
    (GET, NODE, [], "a put ticket cannot get"),
    (PUT, "10.0.0.8", [], "good at '10.0.0.7', not at this worker ('10.0.0.8')"),
    (PUT, NODE, ["in/a", "out/b"], "object id 'out/b' is outside the ticket, which covers ids starting with 'in/'"),
    (PUT, NODE, ["x" * 500], "object id 'xxxx"),
])
def test_a_ticket_for_another_direction_node_or_object_is_refused_as_permission_denied(
        mesh, direction, node, object_ids, says):
    _ca, dispatch, worker, clock = mesh
    token = TicketSigner(dispatch, clock=clock).sign(_ticket(clock, direction=PUT, prefix="in/"))
    with pytest.raises(errors.PermissionDenied) as refused:
        TicketVerifier(worker, clock=clock).verify(token, direction=direction, node=node, object_ids=object_ids)
    assert says in str(refused.value) and refused.value.field == "ticket"
    assert len(str(refused.value)) < 300  # a long object id is quoted, not echoed whole


@pytest.mark.parametrize(("signed_for", "worker_node"), [
    ("::1", "[0:0:0:0:0:0:0:1]"), ("Node-7.Example.", "node-7.example"), ("10.0.0.7", "10.0.0.7")])
def test_the_node_is_compared_as_a_normalised_host(mesh, signed_for, worker_node):
    _ca, dispatch, worker, clock = mesh
    ticket = expiring_ticket("user:alice", "job-1", signed_for, GET, clock=clock)
    token = TicketSigner(dispatch, clock=clock).sign(ticket)
    assert TicketVerifier(worker, clock=clock).verify(token, direction=GET, node=worker_node,
                                                      object_ids=["anything"]) == ticket


def test_an_insecure_mesh_round_trips_unsigned_tickets_and_a_secure_worker_refuses_them(mesh):
    _ca, dispatch, worker, clock = mesh
    token = TicketSigner(INSECURE, clock=clock).sign(_ticket(clock))
    assert token.endswith(b"..")
    insecure = TicketVerifier(INSECURE, clock=clock)
    assert insecure.verify(token, direction=PUT, node=NODE, object_ids=["in/x"]) == _ticket(clock)
    with pytest.raises(errors.PermissionDenied, match="outside the ticket"):
        insecure.verify(token, direction=PUT, node=NODE, object_ids=["out/x"])
    with pytest.raises(errors.Unauthenticated, match="not signed by a dispatcher.*unsigned"):
        TicketVerifier(worker, clock=clock).verify(token, direction=PUT, node=NODE)
    signed = TicketSigner(dispatch, clock=clock).sign(_ticket(clock))
    with pytest.raises(errors.Unauthenticated, match="this worker runs insecure"):
        insecure.verify(signed, direction=PUT, node=NODE)


def test_each_dispatcher_certificate_is_checked_against_the_ca_once(mesh):
    _ca, dispatch, worker, clock = mesh
    checks = []

    def counting(cert, ca):
        checks.append(cert.serial_number)
        directly_issued(cert, ca)

    signer, verifier = TicketSigner(dispatch, clock=clock), TicketVerifier(worker, clock=clock, issued_by=counting)
    for token in (signer.sign(_ticket(clock)), signer.sign(_ticket(clock, prefix="in/b")), signer.sign(_ticket(clock))):
        verifier.verify(token, direction=PUT, node=NODE)
        verifier.verify(token, direction=PUT, node=NODE)
    assert len(checks) == 1


def test_a_rotated_ca_file_is_read_again_and_trusts_only_its_own_dispatchers(mesh, tmp_path):
    ca, dispatch, worker, clock = mesh
    old_token = TicketSigner(dispatch, clock=clock).sign(_ticket(clock))
    verifier = TicketVerifier(worker, clock=clock)
    verifier.verify(old_token, direction=PUT, node=NODE)
    new_ca = CertificateAuthority(tmp_path / "new")
    new_dispatch = _security(new_ca, Role.DISPATCH, "dispatch")
    staged = tmp_path / "ca.crt.new"  # replaced by rename, as a Secret update or cert-manager does
    staged.write_bytes(new_ca.cert_file.read_bytes())
    os.replace(staged, ca.cert_file)
    with pytest.raises(errors.Unauthenticated, match="not issued by this mesh's CA"):
        verifier.verify(old_token, direction=PUT, node=NODE)
    new_token = TicketSigner(new_dispatch, clock=clock).sign(_ticket(clock))
    assert verifier.verify(new_token, direction=PUT, node=NODE) == _ticket(clock)


def _dispatcher_with(ca: CertificateAuthority, key, folder) -> Security:
    """A dispatcher certificate of ``ca`` for a key of another kind than the CA issues."""
    ca_key = serialization.load_pem_private_key(ca.key_file.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_file.read_bytes())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dispatch/other-key")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(
                spiffe_id(Role.DISPATCH, "other-key"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (folder / "d.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "d.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return Security(TlsFiles(ca.cert_file, folder / "d.crt", folder / "d.key"))


@pytest.mark.parametrize("key", [ed25519.Ed25519PrivateKey.generate(),
                                 rsa.generate_private_key(public_exponent=65537, key_size=2048)],
                         ids=["ed25519", "rsa"])
def test_a_dispatcher_with_an_ed25519_or_rsa_key_signs_tickets_a_worker_takes(mesh, key, tmp_path):
    ca, _dispatch, worker, clock = mesh
    token = TicketSigner(_dispatcher_with(ca, key, tmp_path), clock=clock).sign(_ticket(clock))
    assert TicketVerifier(worker, clock=clock).verify(token, direction=PUT, node=NODE) == _ticket(clock)
    with pytest.raises(errors.Unauthenticated, match="signature does not match"):
        TicketVerifier(worker, clock=clock).verify(_with_claims(token, prefix=""), direction=PUT, node=NODE)


def test_a_worker_whose_ca_file_is_missing_fails_naming_the_file(mesh, tmp_path):
    _ca, dispatch, worker, clock = mesh
    token = TicketSigner(dispatch, clock=clock).sign(_ticket(clock))
    lost = Security(TlsFiles(tmp_path / "no-ca.crt", worker.tls.cert_file, worker.tls.key_file))
    with pytest.raises(errors.FailedPrecondition, match="no-ca.crt cannot be read.*ACCELMESH_CA_FILE"):
        TicketVerifier(lost, clock=clock).verify(token, direction=PUT, node=NODE)
