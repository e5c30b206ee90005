"""Tickets: the dispatcher's signed leave for a client to put a job's inputs into, or fetch its
outputs from, one worker's object store directly, the tensor bytes never passing the dispatcher.

A ticket is opaque to clients and language-neutral:
``amt1.<claims>.<signature>.<certificate>``, each part unpadded base64url. The claims are
canonical JSON (sorted keys, no spaces, ASCII) of the Ticket's fields and a random nonce; the
signature is the dispatcher's TLS key's over the ASCII bytes ``amt1.<claims>`` (ECDSA P-256 with
SHA-256 as DER, Ed25519, or RSA PKCS#1 v1.5 with SHA-256); the certificate is the dispatcher's,
DER, which a worker trusts when the mesh CA issued it and it names the dispatch role. An insecure
mesh has neither: ``amt1.<claims>..``, which only an insecure worker accepts.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from accelmesh import errors
from accelmesh.security.config import Security
from accelmesh.security.files import file_stamp
from accelmesh.security.identity import Role, certificate_identity, node_host

PUT, GET = "put", "get"
DEFAULT_TICKET_S = 3600  # a ticket's life: a job's puts and fetches fit it, a leaked one soon dies
MAX_TICKET_BYTES = 16 * 1024  # a P-256 certificate and claims take about 1 KiB
SIGNER_CACHE_SIZE = 256  # dispatcher certificates checked against the CA, by DER
TOKEN_CACHE_SIZE = 4096  # tickets whose signature was checked, by their bytes

_VERSION = b"amt1"
_FORMAT = re.compile(rb"amt1\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]*)\.([A-Za-z0-9_-]*)")
_FIELDS = {"tenant": str, "job_id": str, "node": str, "prefix": str, "direction": str, "expires": (int, float),
           "nonce": str}
_LATEST_EXPIRY = 1e11  # unix seconds (year 5138): past it an expiry is not one a dispatcher wrote
_ASK = "ask the dispatcher for a new one"


@dataclass(frozen=True)
class Ticket:
    tenant: str  # owner key of the job (Principal.key, e.g. "user:alice")
    job_id: str
    node: str  # the host of the worker (address_host of its address) the ticket is good at
    prefix: str  # the object ids it covers: those starting with it ("in/"); "" is all of the job's
    direction: str  # PUT or GET
    expires: float  # unix seconds

    @property
    def scope(self) -> str:
        """The store scope the job's objects live in."""
        return f"{self.tenant}|{self.job_id}"


def expiring_ticket(tenant: str, job_id: str, node: str, direction: str, *, prefix: str = "",
                    lifetime_s: float = DEFAULT_TICKET_S, clock: Callable[[], float] = time.time) -> Ticket:
    """A ticket for ``direction`` at ``node`` that expires ``lifetime_s`` from now."""
    return Ticket(tenant, job_id, node, prefix, direction, clock() + lifetime_s)


def _b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def _unb64(text: bytes) -> bytes:
    return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))


def _malformed(why: str) -> errors.Unauthenticated:
    return errors.Unauthenticated(f"ticket: not a ticket of this mesh ({why}); send the ticket the dispatcher "
                                  f"returned, unchanged, or {_ASK}", field="ticket")


def _not_dispatcher(why: str) -> errors.Unauthenticated:
    return errors.Unauthenticated(f"ticket not signed by a dispatcher of this mesh ({why}); {_ASK} from the "
                                  f"dispatcher of the mesh this worker serves", field="ticket")


