"""A mesh certificate authority in a folder: the throwaway one `accelmesh up` makes, and the
certificates it issues to each process (with the `cryptography` library; nothing hand-written).

Every certificate names one identity as a URI subject alternative name,
``spiffe://accelmesh/<role>/<name>`` (identity.py), and a DNS name ``<role>.accelmesh.internal``
that services dial each other by (channels verify the role of the server they reach that way),
besides the hosts it is reached at, each of them also as ``<host>.<role>.accelmesh.internal``
(identity.node_host: the name a channel to one worker verifies, its role and host at once). The
mesh's own names are derived here and never taken from a caller, so no certificate of one role
can carry another role's. Keys are ECDSA P-256 and written readable by the owner only.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from accelmesh import errors
from accelmesh.security.files import private_dir, write_private
from accelmesh.security.identity import MESH_DOMAIN, Role, node_host, role_host, spiffe_id

CA_DAYS = 365
LEAF_DAYS = 90
_BACKDATE = dt.timedelta(minutes=5)  # tolerate clocks a little behind the one that issued


@dataclass(frozen=True)
class Issued:
    cert_file: Path
    key_file: Path


class CertificateAuthority:
    """A CA key and certificate on disk, issuing leaf certificates into the same folder."""

    def __init__(self, folder: str | Path, *, common_name: str = "accelmesh mesh CA"):
        self.folder = Path(folder)
        self.cert_file, self.key_file = self.folder / "ca.crt", self.folder / "ca.key"
        if self.cert_file.exists() and self.key_file.exists():
            self._cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
            self._key = serialization.load_pem_private_key(self.key_file.read_bytes(), password=None)
            return
        private_dir(self.folder)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        _write_key(self.key_file, self._key)
        write_private(self.cert_file, self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, role: Role, name: str, hosts: Sequence[str] = (), *, stem: str | None = None,
              days: int = LEAF_DAYS) -> Issued:
        """Issue ``<stem>.crt``/``<stem>.key`` (stem defaults to the name) for ``role``/``name``,
        valid for the role's mesh host name and each of ``hosts`` (DNS names or IP addresses), each
        also as its node name of the role (``<host>.<role>.accelmesh.internal``)."""
        for host in hosts:
            if host.rstrip(".").lower().endswith(MESH_DOMAIN):
                raise errors.InvalidArgument(
                    f"hosts: {host!r} is a name of the mesh ({MESH_DOMAIN}), which the CA derives from the role; "
                    f"name the host's own DNS name or IP address")
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        alt_names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id(role, name))]
        for host in dict.fromkeys((role_host(role), *hosts, *(node_host(role, host) for host in hosts))):
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt_names.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role.value}/{name}")]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        stem = stem or name
        issued = Issued(self.folder / f"{stem}.crt", self.folder / f"{stem}.key")
        _write_key(issued.key_file, key)
        # Written whole and renamed, so a process reloading on change never reads half a file; owner
        # only like everything in the folder, which its owner's processes alone read.
        write_private(issued.cert_file, cert.public_bytes(serialization.Encoding.PEM))
        return issued


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    os.replace(tmp, path)
