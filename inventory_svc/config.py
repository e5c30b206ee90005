"""Inventory configuration: one frozen dataclass from flags and environment, defaults documented."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from accelmesh import errors
from accelmesh.runtime.config import DEFAULT_MAX_MESSAGE_BYTES, env_float, env_int, env_str
from accelmesh.runtime.database import database_url
from accelmesh.runtime.https import HttpLimits, http_limits_from_env
from accelmesh.security.config import Security, add_security_arguments, security_from_env, service_security
from accelmesh.security.identity import Role
from inventory_svc.inventory import DEFAULT_FORGET_LOST_AFTER_S


@dataclass(frozen=True)
class InventoryConfig:
    listen: str = "127.0.0.1:50051"  # ACCELMESH_INVENTORY_LISTEN
    # ACCELMESH_INVENTORY_DB: a SQLite file path (embedded, one replica) or a postgresql:// URL (shared by replicas)
    db: str = ".accelmesh/inventory.db"
    poll_interval_s: float = 5.0  # ACCELMESH_POLL_INTERVAL_S: time between poll cycles
    poll_timeout_s: float = 2.0  # ACCELMESH_POLL_TIMEOUT_S: deadline of one DescribeNode
    lost_after_polls: int = 3  # ACCELMESH_LOST_AFTER_POLLS: missed polls in a row before a node is lost
    # ACCELMESH_FORGET_LOST_AFTER_S: a lost node silent for longer is removed with its devices, as
    # RemoveNode with force would (its jobs' reservations end); 0 never forgets. Why an hour: inventory.py
    forget_lost_after_s: float = DEFAULT_FORGET_LOST_AFTER_S
    # ACCELMESH_INVENTORY_FOLLOW_INTERVAL_S: how often the changes other replicas on the database wrote
    # are read (device index, WatchDevices); a ranking also reads them first, whatever this says
    follow_interval_s: float = 0.25
    max_samples_per_device: int = 720  # ACCELMESH_MAX_SAMPLES: status history kept per device
    sample_retention_s: float = 3600.0  # ACCELMESH_SAMPLE_RETENTION_S: status history age limit
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ACCELMESH_MAX_MESSAGE_BYTES
    # ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKENS_FILE, ACCELMESH_JWT_*,
    # ACCELMESH_CREDENTIALS_DIR, ACCELMESH_INSECURE: see accelmesh/security/config.py
    security: Security = field(default_factory=service_security(Role.INVENTORY))
    health_listen: str = ""  # ACCELMESH_HEALTH_LISTEN: plaintext health alone, for probes
    metrics_listen: str = ""  # ACCELMESH_METRICS_LISTEN: /metrics for Prometheus (accelmesh/runtime/metrics.py)
    # ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S, _READ_TIMEOUT_S, _MAX_CONNECTIONS: its HTTP endpoints (runtime/https.py)
    http: HttpLimits = HttpLimits()


def parse_args(argv: list[str] | None = None, env=os.environ) -> InventoryConfig:
    d = InventoryConfig  # the class: its defaults, without resolving credentials before --insecure is read
    parser = argparse.ArgumentParser(prog="accelmesh-inventory", description="accelmesh inventory service")
    parser.add_argument("--listen", default=env_str("ACCELMESH_INVENTORY_LISTEN", d.listen, env))
    parser.add_argument(
        "--db", default=env_str("ACCELMESH_INVENTORY_DB", d.db, env),
        help="the inventory database: a SQLite file path (default %(default)s) or "
             "postgresql://user:password@host:5432/dbname (several replicas may share it)",
    )
    parser.add_argument(
        "--poll-interval", type=float,
        default=env_float("ACCELMESH_POLL_INTERVAL_S", d.poll_interval_s, env, minimum=0.01),
    )
    parser.add_argument(
        "--poll-timeout", type=float, default=env_float("ACCELMESH_POLL_TIMEOUT_S", d.poll_timeout_s, env, minimum=0.01)
    )
    parser.add_argument(
        "--lost-after", type=int, default=env_int("ACCELMESH_LOST_AFTER_POLLS", d.lost_after_polls, env, minimum=1)
    )
    parser.add_argument(
        "--forget-lost-after", type=float,
        default=env_float("ACCELMESH_FORGET_LOST_AFTER_S", d.forget_lost_after_s, env, minimum=0),
        help="seconds a lost node may stay silent before it and its devices are removed; 0 never "
             "(default %(default)s)",
    )
    parser.add_argument(
        "--follow-interval", type=float,
        default=env_float("ACCELMESH_INVENTORY_FOLLOW_INTERVAL_S", d.follow_interval_s, env, minimum=0.01),
        help="seconds between reads of the changes other replicas wrote (default %(default)s)",
    )
    add_security_arguments(parser, env)
    args = parser.parse_args(argv)
    database_url(args.db)  # a URL of an engine not supported, or one that does not parse, fails here
    if args.poll_interval <= 0 or args.poll_timeout <= 0 or args.lost_after < 1 or args.follow_interval <= 0:
        raise errors.InvalidArgument("--poll-interval, --poll-timeout and --follow-interval must be positive "
                                     "and --lost-after >= 1")
    if not args.forget_lost_after >= 0:  # NaN too: it would never compare true, so never forget silently
        raise errors.InvalidArgument(
            f"--forget-lost-after (ACCELMESH_FORGET_LOST_AFTER_S) is {args.forget_lost_after:g}; "
            "give seconds >= 0, where 0 means lost nodes are never forgotten")
    return InventoryConfig(
        security=security_from_env(Role.INVENTORY, env, insecure=args.insecure),
        health_listen=args.health_listen,
        metrics_listen=args.metrics_listen,
        http=http_limits_from_env(env),
        listen=args.listen,
        db=args.db,
        poll_interval_s=args.poll_interval,
        poll_timeout_s=args.poll_timeout,
        lost_after_polls=args.lost_after,
        forget_lost_after_s=args.forget_lost_after,
        follow_interval_s=args.follow_interval,
        max_samples_per_device=env_int("ACCELMESH_MAX_SAMPLES", d.max_samples_per_device, env, minimum=1),
        sample_retention_s=env_float("ACCELMESH_SAMPLE_RETENTION_S", d.sample_retention_s, env, minimum=1),
        max_message_bytes=env_int("ACCELMESH_MAX_MESSAGE_BYTES", d.max_message_bytes, env, minimum=65536),
    )