class TicketSigner:
    """Signs tickets with the dispatcher's own TLS key (re-read when the files change); an insecure
    mesh's signer signs nothing."""

    def __init__(self, security: Security, *, clock: Callable[[], float] = time.time):
        self._files, self._clock = security.tls, clock
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._key = self._der = None
        self._not_after = math.inf

    def sign(self, ticket: Ticket) -> bytes:
        if ticket.direction not in (PUT, GET):
            raise errors.InvalidArgument(f"direction: {errors.quoted(ticket.direction)} is neither {PUT!r} nor "
                                         f"{GET!r}", field="direction")
        claims = {**asdict(ticket), "nonce": _b64(secrets.token_bytes(12)).decode()}
        signed = _VERSION + b"." + _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
        if self._files is None:
            return signed + b".."
        key, der = self._credentials()
        return signed + b"." + _b64(key.sign(signed, *_scheme(key))) + b"." + _b64(der)

    def _credentials(self):
        with self._lock:
            stamp = self._files.stamp()
            if stamp != self._stamp:
                try:
                    _ca, chain, pem_key = self._files.read()
                except errors.FailedPrecondition:
                    if self._key is None:
                        raise
                    # Mid-rotation: keep signing with the pair that matched, as the TLS server does.
                else:
                    identity = certificate_identity(chain)
                    if identity is None or identity.role is not Role.DISPATCH:
                        raise errors.FailedPrecondition(
                            f"{self._files.cert_file} is not a dispatcher's certificate, and workers take tickets "
                            f"only from a dispatcher: give the dispatcher its own (ACCELMESH_CERT_FILE)")
                    cert = x509.load_pem_x509_certificate(chain)
                    key = serialization.load_pem_private_key(pem_key, password=None)
                    if _scheme(key) is None:
                        raise errors.FailedPrecondition(
                            f"the dispatcher's key {self._files.key_file} is {type(key).__name__}, which tickets "
                            f"cannot be signed with: issue it an EC P-256, Ed25519 or RSA key")
                    self._key = key
                    self._der = cert.public_bytes(serialization.Encoding.DER)
                    self._not_after = cert.not_valid_after_utc.timestamp()
                    self._stamp = stamp
            if self._clock() > self._not_after:
                raise errors.FailedPrecondition(f"the dispatcher's certificate {self._files.cert_file} has expired, "
                                                f"so no worker would take its tickets: renew it")
            return self._key, self._der


def _scheme(key) -> tuple | None:
    """What follows the data in ``sign``/``verify`` for a key (private or public) of this kind, or
    None for a kind tickets are not signed with."""
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return (ec.ECDSA(hashes.SHA256()),)
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return ()
    if isinstance(key, rsa.RSAPrivateKey | rsa.RSAPublicKey):
        return (padding.PKCS1v15(), hashes.SHA256())
    return None


@functools.lru_cache(maxsize=1024)
def _host(host: str) -> str:
    return node_host(Role.WORKER, host)  # normalised: case, brackets, an IPv6 address's spelling


def directly_issued(cert: x509.Certificate, ca: x509.Certificate) -> None:
    """The CA check (raises ValueError, TypeError or InvalidSignature); injectable for tests."""
    cert.verify_directly_issued_by(ca)


