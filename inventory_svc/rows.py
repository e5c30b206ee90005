"""The store's statements and the conversion between its rows and the inventory's records.

Kept apart from ``store.py`` so the store reads as what it does (transactions, rules, errors)
and this module as how the data is laid out in ``tables.py``. Every statement here is a
SQLAlchemy Core construct that compiles for SQLite and PostgreSQL alike; the two spots where the
engines spell a function differently (the larger of two numbers, a number inside JSON text) are
the small compiled elements below, not two copies of a query.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnElement, FunctionElement

from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance
from inventory_svc.filtering import DeviceFilter
from inventory_svc.records import DeviceRecord
from inventory_svc.tables import devices, nodes, reservations, status_samples

SPEC_COLUMNS = (
    "node_ip", "local_index", "platform", "kind", "type", "compute_capability",
    "capabilities", "performance", "emulated", "execution_device",
)
SAMPLE_COLUMNS = ("ts", "memory_total", "memory_used", "utilization", "temperature_c", "power_w")
RESERVATION_COLUMNS = (
    reservations.c.job_id, reservations.c.device_id, reservations.c.memory_bytes,
    reservations.c.compute_fraction, reservations.c.created_at, reservations.c.expires_at,
)
NOW = sa.bindparam("now", type_=sa.Double)  # every device query is "as of now": leases lapse by it


class greatest(FunctionElement):
    """The larger of its arguments: GREATEST on PostgreSQL, the two-argument scalar MAX on SQLite."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(greatest)
def _greatest(element, compiler, **kw):
    return f"GREATEST({compiler.process(element.clauses, **kw)})"


@compiles(greatest, "sqlite")
def _greatest_sqlite(element, compiler, **kw):
    return f"MAX({compiler.process(element.clauses, **kw)})"


