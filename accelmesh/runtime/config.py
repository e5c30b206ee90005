"""Reading configuration from the environment, failing fast with the variable's name."""

from __future__ import annotations

import os
from collections.abc import Mapping

from accelmesh import errors

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_GRACE_S = 5.0


def env_str(name: str, default: str, env: Mapping[str, str] = os.environ) -> str:
    return env.get(name, default)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_bool(name: str, default: bool, env: Mapping[str, str] = os.environ) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise errors.InvalidArgument(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


def env_int(name: str, default: int, env: Mapping[str, str] = os.environ, *, minimum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidArgument(f"{name}={raw!r} is not an integer; set it to e.g. {default}") from None
    if minimum is not None and value < minimum:
        raise errors.InvalidArgument(f"{name}={value} is below the minimum {minimum}")
    return value


def env_float(name: str, default: float, env: Mapping[str, str] = os.environ, *, minimum: float | None = None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise errors.InvalidArgument(f"{name}={raw!r} is not a number; set it to e.g. {default}") from None
    if minimum is not None and value < minimum:
        raise errors.InvalidArgument(f"{name}={value} is below the minimum {minimum}")
    return value


# HTTP/2 keepalive on every mesh connection with a call open: a ping after this long without one,
# and the connection is closed if its answer takes longer than the timeout, so a peer behind a cut
# link (no reset, no error, just silence) is noticed within their sum.
KEEPALIVE_TIME_S = 2.0  # ACCELMESH_KEEPALIVE_TIME_S
KEEPALIVE_TIMEOUT_S = 3.0  # ACCELMESH_KEEPALIVE_TIMEOUT_S
# Servers accept pings this often with no call data (a client pinging more often is sent away):
# the floor of ACCELMESH_KEEPALIVE_TIME_S, so any client's setting is accepted by any server.
MIN_PING_INTERVAL_S = 1.0


def keepalive_from_env(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(keepalive time, keepalive timeout) in milliseconds, as gRPC takes them."""
    time_s = env_float("ACCELMESH_KEEPALIVE_TIME_S", KEEPALIVE_TIME_S, env, minimum=MIN_PING_INTERVAL_S)
    timeout_s = env_float("ACCELMESH_KEEPALIVE_TIMEOUT_S", KEEPALIVE_TIMEOUT_S, env, minimum=0.1)
    return round(time_s * 1000), round(timeout_s * 1000)


def cannot_bind(address: str, flag: str) -> errors.FailedPrecondition:
    """The one-line error of a port that cannot be had, naming the flag that moves it."""
    return errors.FailedPrecondition(
        f"could not listen on {address}: the port is in use (or the address is not one of this machine's); stop "
        f"what holds it, or give {flag} another port")


def channel_options(max_message_bytes: int, keepalive_ms: tuple[int, int] | None = None) -> list[tuple[str, int]]:
    """Options for both ends of every mesh connection.

    Message limits: gRPC's default receive limit (4 MiB) is too small for tensors. Keepalive
    (`keepalive_ms`, else keepalive_from_env): a cut link makes no error, the peer just goes
    quiet, and a shard computing for minutes sends nothing; pings every KEEPALIVE_TIME_S while a
    call is open (allowed with no call data, and accepted by servers down to MIN_PING_INTERVAL_S)
    notice a dead peer within time + timeout (5 s by default) instead of at the shard's deadline.
    The timeout also sets TCP_USER_TIMEOUT.
    """
    time_ms, timeout_ms = keepalive_ms or keepalive_from_env()
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # gRPC 1.6x and later time a keepalive ping's answer by this (default a minute), not by
        # the keepalive timeout alone: without it a silent peer is noticed a minute late.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_PING_INTERVAL_S * 1000)),
    ]
