"""Bearer tokens a server accepts: static tokens from a file, and signed JWTs (PyJWT) from the
operator's identity provider, verified against configured public keys.

The static tokens file holds only SHA-256 digests of the tokens, so reading it does not give
anyone a token: ``{"tokens": [{"sha256": "<hex>", "name": "alice", "role": "user"}]}``. Both
sources are read again when their file changes, so tokens are added and revoked without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import jwt

from accelmesh import errors
from accelmesh.security.files import ReloadingFile, write_private
from accelmesh.security.identity import PEOPLE, Principal, Role

JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _parse_static(raw: bytes) -> dict[str, tuple[str, Role]]:
    entries = json.loads(raw or b"{}").get("tokens", [])
    table = {}
    for entry in entries:
        role = Role(entry["role"])
        if role not in PEOPLE:
            raise errors.InvalidArgument(f"token {entry['name']!r}: role must be user or operator, got {role.value}")
        table[entry["sha256"]] = (entry["name"], role)
    return table


class StaticTokens:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = ReloadingFile(self.path, _parse_static)

    def principal(self, token: str) -> Principal | None:
        digest = token_digest(token)
        for known, (name, role) in self._file.get().items():
            if hmac.compare_digest(known, digest):
                return Principal(name, role, "token")
        return None

    def add(self, name: str, role: Role, token: str | None = None) -> str:
        """Add a token for ``name`` with ``role`` (a new random one unless given); returns the token."""
        if role not in PEOPLE:
            raise errors.InvalidArgument(f"tokens name people (user or operator), not {role.value}: services "
                                         "prove who they are with their certificates")
        token = token or new_token()
        data = json.loads(self.path.read_bytes()) if self.path.exists() else {"tokens": []}
        data["tokens"].append({"sha256": token_digest(token), "name": name, "role": role.value})
        write_private(self.path, json.dumps(data, indent=2) + "\n")
        return token


@dataclass(frozen=True)
class JwtSettings:
    keys_file: Path  # PEM public key(s), or a JWKS document (JSON)
    issuer: str = ""  # required "iss" when set
    audience: str = "accelmesh"
    role_claim: str = "roles"  # a string or a list; "operator" wins over "user"


def _parse_keys(raw: bytes) -> dict[str | None, object]:
    text = raw.decode()
    if text.lstrip().startswith("{"):
        return {key.key_id: key.key for key in jwt.PyJWKSet.from_json(text).keys}
    end = "-----END PUBLIC KEY-----"
    pems = [block + end + "\n" for block in text.split(end) if "BEGIN" in block]
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    return {None if len(pems) == 1 else str(i): load_pem_public_key(p.encode()) for i, p in enumerate(pems)}


class JwtVerifier:
    def __init__(self, settings: JwtSettings):
        self.settings = settings
        self._keys = ReloadingFile(settings.keys_file, _parse_keys)

    def principal(self, token: str) -> Principal | None:
        """The token's principal, None when it is not a JWT; raises Unauthenticated when it is one
        that does not verify (signature, expiry, issuer, audience) or names no role."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            return None
        keys = self._keys.get()
        kid = header.get("kid")
        candidates = [keys[kid]] if kid in keys else list(keys.values())
        s = self.settings
        claims, last = None, None
        for key in candidates:
            try:
                claims = jwt.decode(token, key, algorithms=list(JWT_ALGORITHMS), audience=s.audience,
                                    issuer=s.issuer or None, options={"require": ["exp", "sub"]})
                break
            except jwt.InvalidTokenError as exc:
                last = exc
        if claims is None:
            raise errors.Unauthenticated(
                f"the bearer token is not accepted: {last}; ask the identity provider for a new one")
        roles = claims.get(s.role_claim, [])
        roles = [roles] if isinstance(roles, str) else list(roles)
        for role in (Role.OPERATOR, Role.USER):
            if role.value in roles:
                return Principal(str(claims["sub"]), role, "token")
        raise errors.Unauthenticated(
            f"the token of {claims['sub']!r} has no accelmesh role in its {s.role_claim!r} claim; "
            f"the identity provider must grant 'user' or 'operator'"
        )
