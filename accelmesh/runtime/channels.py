"""Client channels between mesh services: TLS, tokens, size limits and tracing applied in one place."""

from __future__ import annotations

import functools
import json
import logging
import threading

import grpc
from opentelemetry.sdk.trace import TracerProvider

from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from accelmesh.runtime.telemetry import instrument_channel
from accelmesh.security.config import Security, security_from_env
from accelmesh.security.identity import Role, address_host, node_host, role_host
from accelmesh.security.tls import channel_credentials, peer_certificate_names

log = logging.getLogger(__name__)

# Roles whose servers are nodes, one host an address: the server's certificate must name that host
# as a node of the role (identity.node_host), so one node's key cannot answer for another's.
PER_NODE_ROLES = frozenset({Role.WORKER})
# What gRPC's details say when the server's certificate does not name the name it was dialled by.
_NAME_MISMATCH = "hostname verification"


def open_channel(
    address: str,
    *,
    security: Security | None = None,
    role: Role | None = None,
    tracer_provider: TracerProvider | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """A channel to ``address``. ``security`` defaults to this process's as a client (the
    environment, or the credentials folder of ``accelmesh up``). With ``role``, the server must
    present a certificate of that role (a service calling a service), and for a node's role
    (PER_NODE_ROLES: a worker) one issued for the host of ``address`` too; without, the server's
    certificate must name the host of ``address``."""
    security = security if security is not None else security_from_env(Role.CLIENT)
    options = channel_options(max_message_bytes)
    if role in _REPLICATED:
        options = [*options, ("grpc.service_config", _replicas_config(role)), ("grpc.enable_retries", 1),
                   # A replica that was down is dialled again within a second of being back, not
                   # after gRPC's default backoff (up to two minutes): until then a call could
                   # find every replica failing, the one just back included.
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
    if security.insecure:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if role is not None:
            options = [*options, ("grpc.ssl_target_name_override", expected_name(address, role))]
        credentials = channel_credentials(security.tls, security.token_file)
        channel = grpc.secure_channel(address, credentials, options=options)
    return instrument_channel(channel, tracer_provider)


def expected_name(address: str, role: Role | None) -> str:
    """The name the server at ``address`` must present a certificate for."""
    if role in PER_NODE_ROLES:
        return node_host(role, address_host(address))
    return role_host(role) if role is not None else address_host(address)


def explain_refusal(address: str, details: str, *, security: Security, role: Role | None = None) -> str:
    """``details`` of a failed call, or, when TLS refused the server's certificate for its names,
    a message naming the address, the name expected and the names the certificate has, and the fix."""
    if security.insecure or _NAME_MISMATCH not in (details or "").lower():
        return details
    names = peer_certificate_names(address, security.tls)
    has = f"names {', '.join(names)}" if names else "could not be read again"
    expected = expected_name(address, role)
    if role in PER_NODE_ROLES:
        fix = (f"each {role.value} needs a certificate of its own naming its host ({address_host(address)}): "
               f"issue it from the mesh CA (MeshCredentials.worker, or a Certificate per node in Kubernetes, "
               f"docs/security.md); a certificate issued for another host is refused")
    elif role is not None:
        fix = f"the server is not a {role.value} of this mesh: check the address"
    else:
        fix = (f"connect to an address the certificate names, or have it name {expected}: "
               f"`accelmesh up --advertise {expected}` (or listen on that address), or "
               f"`python -m accelmesh.security.credentials DIR --host {expected}`")
    message = (f"the certificate of the server at {address} does not name {expected} (it {has}); {fix}")
    log.warning("refused %s: %s", address, message)
    return message


# Services that run as replicas: an address may name several (gRPC's `ipv4:10.0.0.5:50061,10.0.0.6:50061`,
# or a `dns:///compile:50061` name that resolves to each replica). Calls are spread round robin, and
# the idempotent ones, those a replica that went away (UNAVAILABLE) can be asked again without
# doing anything twice, are retried by gRPC on another.
_REPLICATED = {
    Role.COMPILE: ("accelmesh.compile.v1.CompileService", (
        "ListPrograms", "DescribeProgram", "ListRules", "ExplainRule", "Compile", "FetchArtifact", "FetchParameters")),
    Role.INVENTORY: ("accelmesh.inventory.v1.InventoryService", (
        "ListNodes", "ListDevices", "GetDevice", "RefreshDevices", "ScoreDevices", "RenewReservations",
        "ReleaseDevices", "ListReservations")),
}
RETRY_ATTEMPTS = 4  # one call and three retries, each on the next replica


@functools.cache
def _replicas_config(role: Role) -> str:
    service, methods = _REPLICATED[role]
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": service, "method": method} for method in methods],
            "retryPolicy": {"maxAttempts": RETRY_ATTEMPTS, "initialBackoff": "0.1s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    })


class ChannelPool:
    """One channel per address to servers of one ``role``, opened on first use and shared by every caller.

    A channel whose peer went away sits in gRPC's reconnect backoff (seconds, growing to
    minutes) and fails every call at once, even after the peer is back: `forget` drops it so the
    next call dials afresh. It is not closed there, since another thread's call may still be on
    it; gRPC closes it when the last user lets go. `close` closes every channel still held.
    When this process's certificate files change, channels are opened afresh with the new ones.
    """

    def __init__(self, security: Security, role: Role, *, tracer_provider: TracerProvider | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self._security, self._role = security, role
        self._tracer_provider = tracer_provider
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._stamp = None if security.insecure else security.tls.stamp()
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if not self._security.insecure:
                stamp = self._security.tls.stamp()
                if stamp != self._stamp:  # renewed certificate: new connections present it
                    self._channels, self._stamp = {}, stamp
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(
                    address, security=self._security, role=self._role, tracer_provider=self._tracer_provider,
                    max_message_bytes=self._max_message_bytes)
            return channel

    def forget(self, address: str) -> None:
        with self._lock:
            self._channels.pop(address, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
