"""Dispatch service configuration: one frozen dataclass from flags and environment."""

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
from dispatch_svc.admission.admission import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_QUEUE_TIMEOUT_S
from dispatch_svc.admission.queue import QUEUE_POLL_S
from dispatch_svc.admission.scheduling.rounds import DEFAULT_POLICY, check_policy, load_throughputs
from dispatch_svc.api.servicer import DEFAULT_STREAM_IDLE_S, STREAM_IDLE_ENV
from dispatch_svc.jobs.limits import DEVICE_WATCH_S, LIMIT_MINIMUMS, LIMIT_VARIABLES, MIB, RESERVATION_TTL_S, JobLimits
from dispatch_svc.planner.placement_types import MAX_LAYERS

DEFAULT_LEASE_S = 10.0  # a PostgreSQL book's job leases: a stopped replica's jobs move on after this

def limits_from_env(env=os.environ) -> JobLimits:
    values = {name: env_int(variable, getattr(JobLimits, name), env, minimum=LIMIT_MINIMUMS.get(name, 1))
              for name, variable in LIMIT_VARIABLES.items()}
    if values["max_layers"] > MAX_LAYERS:
        raise errors.InvalidArgument(f"ACCELMESH_MAX_MODEL_LAYERS={values['max_layers']} is above the "
                                     f"{MAX_LAYERS} layers the planner places; set it to at most that")
    return JobLimits(**values)


