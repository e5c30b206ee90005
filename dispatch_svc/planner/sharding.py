"""Data-parallel sharding: split a job's rows among devices by what a shard costs on each.

A device's time for n rows is fixed_seconds + n / rows_per_second (the throughput model's fit),
and nothing when it gets no rows; the split minimises the makespan under it (``apportion``: the
LP optimum's water level, its rounding and the exact integer optimum), so a device whose fixed
cost alone exceeds the makespan gets no rows. Shares are contiguous row ranges laid out in the
order the devices are given, so shard order is row order and results combine in shard order. A
device whose share is zero is left out. With ``max_shard_rows`` a device's share is cut into
consecutive shards that the device runs one after another: the cap bounds message and memory
size and lets a failed shard be retried without redoing the device's whole share.

A shard's own prediction is fixed + rows / rate. The split and the plan's predicted makespan
charge a device its fixed cost once, the model the split is exact for (and the one the equal
split is priced by); a share cut into k pieces pays it k times, so its shards' predictions sum to
(k - 1) fixed costs more: of the load, the part a worker that already holds an executable does
not pay again, and of the sending, the part the next shard overlaps with the one running.

With ``bucket_rungs`` every shard's row count comes from a small ladder fixed by the job's shape
(``buckets``): shares are split in whole units of the ladder, so a program's jobs of one input
size build the same few executables however the measured rates move.

The arithmetic is numpy's over all devices at once (``apportion``'s array forms), and the devices
and shards are named tuples, which cost half what frozen dataclasses do to make: a plan over
80,000 devices takes milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from accelmesh.errors import FailedPrecondition, InvalidArgument
from dispatch_svc.planner.apportion import equal_array, equal_rows, makespan, min_makespan_array, proportional_array
from dispatch_svc.planner.buckets import bucket_ladder


class PlannedDevice(NamedTuple):
    """A device the job may use and what a shard is expected to cost on it."""

    device_id: str
    target_type: str  # TargetType.key: devices of one type share an artifact
    rows_per_second: float  # the marginal rate
    fixed_seconds: float = 0.0  # paid by every shard whatever its rows


class DeviceColumns(Sequence):
    """Devices as columns, a PlannedDevice made only for one asked for by index: what a job over
    80,000 devices plans with, so that planning makes no object per device (making them, and the
    collector's passes over a heap that size, cost more than the split itself). ``fixed``: each
    device's fixed seconds per shard; None for none."""

    def __init__(self, ids: Sequence[str], target_types: Sequence[str], rates: Sequence[float],
                 fixed: Sequence[float] | None = None):
        if not len(ids) == len(target_types) == len(rates) == (len(rates) if fixed is None else len(fixed)):
            raise InvalidArgument(f"{len(ids)} ids, {len(target_types)} target types, {len(rates)} rates and "
                                  f"{len(rates) if fixed is None else len(fixed)} fixed costs: give one of each "
                                  "per device")
        self.ids, self.target_types, self.rates, self.fixed = ids, target_types, rates, fixed

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return PlannedDevice(self.ids[i], self.target_types[i], self.rates[i],
                             0.0 if self.fixed is None else self.fixed[i])


class Shard(NamedTuple):
    """Consecutive rows run on one device (ShardPlan)."""

    index: int  # results combine in this order
    device_id: str
    target_type: str
    first_row: int
    rows: int
    predicted_seconds: float  # this shard alone on its device: its fixed cost plus its rows


@dataclass(frozen=True)
class ShardingPlan:
    """The shards in row order and the predicted makespans (Plan)."""

    shards: tuple[Shard, ...]
    predicted_seconds: float  # until the slowest device finishes its rows, its fixed cost once
    equal_split_predicted_seconds: float  # the same for equal shares over every given device

    def rows_by_device(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for shard in self.shards:
            totals[shard.device_id] = totals.get(shard.device_id, 0) + shard.rows
        return totals


def plan_shards(
    total_rows: int,
    devices: Sequence[PlannedDevice],
    *,
    max_shard_rows: int | None = None,
    min_shard_rows: int = 1,
    exact: bool = False,
    bucket_rungs: int | None = None,
) -> ShardingPlan:
    """Split ``total_rows`` among ``devices`` by their costs (fixed seconds + rows / rate).

    ``exact=False`` rounds the LP optimum's shares by largest remainder (within one row-time of
    the optimum); ``exact=True`` gives the integer split with the smallest makespan. With
    ``min_shard_rows`` above 1, only the fastest devices whose proportional share among
    themselves reaches it are used (slower ones would get slivers whose fixed costs dominate),
    unless the whole job is smaller, when the fastest device takes it all.

    With ``bucket_rungs``, the same holds in whole units of the job's bucket ladder instead of
    rows (``buckets.bucket_ladder``): each share is cut into the ladder's rungs, and the tail
    (rows % unit) goes to the kept device that finishes earliest with it.
    """
    rates, fixed = _check(total_rows, devices, max_shard_rows, min_shard_rows)
    ladder = None if bucket_rungs is None else bucket_ladder(total_rows, max_shard_rows, bucket_rungs)
    unit = 1 if ladder is None else ladder.unit
    units, min_units = total_rows // unit, -(-min_shard_rows // unit)
    kept = _fastest_reaching(units, rates, min_units) if min_units > 1 else np.arange(len(devices))
    split = min_makespan_array if exact else proportional_array
    rows = np.zeros(len(devices), np.int64)
    # Split in units of q rows: f + u q / r, over q, is f / q + u / r, so the fixed costs scale instead.
    rows[kept] = split(units, rates[kept], None if fixed is None else fixed[kept] / unit) * unit
    pieces = {int(i): (_pieces(int(rows[i]), max_shard_rows) if ladder is None else ladder.pieces(int(rows[i])))
              for i in np.flatnonzero(rows)}  # a device without rows has no pieces
    if ladder is not None and ladder.tail:
        # The kept device finishing earliest with the tail (np.argmin: the first, so the lowest index).
        finish = (rows[kept] + ladder.tail) / rates[kept]
        i = int(kept[np.argmin(finish if fixed is None else fixed[kept] + finish)])
        rows[i] += ladder.tail
        pieces.setdefault(i, []).append(ladder.tail)

    shards: list[Shard] = []
    first_row = 0
    used = sorted(pieces)
    costs = [0.0] * len(used) if fixed is None else fixed[used].tolist()  # plain floats: cheaper per shard
    for i, cost in zip(used, costs):
        device = devices[i]
        for piece in pieces[i]:
            shards.append(Shard(len(shards), device.device_id, device.target_type, first_row, piece,
                                cost + piece / device.rows_per_second))
            first_row += piece
    return ShardingPlan(
        shards=tuple(shards),
        predicted_seconds=makespan(rows, rates, fixed),
        equal_split_predicted_seconds=makespan(equal_array(total_rows, len(devices)), rates, fixed),
    )


def group_by_target_type(devices: Iterable[PlannedDevice]) -> dict[str, list[PlannedDevice]]:
    """Devices per target type (one artifact each), types and devices in first-seen order."""
    groups: dict[str, list[PlannedDevice]] = {}
    for device in devices:
        groups.setdefault(device.target_type, []).append(device)
    return groups


def _fastest_reaching(total_rows: int, rates: np.ndarray, min_rows: int) -> np.ndarray:
    """Indices (in device order) of the largest fastest-first set whose slowest member's share
    N * r_k / (r_1 + ... + r_k) is at least ``min_rows``; that share only shrinks as k grows, so
    the first k that fails ends the set, and rounding gives every kept device >= floor(share)."""
    order = np.lexsort((np.arange(len(rates)), -rates))
    prefix = np.cumsum(rates[order])  # running sums, added one after another as a loop would
    fails = total_rows * rates[order[1:]] / prefix[1:] < min_rows
    first_fail = int(np.argmax(fails)) if fails.any() else len(fails)
    return np.sort(order[: 1 + first_fail])


def _pieces(rows: int, max_rows: int | None) -> list[int]:
    """``rows`` cut into the fewest near-equal pieces of at most ``max_rows``, larger ones first."""
    if rows == 0:
        return []
    if max_rows is None or rows <= max_rows:
        return [rows]
    return equal_rows(rows, -(-rows // max_rows))


_NUMBERS = {int, float, bool, np.float64}


def _check(total_rows: int, devices: Sequence[PlannedDevice], max_shard_rows: int | None,
           min_shard_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Refuse bad input naming the first bad device, as a device-by-device check would; the rates
    and the fixed costs (None when every one is 0) as arrays."""
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows <= 0:
        raise InvalidArgument(f"total_rows must be a positive whole number of rows, got {total_rows!r}; "
                              "declare the inputs' full shapes with at least one row")
    if not devices:
        raise FailedPrecondition("no devices to shard over; relax the job's constraints or add devices "
                                 "to the inventory")
    columns = isinstance(devices, DeviceColumns)
    raw = list(devices.rates) if columns else [device.rows_per_second for device in devices]
    ids = devices.ids if columns else [d.device_id for d in devices]
    rates = np.array(raw, float) if set(map(type, raw)) <= _NUMBERS else None
    if rates is None or not (np.isfinite(rates).all() and (rates > 0).all()) or len(set(ids)) != len(devices):
        _first_bad_device(devices)  # names the first device at fault, as checking one by one would
        rates = np.array(raw, float)  # none was: numbers of some other float type
    raw_fixed = devices.fixed if columns else [device.fixed_seconds for device in devices]
    fixed = None
    if raw_fixed is not None:
        try:  # a string or None among them fails here or as NaN below, and is then named
            fixed = np.array(raw_fixed, float)
        except (TypeError, ValueError):
            fixed = None
        if fixed is None or not (np.isfinite(fixed).all() and (fixed >= 0).all()):
            _first_bad_device(devices)
            fixed = np.array(raw_fixed, float)
        if not fixed.any():
            fixed = None  # the plain rate model: its arithmetic exactly
    _check_bounds(max_shard_rows, min_shard_rows)
    return rates, fixed


def _first_bad_device(devices: Sequence[PlannedDevice]) -> None:
    seen: set[str] = set()
    for device in devices:
        rate = device.rows_per_second
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise InvalidArgument(f"device {device.device_id!r}: rows_per_second must be a positive finite "
                                  f"number, got {rate!r}; leave out devices that cannot run the program")
        fixed = device.fixed_seconds
        if not (isinstance(fixed, (int, float)) and math.isfinite(fixed) and fixed >= 0):
            raise InvalidArgument(f"device {device.device_id!r}: fixed_seconds must be a finite number of seconds "
                                  f">= 0, got {fixed!r}; use 0 when a shard's fixed cost is not known")
        if device.device_id in seen:
            raise InvalidArgument(f"device {device.device_id!r} is listed twice; list each device once")
        seen.add(device.device_id)


def _check_bounds(max_shard_rows: int | None, min_shard_rows: int) -> None:
    if min_shard_rows < 1:
        raise InvalidArgument(f"min_shard_rows must be at least 1, got {min_shard_rows!r}")
    if max_shard_rows is not None:
        if max_shard_rows < 1:
            raise InvalidArgument(f"max_shard_rows must be at least 1 or None, got {max_shard_rows!r}")
        # Cutting n > max rows into ceil(n / max) near-equal pieces leaves each piece at least
        # (max + 1) // 2 rows; a larger minimum could not always be met.
        if min_shard_rows > (max_shard_rows + 1) // 2:
            raise InvalidArgument(f"min_shard_rows {min_shard_rows} is more than half of max_shard_rows "
                                  f"{max_shard_rows}; lower it to at most {(max_shard_rows + 1) // 2} so every "
                                  "share can be cut into shards within both bounds")
