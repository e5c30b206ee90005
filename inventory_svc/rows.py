"""The store's SQL text and the conversion between its rows and the inventory's records.

Kept apart from ``store.py`` so the store reads as what it does (transactions, rules, errors)
and this module as how the data is laid out in the tables of ``migrations.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

from accelmesh.hardware.model import DeviceSample, DeviceSpec, Performance
from inventory_svc.filtering import DeviceFilter
from inventory_svc.records import DeviceRecord

SPEC_COLUMNS = (
    "node_ip", "local_index", "platform", "kind", "type", "compute_capability",
    "capabilities", "performance", "emulated", "execution_device",
)
SAMPLE_COLUMNS = "ts, memory_total, memory_used, utilization, temperature_c, power_w"
_RESERVED_SQL = (
    "(SELECT COALESCE(SUM({column}), {zero}) FROM reservations r WHERE r.device_id = d.id AND r.expires_at > :now)"
)
# Mirrors accelmesh.hardware.model.free_memory_bytes so free-memory filters run in SQL rather than
# decoding every row in Python (a filter matching nothing would otherwise scan 10,000 rows).
_FREE_MEMORY_SQL = (
    "MAX(0, COALESCE(s.memory_total, json_extract(d.performance, '$.memory_bytes')) - COALESCE(s.memory_used, 0) - "
    + _RESERVED_SQL.format(column="memory_bytes", zero=0)
    + ")"
)
# One row per device with its latest sample and live reservation sums: every lookup is an
# index seek, which keeps a 100-row page over 10,000 devices at a few milliseconds.
DEVICE_SELECT = f"""
SELECT d.id, {', '.join('d.' + c for c in SPEC_COLUMNS)}, d.node_address, d.health, d.first_seen_at, d.updated_at,
       {', '.join('s.' + c.strip() for c in SAMPLE_COLUMNS.split(','))},
       {_RESERVED_SQL.format(column="memory_bytes", zero=0)},
       {_RESERVED_SQL.format(column="compute_fraction", zero=0.0)}
FROM devices d
LEFT JOIN status_samples s ON s.device_id = d.id AND s.ts = (SELECT MAX(ts) FROM status_samples WHERE device_id = d.id)
"""
_PUSHDOWN_COLUMNS = {
    "platform": "d.platform", "type": "d.type", "kind": "d.kind", "node": "d.node_address",
    "health": "d.health", "emulated": "d.emulated", "free_memory_bytes": _FREE_MEMORY_SQL,
}
_SQL_OPERATORS = frozenset({"=", "!=", "<", "<=", ">", ">="})


NODE_SELECT = (
    "SELECT address, ip, hostname, state, registered_at, last_seen_at, missed_polls, last_error FROM nodes"
)


def pushdown(flt: DeviceFilter) -> tuple[list[str], dict[str, object]]:
    clauses: list[str] = [] if flt.include_lost else ["d.health = 'healthy'"]
    params: dict[str, object] = {}
    for i, term in enumerate(flt.terms):
        key = f"p{i}"
        if term.op == ":":
            clauses.append(f"EXISTS (SELECT 1 FROM json_each(d.capabilities) WHERE value = :{key})")
        elif term.field in _PUSHDOWN_COLUMNS and term.op in _SQL_OPERATORS:
            clauses.append(f"{_PUSHDOWN_COLUMNS[term.field]} {term.op} :{key}")
        else:  # a hand-built term the SQL does not know: matches() still applies it
            continue
        params[key] = int(term.value) if isinstance(term.value, bool) else term.value
    return clauses, params


def spec_values(spec: DeviceSpec) -> tuple:
    """Column values of ``spec`` in SPEC_COLUMNS order; JSON is canonical so equal specs compare equal."""
    return (
        spec.node_ip, spec.local_index, spec.platform, spec.kind, spec.type, spec.compute_capability,
        json.dumps(sorted(spec.capabilities)),
        json.dumps(_performance_dict(spec.performance), sort_keys=True),
        int(spec.emulated), spec.execution_device,
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