@dataclass(frozen=True)
class DispatchConfig:
    listen: str = "127.0.0.1:50071"  # ACCELMESH_DISPATCH_LISTEN
    inventory: str = "127.0.0.1:50051"  # ACCELMESH_INVENTORY: inventory service address
    compile: str = "127.0.0.1:50061"  # ACCELMESH_COMPILE: compile service address
    data_dir: str = ".accelmesh/dispatch"  # ACCELMESH_DISPATCH_DIR: results (and the job book's SQLite file)
    # ACCELMESH_DISPATCH_DB: the job book (jobs, events); empty: the SQLite file jobs.db in data_dir,
    # or a postgresql://user:password@host:5432/dbname URL
    db: str = ""
    # ACCELMESH_DISPATCH_LEASE_S: replicas share the job book and take over the jobs of one that
    # stopped once its lease on them ran out; 0: this dispatcher is the book's only one. Default:
    # takeover.DEFAULT_LEASE_S on a PostgreSQL book, 0 on a SQLite file.
    lease_s: float = 0.0
    result_retention_s: float = 24 * 3600.0  # ACCELMESH_RESULT_RETENTION_S: results deleted after this
    max_shard_bytes: int = 16 * MIB  # ACCELMESH_MAX_SHARD_BYTES: inputs of one shard, at most
    inflight_bytes: int = 64 * MIB  # ACCELMESH_INFLIGHT_BYTES: shard inputs held at once per job
    # ACCELMESH_RESERVATION_TTL_S: lease of a job's reservations, renewed every third of it while it runs
    reservation_ttl_s: int = RESERVATION_TTL_S
    # ACCELMESH_VERIFY_FRACTION: of every data-parallel job's shards, at least, run a second time on
    # a device of another node and compared within the compile rules' tolerance (execution/
    # verification.py); a job's spec.verify_fraction may raise it, never lower it. 0: off.
    verify_fraction: float = 0.0
    # ACCELMESH_DEVICE_WATCH_S: how often a running job asks the inventory which of its devices are
    # lost; a lost one's shards in flight are stopped and retried elsewhere at once (0: never asks)
    device_watch_s: float = DEVICE_WATCH_S
    chunk_bytes: int = 1 * MIB  # ACCELMESH_CHUNK_BYTES: tensor chunk size on streams
    # ACCELMESH_MAX_CLIENT_PARAMETER_BYTES: parameters a client sends with one job
    max_client_parameter_bytes: int = 1024 * MIB
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ACCELMESH_MAX_MESSAGE_BYTES
    limits: JobLimits = JobLimits()  # ACCELMESH_MAX_JOB_ROWS, _JOB_BYTES, ...: see JobLimits
    # ACCELMESH_CA_FILE, ACCELMESH_CERT_FILE, ACCELMESH_KEY_FILE, ACCELMESH_TOKENS_FILE, ACCELMESH_JWT_*,
    # ACCELMESH_CREDENTIALS_DIR, ACCELMESH_INSECURE: see accelmesh/security/config.py
    security: Security = field(default_factory=service_security(Role.DISPATCH))
    health_listen: str = ""  # ACCELMESH_HEALTH_LISTEN: plaintext health alone, for probes
    metrics_listen: str = ""  # ACCELMESH_METRICS_LISTEN: /metrics for Prometheus (accelmesh/runtime/metrics.py)
    # ACCELMESH_HTTP_HANDSHAKE_TIMEOUT_S, _READ_TIMEOUT_S, _MAX_CONNECTIONS: its HTTP endpoints (runtime/https.py)
    http: HttpLimits = HttpLimits()
    # ACCELMESH_STAGE_CALIBRATION: finished pipeline stage calls calibrate later placements
    # (dispatch_svc/planner/calibration.py); 0 plans from the catalog alone, the same plan every time
    calibrate_stages: bool = True
    # ACCELMESH_QUEUE_TIMEOUT_S: how long a job that cannot start waits in the queue when its spec
    # says nothing (spec.queue_timeout); ACCELMESH_QUEUE_POLL_S: how often the queue is looked at
    # without a job of this replica ending (another replica's did, a reservation lapsed).
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    queue_poll_s: float = QUEUE_POLL_S
    max_queued_per_tenant: int = DEFAULT_MAX_QUEUED  # ACCELMESH_MAX_QUEUED_PER_TENANT: one tenant's jobs queued at once
    # ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT: the declared input bytes of one tenant's queued jobs
    # together, which wait stored on the dispatch dir's disk (64 GiB)
    max_queued_bytes_per_tenant: int = DEFAULT_MAX_QUEUED_BYTES
    # ACCELMESH_STATUS_LISTEN: host:port of the read-only status page for browsers (status_page.py); none when empty
    status_listen: str = ""
    # ACCELMESH_SCHEDULING_POLICY: how a queue pass shares the free devices among several queued
    # jobs (scheduling/rounds.py): min_total_time, max_min_fairness, fifo, or first_fit (no rounds);
    # ACCELMESH_SCHEDULING_THROUGHPUTS: a TOML file of programs' rows/s per device type, profiled
    # figures the rounds prefer to measured and catalog rates; none when empty
    scheduling_policy: str = DEFAULT_POLICY
    scheduling_throughputs: str = ""
    # ACCELMESH_STREAM_IDLE_S: a SubmitJob or RunJob request stream that sends no message this long
    # while the dispatcher waits for one is ended DEADLINE_EXCEEDED, and its job with it
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S