class datasheet_memory_bytes(FunctionElement):
    """The ``memory_bytes`` of a device's ``performance`` JSON text: what a device without samples has."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(datasheet_memory_bytes)
def _datasheet_memory(element, compiler, **kw):
    return f"CAST(CAST({compiler.process(element.clauses, **kw)} AS JSONB) ->> 'memory_bytes' AS BIGINT)"


@compiles(datasheet_memory_bytes, "sqlite")
def _datasheet_memory_sqlite(element, compiler, **kw):
    return f"json_extract({compiler.process(element.clauses, **kw)}, '$.memory_bytes')"


_d = devices.alias("d")
_s = status_samples.alias("s")
_newest = status_samples.alias("newest")
_r = reservations.alias("r")


def _reserved(column: sa.Column, zero: object) -> ColumnElement:
    # CAST: PostgreSQL's SUM of a bigint is numeric, which would reach Python as a Decimal.
    total = sa.func.coalesce(sa.func.sum(column), zero)
    return (
        sa.select(sa.cast(total, column.type))
        .where(_r.c.device_id == _d.c.id, _r.c.expires_at > NOW)
        .scalar_subquery()
    )


_RESERVED_MEMORY = _reserved(_r.c.memory_bytes, 0)
# Mirrors accelmesh.hardware.model.free_memory_bytes so free-memory filters run in SQL rather than
# decoding every row in Python (a filter matching nothing would otherwise scan 10,000 rows).
_FREE_MEMORY = greatest(
    0,
    sa.func.coalesce(_s.c.memory_total, datasheet_memory_bytes(_d.c.performance))
    - sa.func.coalesce(_s.c.memory_used, 0) - _RESERVED_MEMORY,
)
_LATEST_TS = sa.select(sa.func.max(_newest.c.ts)).where(_newest.c.device_id == _d.c.id).scalar_subquery()
# One row per device with its latest sample and live reservation sums: every lookup is an
# index seek, which keeps a 100-row page over 10,000 devices at a few milliseconds.
DEVICE_SELECT = sa.select(
    _d.c.id, *(_d.c[c] for c in SPEC_COLUMNS), _d.c.node_address, _d.c.health, _d.c.first_seen_at, _d.c.updated_at,
    *(_s.c[c] for c in SAMPLE_COLUMNS),
    _RESERVED_MEMORY.label("reserved_memory"),
    _reserved(_r.c.compute_fraction, 0.0).label("reserved_compute"),
).select_from(
    _d.outerjoin(_s, sa.and_(_s.c.device_id == _d.c.id, _s.c.ts == _LATEST_TS))
)
_PUSHDOWN_COLUMNS = {
    "platform": _d.c.platform, "type": _d.c.type, "kind": _d.c.kind, "node": _d.c.node_address,
    "health": _d.c.health, "emulated": _d.c.emulated, "free_memory_bytes": _FREE_MEMORY,
}
_SQL_OPERATORS = {
    "=": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
}

NODE_SELECT = sa.select(
    nodes.c.address, nodes.c.ip, nodes.c.hostname, nodes.c.state, nodes.c.registered_at,
    nodes.c.last_seen_at, nodes.c.missed_polls, nodes.c.last_error, nodes.c.suspect_reason, nodes.c.suspect_at,
)


# One device, as of :now: run with {"id": ..., "now": ...}. Built once: the statement's cache key
# is then computed once, not on every call of the busiest query.
DEVICE_BY_ID = DEVICE_SELECT.where(_d.c.id == sa.bindparam("id"))
DEVICES_BY_IDS = DEVICE_SELECT.where(_d.c.id.in_(sa.bindparam("ids", expanding=True)))
NODE_BY_ADDRESS = NODE_SELECT.where(nodes.c.address == sa.bindparam("address"))


def pushdown(flt: DeviceFilter) -> tuple[sa.Select, dict[str, object]]:
    """DEVICE_SELECT narrowed to (a superset of) what ``flt.matches`` accepts, paged by :after and
    :limit, and the parameters of its terms. The statement depends only on the filter's shape
    (which fields, which operators), so it is built once per shape and reused."""
    shape, params = [], {}
    for i, term in enumerate(flt.terms):
        if term.op == ":":
            # The JSON list is written as json.dumps does, so a capability appears quoted in it;
            # LIKE may match a little more (case), never less, and matches() decides the rest.
            params[f"p{i}"] = "%" + _like_escaped(json.dumps(term.value)) + "%"
        elif term.field in _PUSHDOWN_COLUMNS and term.op in _SQL_OPERATORS:
            params[f"p{i}"] = term.value
        else:  # a hand-built term the SQL does not know: matches() still applies it
            continue
        shape.append((f"p{i}", term.field, term.op))
    return _page_query(flt.include_lost, tuple(shape)), params


@functools.lru_cache(maxsize=256)
def _page_query(include_lost: bool, shape: tuple[tuple[str, str, str], ...]) -> sa.Select:
    clauses: list[ColumnElement] = [] if include_lost else [_d.c.health == "healthy"]
    for name, field, op in shape:
        if op == ":":
            clauses.append(_d.c.capabilities.like(sa.bindparam(name, type_=sa.Text), escape="/"))
        else:
            # Numbers bind as doubles, as the filter parsed them: a BIGINT parameter would round 1.5 to 2.
            value = sa.bindparam(name, type_=sa.Double) if field == "free_memory_bytes" else sa.bindparam(name)
            clauses.append(_SQL_OPERATORS[op](_PUSHDOWN_COLUMNS[field], value))
    return (
        DEVICE_SELECT.where(*clauses, _d.c.id > sa.bindparam("after"))
        .order_by(_d.c.id).limit(sa.bindparam("limit", type_=sa.Integer))
    )


def _like_escaped(text: str) -> str:
    return text.replace("/", "//").replace("%", "/%").replace("_", "/_")


def spec_values(spec: DeviceSpec) -> tuple:
    """Column values of ``spec`` in SPEC_COLUMNS order; JSON is canonical so equal specs compare equal."""
    return (
        spec.node_ip, spec.local_index, spec.platform, spec.kind, spec.type, spec.compute_capability,
        json.dumps(sorted(spec.capabilities)),
        json.dumps(_performance_dict(spec.performance), sort_keys=True),
        bool(spec.emulated), spec.execution_device,
    )


def _performance_dict(perf: Performance) -> dict:
    # Coerced so 312 and 312.0 from two polls do not read as a changed spec.
    return {
        **dataclasses.asdict(perf),
        "peak_tflops": {name: float(rate) for name, rate in perf.peak_tflops.items()},
        "memory_bytes": int(perf.memory_bytes),
        "memory_bandwidth_gbps": float(perf.memory_bandwidth_gbps),
        "interconnect_bandwidth_gbps": float(perf.interconnect_bandwidth_gbps),
    }


def sample(device_id: str, row: Sequence) -> DeviceSample:
    ts, total, used, utilization, temperature, power = row
    return DeviceSample(device_id, ts, total, used, utilization, temperature, power)


# Devices of one type store the same JSON text, so a large inventory decodes a handful of
# distinct values; both results are immutable and safe to share.
@functools.lru_cache(maxsize=4096)
def _capabilities(text: str) -> frozenset[str]:
    return frozenset(json.loads(text))


@functools.lru_cache(maxsize=4096)
def _performance(text: str) -> Performance:
    return Performance(**json.loads(text))


def device_record(row: Sequence) -> DeviceRecord:
    n = len(SPEC_COLUMNS)
    device_id = row[0]
    node_ip, local_index, platform, kind, type_, cc, caps, perf, emulated, execution = row[1 : n + 1]
    address, health, first_seen, updated = row[n + 1 : n + 5]
    sample_row, reserved_memory, reserved_compute = row[n + 5 : n + 11], row[n + 11], row[n + 12]
    spec = DeviceSpec(
        id=device_id, node_ip=node_ip, local_index=local_index, platform=platform, kind=kind, type=type_,
        capabilities=_capabilities(caps), compute_capability=cc,
        performance=_performance(perf), emulated=bool(emulated), execution_device=execution,
    )
    latest = sample(device_id, sample_row) if sample_row[0] is not None else None
    return DeviceRecord(spec, address, health, latest, reserved_memory, reserved_compute, first_seen, updated)
