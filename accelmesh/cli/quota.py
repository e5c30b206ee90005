"""`accelmesh quota`: what each tenant's jobs may hold at once, set by operators (SetQuota) and
read by anyone (ListQuotas; a user sees their own), through the dispatch service at --dispatch.

A quota is replaced whole: `quota set` sends every limit, and a flag left out is no limit. That
is the service's meaning, kept here so `set` never merges with a quota the caller has not seen.
"""

from __future__ import annotations

import argparse
import re

from accelmesh.cli.jobs import at_least, dispatch_flag
from accelmesh.cli.tables import format_size, table
from accelmesh.client import MeshClient
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE = re.compile(r"\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*", re.IGNORECASE)
DEFAULT_TENANT = "*"


def parse_size(text: str) -> int:
    """`8GiB`, `512MiB`, `1.5TB`, `1000000` (bytes) -> bytes."""
    match = SIZE.fullmatch(text)
    unit = match["unit"].lower() if match else None
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 8GiB, 512MiB, 1.5TB or a number of bytes")
    return int(float(match["number"]) * UNITS[unit])


def tenant(text: str) -> str:
    """A job owner as Job.owner names it (`user:alice`), or `*`: a bare name would never match a job."""
    if text != DEFAULT_TENANT and ":" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a tenant: write it as `accelmesh jobs list` shows owners (user:{text}), or '*' "
            "for every tenant without a quota of its own")
    return text


def _limits(quota: pb.Quota) -> tuple[str, str, str, str]:
    def shown(field: str, fmt=str) -> str:
        return fmt(getattr(quota, field)) if quota.HasField(field) else "-"
    return (shown("max_jobs"), shown("max_devices"), shown("max_memory_bytes", format_size), shown("max_priority"))


def format_quota(quota: pb.Quota) -> str:
    jobs, devices, memory, priority = _limits(quota)
    return f"{quota.tenant}: max jobs {jobs}, max devices {devices}, max memory {memory}, max priority {priority}"


def format_uses(uses) -> str:
    rows = [("TENANT", "QUOTA", "MAX JOBS", "MAX DEVICES", "MAX MEMORY", "MAX PRIORITY", "JOBS", "DEVICES", "MEMORY",
             "QUEUED")]
    for use in uses:
        applied = use.quota.tenant if use.HasField("quota") else ""
        whose = "own" if applied == use.tenant else applied or "none"
        rows.append((use.tenant, whose, *_limits(use.quota), str(use.jobs), str(use.devices),
                     format_size(use.memory_bytes), str(use.queued)))
    return table(rows)


def cmd_set(args) -> int:
    quota = pb.Quota(tenant=args.tenant, max_jobs=args.max_jobs, max_devices=args.max_devices,
                     max_memory_bytes=args.max_memory, max_priority=args.max_priority)
    with MeshClient(args.dispatch) as client:
        stored = client.stub.SetQuota(pb.SetQuotaRequest(quota=quota)).quota
    print(f"set {format_quota(stored)}")
    return 0


def cmd_remove(args) -> int:
    with MeshClient(args.dispatch) as client:
        client.stub.SetQuota(pb.SetQuotaRequest(quota=pb.Quota(tenant=args.tenant), remove=True))
    fallback = "" if args.tenant == DEFAULT_TENANT else f"; its jobs now fall under '{DEFAULT_TENANT}', if set"
    print(f"removed the quota of {args.tenant}{fallback}")
    return 0


def cmd_list(args) -> int:
    with MeshClient(args.dispatch) as client:
        uses = client.stub.ListQuotas(pb.ListQuotasRequest()).quotas
    print(format_uses(uses) if uses else "no quotas set and no jobs holding devices or queued")
    return 0


def add_commands(sub) -> None:
    group = sub.add_parser("quota", help="tenants' quotas: jobs, devices, memory and priority held at once")
    quota = group.add_subparsers(dest="quota_command", required=True)
    setting = quota.add_parser("set", help="set a tenant's quota (operators); it replaces the old one whole, a limit "
                                           "left out is no limit",
                               description="Set a tenant's quota. Jobs over it wait in the queue.")
    setting.add_argument("tenant", type=tenant, metavar="TENANT",
                         help="a job owner (user:alice), or '*' for the default")
    setting.add_argument("--max-jobs", type=at_least(0), metavar="N", help="jobs holding devices at once")
    setting.add_argument("--max-devices", type=at_least(0), metavar="N", help="devices held at once over its jobs")
    setting.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                         help="device memory reserved at once over its jobs, e.g. 8GiB")
    setting.add_argument("--max-priority", type=at_least(0), metavar="N", help="the highest priority its jobs may ask")
    setting.set_defaults(func=cmd_set)
    remove = quota.add_parser("remove", help="remove a tenant's own quota (operators); '*' then applies to it")
    remove.add_argument("tenant", metavar="TENANT")
    remove.set_defaults(func=cmd_remove)
    listing = quota.add_parser("list", help="quotas and what each tenant holds now (users see their own)")
    listing.set_defaults(func=cmd_list)
    for command in (setting, remove, listing):
        dispatch_flag(command)
