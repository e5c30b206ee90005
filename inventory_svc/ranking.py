"""ScoreDevices over the device index's columns: the filter as array masks and the task-aware
score (``scoring.py``, requirements B1, B2) as array arithmetic, the same operations in the same
order as ``scoring.score_devices`` over records, so both rank alike to the last bit
(tests/inventory/test_device_index.py holds them to it). Only the devices returned become records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from accelmesh.hardware.model import DeviceSpec, Performance
from accelmesh.scoring import DeviceStatus, Weights, normalised, weighted
from inventory_svc.filtering import DeviceFilter, Term
from inventory_svc.records import DeviceRecord
from inventory_svc.scoring import TaskProfile, weights_from_balance

INITIAL_SLOTS = 1024
_OPS = {"=": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
        ">=": np.greater_equal}
_HEALTH = {"healthy": 0, "lost": 1}


class Codes:
    """The distinct values of one field, numbered as first seen: the columns hold the numbers."""

    def __init__(self) -> None:
        self.values: list = []
        self._codes: dict = {}

    def code(self, value) -> int:
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self.values)
            self.values.append(value)
        return code

    def find(self, value) -> int:
        """The value's number; -1, which no slot holds, for one never seen."""
        return self._codes.get(value, -1)


class Columns:
    """One slot per device: what filtering and scoring read, as numpy arrays grown by doubling."""

    _KINDS: ClassVar[dict[str, type]] = {
        "live": bool, "healthy": bool, "emulated": bool, "platform": np.int32, "type": np.int32,
        "kind": np.int32, "node": np.int32, "caps": np.int32, "perf": np.int32, "total": np.int64,
        "used": np.int64, "utilization": np.float64,
    }

    def __init__(self) -> None:
        self.size = 0
        for name, kind in self._KINDS.items():
            setattr(self, name, np.zeros(INITIAL_SLOTS, kind))
        self.ids: list[str | None] = []
        self.platforms, self.types, self.kinds, self.nodes, self.capsets = Codes(), Codes(), Codes(), Codes(), Codes()
        self.perfs = Codes()  # keyed by what scoring reads of a Performance
        self.performances: list[Performance] = []  # by perf code
        self._rates: dict[str, np.ndarray] = {}
        self._ranks: np.ndarray | None = None

    def grow(self) -> int:
        """A new slot at the end."""
        if self.size == len(self.live):
            for name in self._KINDS:
                old = getattr(self, name)
                new = np.zeros(2 * len(old), old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
        self.ids.append(None)
        self.size += 1
        return self.size - 1

    def set_static(self, slot: int, spec: DeviceSpec, node: str, healthy: bool, perf_key: tuple) -> None:
        if self.ids[slot] != spec.id:
            self.ids[slot] = spec.id
            self._ranks = None
        self.live[slot], self.healthy[slot], self.emulated[slot] = True, healthy, bool(spec.emulated)
        self.platform[slot] = self.platforms.code(spec.platform)
        self.type[slot] = self.types.code(spec.type)
        self.kind[slot] = self.kinds.code(spec.kind)
        self.node[slot] = self.nodes.code(node)
        self.caps[slot] = self.capsets.code(spec.capabilities)
        perf = self.perfs.code(perf_key)
        if perf == len(self.performances):
            self.performances.append(spec.performance)
            self._rates = {}
        self.perf[slot] = perf

    def set_sample(self, slot: int, total: int, used: int, utilization: float) -> None:
        self.total[slot], self.used[slot], self.utilization[slot] = total, used, utilization

    def clear(self, slot: int) -> None:
        self.live[slot] = self.healthy[slot] = False
        self.ids[slot] = None
        self._ranks = None

    def ids_changed(self) -> None:
        self._ranks = None

    def rates(self, precision: str) -> np.ndarray:
        """Peak TFLOP/s at ``precision`` by perf code (Performance.rate_tflops)."""
        if precision not in self._rates:
            self._rates[precision] = np.array([p.rate_tflops(precision) for p in self.performances], float)
        return self._rates[precision]

    def bandwidths(self) -> np.ndarray:
        if "" not in self._rates:  # cached beside the rates, dropped with them
            self._rates[""] = np.array([p.memory_bandwidth_gbps for p in self.performances], float)
        return self._rates[""]

    def ranks(self) -> np.ndarray:
        """Each slot's place in device id order (ties in score go to the lower id)."""
        if self._ranks is None:
            order = np.argsort(np.array([i or "" for i in self.ids], dtype=str), kind="stable")
            self._ranks = np.empty(self.size, np.int64)
            self._ranks[order] = np.arange(self.size)
        return self._ranks


@dataclass(frozen=True)
class Ranked:
    weights: Weights
    rows: list[tuple[int, float, dict[str, float], DeviceStatus]]  # slot, score, components, status; best first


def rank(columns: Columns, flt: DeviceFilter, profile: TaskProfile, limit: int, reserved_bytes: np.ndarray,
         reserved_compute: np.ndarray, within: np.ndarray | None,
         record_at: Callable[[int], DeviceRecord]) -> Ranked:
    """The devices ``flt`` matches (among the slots ``within``), scored as scoring.score_devices
    scores records, best first, ``limit`` of them (0: all). ``reserved_*``: live leases per slot."""
    n = columns.size
    free = np.maximum(columns.total[:n] - columns.used[:n] - reserved_bytes, 0)  # free_memory_bytes
    mask = matching(columns, flt, free, record_at)
    if within is not None:
        chosen = np.zeros(n, bool)
        chosen[within] = True
        mask &= chosen
    slots = np.flatnonzero(mask)
    perf = columns.perf[slots]
    peak, bandwidth_peak = columns.rates(profile.precision)[perf], columns.bandwidths()[perf]
    weights = _weights(profile, columns, perf)
    # accelmesh.scoring.free_status, over arrays.
    unreserved = 1.0 - np.clip(reserved_compute[slots], 0.0, 1.0)
    compute = peak * (1.0 - np.clip(columns.utilization[slots], 0.0, 1.0)) * unreserved
    bandwidth = bandwidth_peak * unreserved
    memory = free[slots]
    components = normalised(compute, memory.astype(float), bandwidth)
    scores = weighted(components, weights)
    order = _best(scores, columns.ranks()[slots], limit)
    parts = {name: values[order].tolist() for name, values in components.items()}
    rows = [
        (int(slot), score, {name: parts[name][k] for name in parts}, DeviceStatus(c, m, b))
        for k, (slot, score, c, m, b) in enumerate(zip(
            slots[order].tolist(), scores[order].tolist(), compute[order].tolist(), memory[order].tolist(),
            bandwidth[order].tolist()))
    ]
    return Ranked(weights, rows)


def matching(columns: Columns, flt: DeviceFilter, free: np.ndarray,
             record_at: Callable[[int], DeviceRecord]) -> np.ndarray:
    """The slots whose device ``flt.matches`` (filtering.py), as a mask."""
    n = columns.size
    mask = columns.live[:n].copy()
    if not flt.include_lost:
        mask &= columns.healthy[:n]
    for term in flt.terms:
        mask &= _term(columns, term, free, mask, record_at)
    return mask


def _term(c: Columns, term: Term, free: np.ndarray, mask: np.ndarray,
          record_at: Callable[[int], DeviceRecord]) -> np.ndarray:
    n, op, value = c.size, term.op, term.value
    if op == ":":
        has = np.array([value in caps for caps in c.capsets.values] + [False], bool)
        return has[c.caps[:n]]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if term.field == "free_memory_bytes" and op in _OPS and number:
        return _OPS[op](free.astype(float), float(value))
    if term.field == "emulated" and op in ("=", "!=") and isinstance(value, bool):
        return _OPS[op](c.emulated[:n], value)
    if op in ("=", "!=") and isinstance(value, str):
        if term.field == "health":
            codes, code = (~c.healthy[:n]).astype(np.int32), _HEALTH.get(value, -1)
        else:
            column, table = {"platform": (c.platform, c.platforms), "type": (c.type, c.types),
                             "kind": (c.kind, c.kinds), "node": (c.node, c.nodes)}.get(term.field, (None, None))
            if column is None:
                return _by_record(term, mask, record_at)
            codes, code = column[:n], table.find(value)
        return _OPS[op](codes, code)
    return _by_record(term, mask, record_at)


def _by_record(term: Term, mask: np.ndarray, record_at: Callable[[int], DeviceRecord]) -> np.ndarray:
    """A term the columns cannot answer (hand-built): filtering's own test, device by device."""
    probe, out = DeviceFilter((term,), include_lost=True), np.zeros(len(mask), bool)
    for slot in np.flatnonzero(mask):
        out[slot] = probe.matches(record_at(int(slot)))
    return out


def _weights(profile: TaskProfile, columns: Columns, perf: np.ndarray) -> Weights:
    """scoring.weights_for over the candidates: each balance point is its datasheet's, so the
    median is taken over the distinct datasheets, each counted as often as candidates have it."""
    if profile.weights is not None:
        return profile.weights.normalised()
    rates, bandwidths = columns.rates(profile.precision), columns.bandwidths()
    valid = (bandwidths > 0) & (rates > 0)
    balances = np.where(valid, rates * 1e3 / np.where(valid, bandwidths, 1.0), 0.0)
    counts = np.bincount(perf, minlength=len(rates)) * valid
    order = [int(k) for k in np.argsort(balances, kind="stable") if counts[k]]
    total = int(counts.sum())
    if not total:
        return weights_from_balance(profile, None)

    def nth(index: int) -> float:  # the index-th balance in ascending order
        for k in order:
            if index < counts[k]:
                return float(balances[k])
            index -= int(counts[k])
        raise AssertionError("unreachable")

    middle = total // 2
    balance = nth(middle) if total % 2 else (nth(middle - 1) + nth(middle)) / 2  # statistics.median
    return weights_from_balance(profile, balance)


def _best(scores: np.ndarray, ranks: np.ndarray, limit: int) -> np.ndarray:
    """Positions in ``scores`` by score, highest first, ties by id rank; the first ``limit`` (0: all)."""
    if limit and limit < len(scores):
        kth = np.partition(-scores, limit - 1)[limit - 1]
        pick = np.flatnonzero(-scores <= kth)  # the top `limit` and everything tied with the last
    else:
        pick = np.arange(len(scores))
    order = pick[np.lexsort((ranks[pick], -scores[pick]))]
    return order[:limit] if limit else order