class TicketVerifier:
    """A worker's check of the tickets it is shown; the CA file is re-read when it changes, and
    each dispatcher certificate and each ticket's signature are checked once."""

    def __init__(self, security: Security, *, clock: Callable[[], float] = time.time,
                 issued_by: Callable[[x509.Certificate, x509.Certificate], None] = directly_issued):
        self._ca_file: Path | None = None if security.tls is None else Path(security.tls.ca_file)
        self._clock, self._issued_by = clock, issued_by
        self._lock = threading.Lock()
        self._stamp: tuple | None = ()  # () is no file's stamp: the first call reads the CA (None: missing)
        self._trust = _Trust([], {}, {})

    def verify(self, token: bytes | str, *, direction: str | None, node: str, object_ids: Sequence[str] = ()) -> Ticket:
        """The ticket's claims once its signature, signer, expiry, node and object ids check out;
        `direction` None takes a put or a get ticket alike (a release frees what either covers)."""
        if isinstance(token, str):
            token = token.encode("ascii", "replace")
        if len(token) > MAX_TICKET_BYTES:
            raise _malformed(f"{len(token)} bytes, over {MAX_TICKET_BYTES}")
        trust, now = self._reload(), self._clock()
        cached = trust.tokens.get(token)
        if cached is None:
            ticket, not_after = self._remember(trust.tokens, TOKEN_CACHE_SIZE, token, self._decode(trust, token, now))
        else:
            ticket, not_after = cached
            if now > not_after:
                raise _not_dispatcher("its certificate has expired")
        if ticket.expires < now:
            raise errors.Unauthenticated(
                f"ticket expired {now - ticket.expires:.0f} s ago (at "
                f"{dt.datetime.fromtimestamp(ticket.expires, dt.UTC):%Y-%m-%dT%H:%M:%SZ}); {_ASK}",
                reason=errors.TICKET_EXPIRED, field="ticket")
        if direction is not None and ticket.direction != direction:
            raise errors.PermissionDenied(f"a {ticket.direction} ticket cannot {direction}: ask the dispatcher for a "
                                          f"{direction} ticket", field="ticket")
        if ticket.node != node and _host(ticket.node) != _host(node):
            raise errors.PermissionDenied(f"the ticket is good at {errors.quoted(ticket.node)}, not at this worker "
                                          f"({errors.quoted(node)}): send it to the worker the dispatcher named",
                                          field="ticket")
        for object_id in object_ids:
            if not object_id.startswith(ticket.prefix):
                raise errors.PermissionDenied(
                    f"object id {errors.quoted(object_id)} is outside the ticket, which covers ids starting with "
                    f"{errors.quoted(ticket.prefix)}: ask the dispatcher for a ticket that covers it", field="ticket")
        return ticket

    def _decode(self, trust: _Trust, token: bytes, now: float) -> tuple[Ticket, float]:
        match = _FORMAT.fullmatch(token)
        if match is None:
            raise _malformed("not amt1.<claims>.<signature>.<certificate> in base64url")
        try:
            claims, signature, der = (_unb64(part) for part in match.groups())
            fields = json.loads(claims)
        except (ValueError, RecursionError) as exc:  # binascii, JSON and UTF-8 errors are ValueErrors
            raise _malformed(f"bad base64 or JSON: {type(exc).__name__}") from None
        if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
            raise _malformed(f"its claims must be exactly {sorted(_FIELDS)}")
        for name, kind in _FIELDS.items():
            if not isinstance(fields[name], kind) or isinstance(fields[name], bool):
                raise _malformed(f"claim {name!r} is not a {'number' if name == 'expires' else 'string'}")
        if fields["direction"] not in (PUT, GET) or not 0 <= fields["expires"] < _LATEST_EXPIRY:
            raise _malformed("its direction or expiry is not one a dispatcher writes")
        if bool(signature) != bool(der):
            raise _malformed("a signature without a certificate, or the other way round")
        del fields["nonce"]
        ticket = Ticket(**{**fields, "expires": float(fields["expires"])})
        if self._ca_file is None:
            if signature:
                raise errors.Unauthenticated(
                    "ticket: signed by a secure dispatcher, but this worker runs insecure and cannot check it: run "
                    "the worker with the mesh's certificates, or the dispatcher insecure as well", field="ticket")
            return ticket, math.inf
        if not signature:
            raise _not_dispatcher("it is unsigned, as only an insecure dispatcher writes them")
        public_key, not_before, not_after = self._signer(trust, der)
        if not not_before <= now <= not_after:
            raise _not_dispatcher("its certificate is not valid now")
        try:
            public_key.verify(signature, token[:match.end(1)], *_scheme(public_key))
        except (InvalidSignature, TypeError):  # TypeError: a key of a kind no dispatcher signs with
            raise errors.Unauthenticated("ticket: its signature does not match its claims (it was altered after "
                                         f"signing); send the ticket as the dispatcher returned it, or {_ASK}",
                                         field="ticket") from None
        return ticket, not_after

    def _signer(self, trust: _Trust, der: bytes) -> tuple:
        known = trust.signers.get(der)
        if known is not None:
            return known
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            raise _not_dispatcher("its certificate is not DER") from None
        for ca in trust.cas:
            try:
                self._issued_by(cert, ca)
                break
            except (ValueError, TypeError, InvalidSignature):
                continue
        else:
            raise _not_dispatcher("its certificate was not issued by this mesh's CA")
        identity = certificate_identity(cert.public_bytes(serialization.Encoding.PEM))
        if identity is None or identity.role is not Role.DISPATCH:
            raise _not_dispatcher(f"its certificate is a {identity.role.value if identity else 'non-mesh'}'s")
        return self._remember(trust.signers, SIGNER_CACHE_SIZE, der, (
            cert.public_key(), cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()))

    def _remember(self, cache: dict, size: int, key: bytes, value):
        with self._lock:  # the oldest goes first: a flood of new tickets cannot grow the cache
            if len(cache) >= size:
                cache.pop(next(iter(cache)), None)
            cache[key] = value
        return value

    def _reload(self) -> _Trust:
        """The trust anchors, read again when the CA file changes: a new file starts empty caches, so
        no signer or ticket checked under the old anchors (even by a call still running) counts."""
        if self._ca_file is None:
            return self._trust
        stamp = file_stamp(self._ca_file)
        if stamp == self._stamp:
            return self._trust
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._trust = _Trust(x509.load_pem_x509_certificates(self._ca_file.read_bytes()), {}, {})
                    self._stamp = stamp
                except (OSError, ValueError) as exc:
                    if not self._trust.cas:  # else mid-rotation: keep the anchors that were read whole
                        raise errors.FailedPrecondition(f"the CA file {self._ca_file} cannot be read ({exc}); "
                                                        f"check ACCELMESH_CA_FILE") from None
            return self._trust


@dataclass(frozen=True)
class _Trust:
    cas: list[x509.Certificate]
    signers: dict[bytes, tuple]  # DER -> (public key, not before, not after), checked against cas
    tokens: dict[bytes, tuple[Ticket, float]]  # ticket bytes -> (its claims, its signer's not after)
