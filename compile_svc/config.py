"""Compile service configuration: one frozen dataclass from flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, env_int, env_str
from accelmesh.runtime.https import HttpLimits, http_limits_from_env
from accelmesh.security.config import Security, add_security_arguments, security_from_env, service_security
from accelmesh.security.identity import Role


@dataclass(frozen=True)
class CompileConfig:
    listen: str = "127.0.0.1:50061"  # ACCELMESH_COMPILE_LISTEN
    cache_dir: str = ".accelmesh/artifacts"  # ACCELMESH_ARTIFACT_DIR: content-addressed artifact cache
    cache_max_bytes: int = 2 * 1024**3  # ACCELMESH_ARTIFACT_MAX_BYTES: LRU eviction beyond this
    rules: str = ""  # ACCELMESH_COMPILE_RULES: rule file; empty = deploy/rules/compile_rules.toml
    programs_dir: str = ".accelmesh/programs"  # ACCELMESH_PROGRAMS_DIR: uploaded programs survive restarts here
    max_upload_bytes: int = 64 * 1024**2  # ACCELMESH_MAX_UPLOAD_BYTES: largest UploadProgram artifact
    # Uploads are held in memory as well as in programs_dir: these bound both.
    max_uploads: int = 256  # ACCELMESH_MAX_UPLOADS: uploaded versions kept, all names together
    max_uploaded_bytes: int = 4 * 1024**3  # ACCELMESH_MAX_UPLOADED_BYTES: their artifacts' bytes together
    max_batch_sizes: int = 16  # ACCELMESH_MAX_BATCH_SIZES: executables one Compile call may ask for
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ACCELMESH_MAX_MESSAGE_BYTES
    max_parameter_bytes: int = 2 * 1024**3  # ACCELMESH_MAX_PARAMETER_BYTES: largest model FetchParameters initialises
    # ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKENS_FILE, ACCELMESH_JWT_*,
    # ACCELMESH_CREDENTIALS_DIR, ACCELMESH_INSECURE: see accelmesh/security/config.py
    security: Security = field(default_factory=service_security(Role.COMPILE))
    health_listen: str = ""  # ACCELMESH_HEALTH_LISTEN: plaintext health alone, for probes
    metrics_listen: str = ""  # ACCELMESH_METRICS_LISTEN: /metrics for Prometheus (accelmesh/runtime/metrics.py)
    # ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S, _READ_TIMEOUT_S, _MAX_CONNECTIONS: its HTTP endpoints (runtime/https.py)
    http: HttpLimits = HttpLimits()


def parse_args(argv: list[str] | None = None, env=os.environ) -> CompileConfig:
    d = CompileConfig  # the class: its defaults, without resolving credentials before --insecure is read
    parser = argparse.ArgumentParser(prog="accelmesh-compile", description="accelmesh compile service")
    parser.add_argument("--listen", default=env_str("ACCELMESH_COMPILE_LISTEN", d.listen, env))
    parser.add_argument("--cache-dir", default=env_str("ACCELMESH_ARTIFACT_DIR", d.cache_dir, env))
    parser.add_argument("--rules", default=env_str("ACCELMESH_COMPILE_RULES", d.rules, env))
    parser.add_argument("--programs-dir", default=env_str("ACCELMESH_PROGRAMS_DIR", d.programs_dir, env))
    add_security_arguments(parser, env)
    args = parser.parse_args(argv)
    return CompileConfig(
        security=security_from_env(Role.COMPILE, env, insecure=args.insecure),
        health_listen=args.health_listen,
        metrics_listen=args.metrics_listen,
        http=http_limits_from_env(env),
        listen=args.listen,
        cache_dir=args.cache_dir,
        cache_max_bytes=env_int("ACCELMESH_ARTIFACT_MAX_BYTES", d.cache_max_bytes, env, minimum=1024**2),
        rules=args.rules,
        programs_dir=args.programs_dir,
        max_upload_bytes=env_int("ACCELMESH_MAX_UPLOAD_BYTES", d.max_upload_bytes, env, minimum=1024),
        max_uploads=env_int("ACCELMESH_MAX_UPLOADS", d.max_uploads, env, minimum=0),
        max_uploaded_bytes=env_int("ACCELMESH_MAX_UPLOADED_BYTES", d.max_uploaded_bytes, env, minimum=0),
        max_batch_sizes=env_int("ACCELMESH_MAX_BATCH_SIZES", d.max_batch_sizes, env, minimum=1),
        max_message_bytes=env_int("ACCELMESH_MAX_MESSAGE_BYTES", d.max_message_bytes, env, minimum=65536),
        max_parameter_bytes=env_int("ACCELMESH_MAX_PARAMETER_BYTES", d.max_parameter_bytes, env, minimum=1),
    )
