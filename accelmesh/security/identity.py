"""Who is calling: roles, principals, and the identity a mesh certificate names.

A certificate's identity is its URI subject alternative name ``spiffe://accelmesh/<role>/<name>``
(the SPIFFE form, so certificates from cert-manager or a SPIRE server fit as they are). The
services' own roles are inventory, compile, dispatch and worker; people are users or operators;
``client`` is a certificate that only lets a program connect, its caller being named by a token.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from dataclasses import dataclass

from cryptography import x509

TRUST_DOMAIN = "accelmesh"
MESH_DOMAIN = "accelmesh.internal"


class Role(str, enum.Enum):
    INVENTORY = "inventory"
    COMPILE = "compile"
    DISPATCH = "dispatch"
    WORKER = "worker"
    OPERATOR = "operator"
    USER = "user"
    CLIENT = "client"  # transport only: a token names the caller


SERVICE_ROLES = frozenset({Role.INVENTORY, Role.COMPILE, Role.DISPATCH, Role.WORKER})
PEOPLE = frozenset({Role.USER, Role.OPERATOR})


def spiffe_id(role: Role, name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{role.value}/{name}"


def role_host(role: Role) -> str:
    """The DNS name every certificate of ``role`` carries; services dial each other by it."""
    return f"{role.value}.{MESH_DOMAIN}"


def node_host(role: Role, host: str) -> str:
    """The DNS name a certificate of ``role`` carries for each host it serves on,
    ``<host>.<role>.accelmesh.internal``: a channel to one node (a worker at ``host:port``)
    verifies it, so the one name checks both that the server is of that role and that its
    certificate was issued for that host. An IPv6 address is written in full with dashes, since a
    DNS name holds no colons."""
    host = _normal_host(host)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        label = host.rstrip(".")
    else:
        label = address.exploded.replace(":", "-") if address.version == 6 else str(address)
    return f"{label}.{role_host(role)}"


def address_host(address: str) -> str:
    """The host of a ``host:port`` address (``[v6]:port`` too), normalised."""
    return _normal_host(address.rsplit(":", 1)[0])


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its name, its role, and how it proved them ("certificate" or "token")."""

    name: str
    role: Role
    via: str

    @property
    def key(self) -> str:
        """The owner key of what this principal creates: unique across roles and sources."""
        return f"{self.role.value}:{self.name}"


@dataclass(frozen=True)
class CertificateIdentity:
    role: Role
    name: str
    hosts: frozenset[str]  # DNS names and IP addresses (normalised) the certificate is valid for

    def names_host(self, host: str) -> bool:
        return _normal_host(host) in self.hosts


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)
def certificate_identity(pem: bytes) -> CertificateIdentity | None:
    """The mesh identity of a PEM certificate, or None when it names none (or an unknown role).
    Kept for the certificates seen last: a service reads its peer's on every call, and parsing it
    was 6% of a worker's GIL time on a job of small direct shards (a call or two a shard). What
    it says depends on the bytes alone, which the TLS handshake verified."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    hosts = frozenset(
        [_normal_host(d) for d in sans.get_values_for_type(x509.DNSName)]
        + [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    )
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(prefix):
            role, _, name = uri[len(prefix):].partition("/")
            if name and role in Role._value2member_map_:
                return CertificateIdentity(Role(role), name, hosts)
    return None


def _normal_host(host: str) -> str:
    host = host.strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host