def parse_args(argv: list[str] | None = None, env=os.environ) -> DispatchConfig:
    d = DispatchConfig  # the class: its defaults, without resolving credentials before --insecure is read
    parser = argparse.ArgumentParser(prog="accelmesh-dispatch", description="accelmesh dispatch service")
    parser.add_argument("--listen", default=env_str("ACCELMESH_DISPATCH_LISTEN", d.listen, env))
    parser.add_argument("--inventory", default=env_str("ACCELMESH_INVENTORY", d.inventory, env))
    parser.add_argument("--compile", default=env_str("ACCELMESH_COMPILE", d.compile, env))
    parser.add_argument("--data-dir", default=env_str("ACCELMESH_DISPATCH_DIR", d.data_dir, env))
    parser.add_argument("--db", default=env_str("ACCELMESH_DISPATCH_DB", d.db, env),
                        help="the job book: a SQLite file path or a postgresql://user:password@host/dbname URL "
                             "(default: jobs.db in the data dir)")
    parser.add_argument("--status-listen", default=env_str("ACCELMESH_STATUS_LISTEN", d.status_listen, env),
                        help="serve the read-only status page for browsers here (host:port; TLS unless --insecure)")
    add_security_arguments(parser, env)
    args = parser.parse_args(argv)
    config = DispatchConfig(
        listen=args.listen,
        security=security_from_env(Role.DISPATCH, env, insecure=args.insecure),
        health_listen=args.health_listen,
        metrics_listen=args.metrics_listen,
        http=http_limits_from_env(env),
        inventory=args.inventory,
        compile=args.compile,
        data_dir=args.data_dir,
        db=args.db,
        lease_s=env_float("ACCELMESH_DISPATCH_LEASE_S", DEFAULT_LEASE_S if args.db.startswith("postgres") else 0.0,
                          env, minimum=0),
        result_retention_s=env_float("ACCELMESH_RESULT_RETENTION_S", d.result_retention_s, env, minimum=1),
        max_shard_bytes=env_int("ACCELMESH_MAX_SHARD_BYTES", d.max_shard_bytes, env, minimum=1024),
        inflight_bytes=env_int("ACCELMESH_INFLIGHT_BYTES", d.inflight_bytes, env, minimum=1024),
        reservation_ttl_s=env_int("ACCELMESH_RESERVATION_TTL_S", d.reservation_ttl_s, env, minimum=1),
        verify_fraction=env_float("ACCELMESH_VERIFY_FRACTION", d.verify_fraction, env, minimum=0),
        device_watch_s=env_float("ACCELMESH_DEVICE_WATCH_S", d.device_watch_s, env, minimum=0),
        chunk_bytes=env_int("ACCELMESH_CHUNK_BYTES", d.chunk_bytes, env, minimum=1024),
        max_client_parameter_bytes=env_int("ACCELMESH_MAX_CLIENT_PARAMETER_BYTES", d.max_client_parameter_bytes, env,
                                           minimum=1024),
        calibrate_stages=env_int("ACCELMESH_STAGE_CALIBRATION", 1, env, minimum=0) > 0,
        max_message_bytes=env_int("ACCELMESH_MAX_MESSAGE_BYTES", d.max_message_bytes, env, minimum=65536),
        limits=limits_from_env(env),
        queue_timeout_s=env_float("ACCELMESH_QUEUE_TIMEOUT_S", d.queue_timeout_s, env, minimum=1),
        queue_poll_s=env_float("ACCELMESH_QUEUE_POLL_S", d.queue_poll_s, env, minimum=0.05),
        max_queued_per_tenant=env_int("ACCELMESH_MAX_QUEUED_PER_TENANT", d.max_queued_per_tenant, env, minimum=1),
        max_queued_bytes_per_tenant=env_int("ACCELMESH_MAX_QUEUED_BYTES_PER_TENANT", d.max_queued_bytes_per_tenant, env,
                                            minimum=0),
        status_listen=args.status_listen,
        scheduling_policy=check_policy(env_str("ACCELMESH_SCHEDULING_POLICY", d.scheduling_policy, env)),
        scheduling_throughputs=env_str("ACCELMESH_SCHEDULING_THROUGHPUTS", d.scheduling_throughputs, env),
        stream_idle_s=env_float(STREAM_IDLE_ENV, d.stream_idle_s, env, minimum=0.1),
    )
    if config.scheduling_throughputs:
        load_throughputs(config.scheduling_throughputs)  # a file that is missing or malformed fails here
    if config.db:
        database_url(config.db)  # an engine not supported, or a URL that does not parse, fails here
    if config.verify_fraction > 1:
        raise errors.InvalidArgument(f"ACCELMESH_VERIFY_FRACTION is {config.verify_fraction:g}; use 0 (off) to 1 "
                                     "(every shard run again on another node)")
    if config.chunk_bytes + 4096 > config.max_message_bytes:
        raise errors.InvalidArgument("ACCELMESH_CHUNK_BYTES must leave room under ACCELMESH_MAX_MESSAGE_BYTES")
    return config
