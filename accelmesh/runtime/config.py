"""Reading configuration from the environment, failing fast with the variable's name."""

from __future__ import annotations

import os
from collections.abc import Mapping

from accelmesh import errors

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_GRACE_S = 5.0


def env_str(name: str, default: str, env: Mapping[str, str] = os.environ) -> str:
    return env.get(name, default)


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


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The same limits on both ends: gRPC's default receive limit (4 MiB) is too small for tensors."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
