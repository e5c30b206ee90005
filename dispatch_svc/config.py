"""Dispatch service configuration: one frozen dataclass from flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from accelmesh import errors
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, env_float, env_int, env_str
from accelmesh.security.config import Security, add_security_arguments, security_from_env, service_security
from accelmesh.security.identity import Role

MIB = 1024 * 1024


@dataclass(frozen=True)
class DispatchConfig:
    listen: str = "127.0.0.1:50071"  # ACCELMESH_DISPATCH_LISTEN
    inventory: str = "127.0.0.1:50051"  # ACCELMESH_INVENTORY: inventory service address
    compile: str = "127.0.0.1:50061"  # ACCELMESH_COMPILE: compile service address
    data_dir: str = ".accelmesh/dispatch"  # ACCELMESH_DISPATCH_DIR: job records and results
    result_retention_s: float = 24 * 3600.0  # ACCELMESH_RESULT_RETENTION_S: results deleted after this
    max_shard_bytes: int = 16 * MIB  # ACCELMESH_MAX_SHARD_BYTES: inputs of one shard, at most
    inflight_bytes: int = 64 * MIB  # ACCELMESH_INFLIGHT_BYTES: shard inputs held at once per job
    chunk_bytes: int = 1 * MIB  # ACCELMESH_CHUNK_BYTES: tensor chunk size on streams
    max_client_parameter_bytes: int = 1024 * MIB  # ACCELMESH_MAX_CLIENT_PARAMETER_BYTES: parameters a client sends with one job
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ACCELMESH_MAX_MESSAGE_BYTES
    # ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKENS_FILE, ACCELMESH_JWT_*,
    # ACCELMESH_CREDENTIALS_DIR, ACCELMESH_INSECURE: see accelmesh/security/config.py
    security: Security = field(default_factory=service_security(Role.DISPATCH))
    health_listen: str = ""  # ACCELMESH_HEALTH_LISTEN: plaintext health alone, for probes


def parse_args(argv: list[str] | None = None, env=os.environ) -> DispatchConfig:
    d = DispatchConfig  # the class: its defaults, without resolving credentials before --insecure is read
    parser = argparse.ArgumentParser(prog="accelmesh-dispatch", description="accelmesh dispatch service")
    parser.add_argument("--listen", default=env_str("ACCELMESH_DISPATCH_LISTEN", d.listen, env))
    parser.add_argument("--inventory", default=env_str("ACCELMESH_INVENTORY", d.inventory, env))
    parser.add_argument("--compile", default=env_str("ACCELMESH_COMPILE", d.compile, env))
    parser.add_argument("--data-dir", default=env_str("ACCELMESH_DISPATCH_DIR", d.data_dir, env))
    add_security_arguments(parser, env)
    args = parser.parse_args(argv)
    config = DispatchConfig(
        listen=args.listen,
        security=security_from_env(Role.DISPATCH, env, insecure=args.insecure),
        health_listen=args.health_listen,
        inventory=args.inventory,
        compile=args.compile,
        data_dir=args.data_dir,
        result_retention_s=env_float("ACCELMESH_RESULT_RETENTION_S", d.result_retention_s, env, minimum=1),
        max_shard_bytes=env_int("ACCELMESH_MAX_SHARD_BYTES", d.max_shard_bytes, env, minimum=1024),
        inflight_bytes=env_int("ACCELMESH_INFLIGHT_BYTES", d.inflight_bytes, env, minimum=1024),
        chunk_bytes=env_int("ACCELMESH_CHUNK_BYTES", d.chunk_bytes, env, minimum=1024),
        max_client_parameter_bytes=env_int("ACCELMESH_MAX_CLIENT_PARAMETER_BYTES", d.max_client_parameter_bytes, env,
                                           minimum=1024),
        max_message_bytes=env_int("ACCELMESH_MAX_MESSAGE_BYTES", d.max_message_bytes, env, minimum=65536),
    )
    if config.chunk_bytes + 4096 > config.max_message_bytes:
        raise errors.InvalidArgument("ACCELMESH_CHUNK_BYTES must leave room under ACCELMESH_MAX_MESSAGE_BYTES")
    return config
