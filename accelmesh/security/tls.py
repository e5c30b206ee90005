"""Mutual TLS from files: server credentials that pick up renewed certificates on the next
handshake, and client credentials that carry this process's certificate and bearer token.

Files are the interface (Kubernetes Secrets, cert-manager, SPIRE's helper all write files), and
every read is of whole files that their writers replace by rename, so a reload never sees half a
certificate. A renewed key and certificate are taken only once they match each other.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from accelmesh import errors
from accelmesh.security.files import ReloadingFile, file_stamp
from accelmesh.security.identity import address_host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """The trust anchor and this process's identity: PEM files."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def stamp(self) -> tuple:
        """Changes whenever any of the three files is replaced or rewritten."""
        return tuple(file_stamp(path) for path in (self.ca_file, self.cert_file, self.key_file))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, certificate chain, key); raises FailedPrecondition naming a missing or unreadable file,
        or a key that does not belong to the certificate."""
        parts = []
        for label, path in (("CA", self.ca_file), ("certificate", self.cert_file), ("key", self.key_file)):
            try:
                parts.append(Path(path).read_bytes())
            except OSError as exc:
                env = f"ACCELMESH_{'CA' if label == 'CA' else label[:4].upper()}_FILE"
                raise errors.FailedPrecondition(f"the {label} file {path} cannot be read ({exc.strerror}); "
                                                f"check {env}") from None
        ca, chain, key = parts
        try:
            cert = x509.load_pem_x509_certificate(chain)
            private = serialization.load_pem_private_key(key, password=None)
            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise errors.FailedPrecondition(
                f"{self.cert_file}, {self.key_file} or {self.ca_file} is not PEM ({exc})") from None
        if cert.public_key().public_bytes(*_SPKI) != private.public_key().public_bytes(*_SPKI):
            raise errors.FailedPrecondition(
                f"the key {self.key_file} does not belong to the certificate {self.cert_file}")
        return ca, chain, key


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """TLS that requires a client certificate signed by the CA; renewed files apply to new connections."""
    ca, chain, key = files.read()
    state = {"stamp": files.stamp()}
    lock = threading.Lock()

    def config(ca: bytes, chain: bytes, key: bytes):
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def fetch():
        with lock:
            stamp = files.stamp()
            if stamp == state["stamp"]:
                return None  # gRPC keeps the current configuration
            try:
                fresh = files.read()
            except errors.FailedPrecondition as exc:  # mid-rotation: keep serving the old pair
                log.warning("certificate files changed but cannot be used yet: %s", exc)
                return None
            state["stamp"] = stamp
            log.info("certificate files changed: new connections use %s", files.cert_file)
            return config(*fresh)

    return grpc.dynamic_ssl_server_credentials(config(ca, chain, key), fetch, require_client_authentication=True)


def channel_credentials(files: TlsFiles, token_file: Path | None = None) -> grpc.ChannelCredentials:
    ca, chain, key = files.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    if token_file is None:
        return creds
    return grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(TokenPlugin(token_file)))


class TokenPlugin(grpc.AuthMetadataPlugin):
    """Sends ``authorization: Bearer <token>``, the token read from its file when the file changes."""

    def __init__(self, path: Path):
        self._metadata = ReloadingFile(path, lambda raw: (("authorization", f"Bearer {raw.decode().strip()}"),))

    def __call__(self, context, callback):
        try:
            callback(self._metadata.get(), None)
        except (OSError, errors.AccelmeshError) as exc:
            callback((), exc)


def peer_certificate_names(address: str, files: TlsFiles, *, timeout_s: float = 2.0) -> list[str] | None:
    """The names (SPIFFE URI, DNS names, IP addresses) in the certificate the server at ``address``
    presents, or None when no TLS handshake completes. For messages only: nothing is trusted from
    it, the host is not checked here, and the channel that was refused stays refused."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # its name is what the message reports
    context.load_verify_locations(cafile=str(files.ca_file))
    context.load_cert_chain(str(files.cert_file), str(files.key_file))
    context.set_alpn_protocols(["h2"])
    try:
        port = int(address.rsplit(":", 1)[1])
        with socket.create_connection((address_host(address), port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError, IndexError):
        return None
    if der is None:
        return None
    try:
        sans = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ([*sans.value.get_values_for_type(x509.UniformResourceIdentifier),
             *sans.value.get_values_for_type(x509.DNSName),
             *(str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress))])
