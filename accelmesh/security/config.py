"""How a process proves who it is and whom it trusts, read from flags and the environment.

Every process reads the same variables, with the same meaning:

- ``ACCELMESH_CA_FILE``, ``ACCELMESH_CERT_FILE``, ``ACCELMESH_KEY_FILE``: the mesh CA it trusts,
  and its own certificate and key (a service's names its role; a client's may be a plain
  ``client`` certificate).
- ``ACCELMESH_TOKEN_FILE``: the bearer token a client sends.
- ``ACCELMESH_TOKENS_FILE``: the static tokens a server accepts (tokens.py).
- ``ACCELMESH_JWT_KEYS_FILE``, ``ACCELMESH_JWT_ISSUER``, ``ACCELMESH_JWT_AUDIENCE``,
  ``ACCELMESH_JWT_ROLE_CLAIM``: how a server verifies JWTs from an identity provider.
- ``ACCELMESH_CREDENTIALS_DIR``: a folder laid out by ``accelmesh up`` (credentials.py), used for
  whatever of the above is not set.
- ``ACCELMESH_INSECURE=1`` (or ``--insecure``): plaintext, no authentication, for development
  on loopback only; a server refuses it on any other address.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from accelmesh import errors
from accelmesh.runtime.config import env_bool
from accelmesh.security.identity import Role
from accelmesh.security.tls import TlsFiles
from accelmesh.security.tokens import JwtSettings

DEFAULT_CREDENTIALS_DIR = Path(".accelmesh") / "credentials"


@dataclass(frozen=True)
class Security:
    """A process's TLS files and token settings; ``tls=None`` only when running insecure."""

    tls: TlsFiles | None
    token_file: Path | None = None  # sent by this process as a client
    tokens_file: Path | None = None  # accepted by this process as a server
    jwt: JwtSettings | None = None

    @property
    def insecure(self) -> bool:
        return self.tls is None

    def without_token(self) -> Security:
        return Security(self.tls, None, self.tokens_file, self.jwt)


INSECURE = Security(tls=None)


def credentials_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("ACCELMESH_CREDENTIALS_DIR") or DEFAULT_CREDENTIALS_DIR)


def _file(env: Mapping[str, str], name: str, fallback: Path | None) -> Path | None:
    value = env.get(name)
    if value:
        return Path(value)
    return fallback if fallback is not None and fallback.exists() else None


def security_from_env(role: Role, env: Mapping[str, str] = os.environ, *, insecure: bool | None = None) -> Security:
    """The security of a process of ``role`` (a service, or CLIENT for a program calling the mesh)."""
    if insecure if insecure is not None else env_bool("ACCELMESH_INSECURE", False, env):
        return INSECURE
    folder = credentials_dir(env)
    stem = "client" if role in (Role.CLIENT, Role.USER, Role.OPERATOR) else role.value
    ca = _file(env, "ACCELMESH_CA_FILE", folder / "ca.crt")
    cert = _file(env, "ACCELMESH_CERT_FILE", folder / f"{stem}.crt")
    key = _file(env, "ACCELMESH_KEY_FILE", folder / f"{stem}.key")
    missing = [name for name, value in (("ACCELMESH_CA_FILE", ca), ("ACCELMESH_CERT_FILE", cert),
                                        ("ACCELMESH_KEY_FILE", key)) if value is None]
    if missing:
        raise errors.FailedPrecondition(
            f"no credentials for the {role.value}: set {', '.join(missing)} (or ACCELMESH_CREDENTIALS_DIR to a "
            f"folder made by `accelmesh up`; {folder} has none); plaintext needs --insecure, on loopback only"
        )
    keys = _file(env, "ACCELMESH_JWT_KEYS_FILE", None)
    jwt = None if keys is None else JwtSettings(
        keys, issuer=env.get("ACCELMESH_JWT_ISSUER", ""), audience=env.get("ACCELMESH_JWT_AUDIENCE") or "accelmesh",
        role_claim=env.get("ACCELMESH_JWT_ROLE_CLAIM") or "roles",
    )
    is_client = stem == "client"
    return Security(
        TlsFiles(ca, cert, key),
        token_file=_file(env, "ACCELMESH_TOKEN_FILE", folder / "token") if is_client else None,
        tokens_file=None if is_client else _file(env, "ACCELMESH_TOKENS_FILE", folder / "tokens.json"),
        jwt=None if is_client else jwt,
    )


def check_listen(security: Security, address: str) -> None:
    """Plaintext is for loopback alone: refuse it on any other address, naming the way out."""
    if not security.insecure:
        return
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise errors.InvalidArgument(
            f"--insecure serves plaintext without authentication, which is refused on {address}: listen on "
            f"127.0.0.1, or drop --insecure and give the process its certificate (ACCELMESH_CERT_FILE)"
        )


def add_security_arguments(parser, env: Mapping[str, str] = os.environ) -> None:
    """The flags every service has: --insecure, --health-listen and --metrics-listen (certificate files come from the
    environment, as Kubernetes Secrets mounted as files name them)."""
    parser.add_argument("--insecure", action="store_true", default=env_bool("ACCELMESH_INSECURE", False, env),
                        help="plaintext without authentication, for development on loopback only")
    parser.add_argument("--health-listen", default=env.get("ACCELMESH_HEALTH_LISTEN", ""),
                        help="also serve the health service alone, in plaintext, here (for Kubernetes' gRPC probe)")
    parser.add_argument("--metrics-listen", default=env.get("ACCELMESH_METRICS_LISTEN", ""),
                        help="serve metrics for Prometheus at /metrics here (host:port; TLS with the mesh's "
                             "certificates unless --insecure)")


def service_security(role: Role):
    """A dataclass default: the security of a service of ``role`` from the environment."""
    return lambda: security_from_env(role)
