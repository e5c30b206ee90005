"""Who may call what: the caller's principal from its token or certificate, and each server's
table of which roles may call which of its methods, enforced before any handler runs.

A method missing from a server's table is refused to everyone (fail closed). Health and
reflection are open to any peer that completed the TLS handshake, which already required a
certificate from the mesh CA. Tokens are never logged: messages name the principal or the
missing piece, never the token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc

from accelmesh import errors
from accelmesh.runtime.handlers import rewrapped
from accelmesh.security.config import Security
from accelmesh.security.identity import PEOPLE, CertificateIdentity, Principal, Role, certificate_identity
from accelmesh.security.tokens import JwtVerifier, StaticTokens

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1.ServerReflection/",
                 "/grpc.reflection.v1alpha.ServerReflection/")
ANYONE = frozenset(Role)
LOCAL_DEVELOPER = Principal("insecure-developer", Role.OPERATOR, "insecure")

# A method's callers, by role.
Access = Mapping[str, frozenset[Role]]
# An Access entry for a method that authorises each call by the ticket it carries (a worker's
# object-store methods, accelmesh/security/tickets.py): any peer whose certificate the mesh CA
# issued may call it (the TLS handshake checked that), whatever its role, and without a
# principal: a client's bearer token means nothing to a worker, which keeps no tokens.
BY_TICKET: frozenset[Role] = frozenset(Role)


def roles(*names: Role) -> frozenset[Role]:
    return frozenset(names)


class Authenticator:
    """Finds the caller of a call. With ``insecure`` security every caller is the local developer."""

    def __init__(self, security: Security):
        self.insecure = security.insecure
        self._static = StaticTokens(security.tokens_file) if security.tokens_file else None
        self._jwt = JwtVerifier(security.jwt) if security.jwt else None

    def certificate(self, context: grpc.ServicerContext) -> CertificateIdentity | None:
        pem = context.auth_context().get("x509_pem_cert")
        return certificate_identity(pem[0]) if pem else None

    def principal(self, context: grpc.ServicerContext) -> Principal:
        """The caller; raises Unauthenticated saying what is missing."""
        if self.insecure:
            return LOCAL_DEVELOPER
        token = _bearer(context.invocation_metadata())
        if token is not None:
            return self._from_token(token)
        identity = self.certificate(context)
        if identity is not None and identity.role is not Role.CLIENT:
            return Principal(identity.name, identity.role, "certificate")
        raise errors.Unauthenticated(
            "no credentials name the caller: send 'authorization: Bearer <token>' (accelmesh up writes one to "
            "credentials/token) or connect with a user or operator certificate"
        )

    def from_token(self, token: str) -> Principal:
        """The principal a bearer token names (a web page's login, say); raises Unauthenticated."""
        if self.insecure:
            return LOCAL_DEVELOPER
        return self._from_token(token)

    def _from_token(self, token: str) -> Principal:
        if self._jwt is not None:
            found = self._jwt.principal(token)
            if found is not None:
                return found
        if self._static is not None:
            found = self._static.principal(token)
            if found is not None:
                return found
        raise errors.Unauthenticated("the bearer token is not one this mesh accepts; check ACCELMESH_TOKEN_FILE")


def _bearer(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise errors.Unauthenticated("the authorization header must be 'Bearer <token>'")
            return token.strip()
    return None


def sees_everything(principal: Principal) -> bool:
    return principal.role is Role.OPERATOR


class AccessInterceptor(grpc.ServerInterceptor):
    """Refuses a call whose caller's role is not in the method's entry of ``access`` (method name
    to roles, for the methods of the hosted ``services``)."""

    def __init__(self, services: Iterable[str], access: Access, authenticator: Authenticator):
        self._prefixes, self._access, self._auth = tuple(f"/{s}/" for s in services), access, authenticator

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        allowed = self._access.get(method.rsplit("/", 1)[-1]) if method.startswith(self._prefixes) else None
        if allowed is BY_TICKET:
            return handler

        def check(context: grpc.ServicerContext) -> None:
            principal = self._auth.principal(context)
            # Plaintext names no caller, so roles cannot be told apart: insecure, every listed method is open.
            if allowed is None or (principal.role not in allowed and not self._auth.insecure):
                need = " or ".join(sorted(r.value for r in allowed)) if allowed else "no role (not callable)"
                raise errors.PermissionDenied(
                    f"{method} needs the role {need}; {principal.name!r} ({principal.via}) has {principal.role.value}"
                )

        return _guarded(handler, check)


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    def wrap(behavior, _client_streams: bool, server_streams: bool):
        if server_streams:
            def streaming(request, context):
                check(context)
                yield from behavior(request, context)

            return streaming

        def unary(request, context):
            check(context)
            return behavior(request, context)

        return unary

    return rewrapped(handler, wrap)


__all__ = ["ANYONE", "PEOPLE", "Access", "AccessInterceptor", "Authenticator", "roles", "sees_everything"]
