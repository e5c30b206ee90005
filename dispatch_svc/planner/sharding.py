"""Data-parallel sharding: split a job's rows among devices by their throughput.

Each device gets a share of rows proportional to its rate (see ``apportion`` for the rounding and
its error bound); shares are contiguous row ranges laid out in the order the devices are given,
so shard order is row order and results combine in shard order. A device whose share is zero is
left out. With ``max_shard_rows`` a device's share is cut into consecutive shards that the device
runs one after another, so its total time is unchanged: the cap bounds message and memory size
and lets a failed shard be retried without redoing the device's whole share.

With ``bucket_rungs`` every shard's row count comes from a small ladder fixed by the job's shape
(``buckets``): shares are split in whole units of the ladder, so a program's jobs of one input
size build the same few executables however the measured rates move.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from accelmesh.errors import FailedPrecondition, InvalidArgument
from dispatch_svc.planner.apportion import equal_rows, makespan, min_makespan_rows, proportional_rows
from dispatch_svc.planner.buckets import bucket_ladder


@dataclass(frozen=True)
class PlannedDevice:
    """A device the job may use and the rows per second it is expected to process."""

    device_id: str
    target_type: str  # TargetType.key: devices of one type share an artifact
    rows_per_second: float


@dataclass(frozen=True)
class Shard:
    """Consecutive rows run on one device (ShardPlan)."""

    index: int  # results combine in this order
    device_id: str
    target_type: str
    first_row: int
    rows: int
    predicted_seconds: float  # this shard alone on its device


@dataclass(frozen=True)
class ShardingPlan:
    """The shards in row order and the predicted makespans (Plan)."""

    shards: tuple[Shard, ...]
    predicted_seconds: float  # until the slowest device finishes all its shards
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
    """Split ``total_rows`` among ``devices`` by their rates.

    ``exact=False`` rounds proportional shares by largest remainder (within one row-time of the
    optimum); ``exact=True`` gives the integer split with the smallest makespan. With
    ``min_shard_rows`` above 1, only the fastest devices whose proportional share among
    themselves reaches it are used (slower ones would get slivers whose fixed costs dominate),
    unless the whole job is smaller, when the fastest device takes it all.

    With ``bucket_rungs``, the same holds in whole units of the job's bucket ladder instead of
    rows (``buckets.bucket_ladder``): each share is cut into the ladder's rungs, and the tail
    (rows % unit) goes to the kept device that finishes earliest with it.
    """
    _check(total_rows, devices, max_shard_rows, min_shard_rows)
    rates = [device.rows_per_second for device in devices]
    ladder = None if bucket_rungs is None else bucket_ladder(total_rows, max_shard_rows, bucket_rungs)
    unit = 1 if ladder is None else ladder.unit
    units, min_units = total_rows // unit, -(-min_shard_rows // unit)
    kept = _fastest_reaching(units, rates, min_units) if min_units > 1 else range(len(devices))
    kept_rates = [rates[i] for i in kept]
    split = min_makespan_rows if exact else proportional_rows
    rows = [0] * len(devices)
    for i, n in zip(kept, split(units, kept_rates)):
        rows[i] = n * unit
    pieces = [_pieces(n, max_shard_rows) if ladder is None else ladder.pieces(n) for n in rows]
    if ladder is not None and ladder.tail:
        i = min(kept, key=lambda i: ((rows[i] + ladder.tail) / rates[i], i))
        rows[i] += ladder.tail
        pieces[i].append(ladder.tail)

    shards: list[Shard] = []
    first_row = 0
    for device, device_pieces in zip(devices, pieces):
        for piece in device_pieces:
            shards.append(Shard(len(shards), device.device_id, device.target_type, first_row, piece,
                                piece / device.rows_per_second))
            first_row += piece
    return ShardingPlan(
        shards=tuple(shards),
        predicted_seconds=makespan(rows, rates),
        equal_split_predicted_seconds=makespan(equal_rows(total_rows, len(devices)), rates),
    )


def group_by_target_type(devices: Iterable[PlannedDevice]) -> dict[str, list[PlannedDevice]]:
    """Devices per target type (one artifact each), types and devices in first-seen order."""
    groups: dict[str, list[PlannedDevice]] = {}
    for device in devices:
        groups.setdefault(device.target_type, []).append(device)
    return groups


def _fastest_reaching(total_rows: int, rates: Sequence[float], min_rows: int) -> list[int]:
    """Indices (in device order) of the largest fastest-first set whose slowest member's share
    N * r_k / (r_1 + ... + r_k) is at least ``min_rows``; that share only shrinks as k grows, so
    the first k that fails ends the scan, and rounding gives every kept device >= floor(share)."""
    order = sorted(range(len(rates)), key=lambda i: (-rates[i], i))
    kept, prefix = [order[0]], rates[order[0]]
    for i in order[1:]:
        prefix += rates[i]
        if total_rows * rates[i] / prefix < min_rows:
            break
        kept.append(i)
    return sorted(kept)


def _pieces(rows: int, max_rows: int | None) -> list[int]:
    """``rows`` cut into the fewest near-equal pieces of at most ``max_rows``, larger ones first."""
    if rows == 0:
        return []
    if max_rows is None or rows <= max_rows:
        return [rows]
    return equal_rows(rows, -(-rows // max_rows))


def _check(total_rows: int, devices: Sequence[PlannedDevice], max_shard_rows: int | None, min_shard_rows: int) -> None:
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows <= 0:
        raise InvalidArgument(f"total_rows must be a positive whole number of rows, got {total_rows!r}; "
                              "declare the inputs' full shapes with at least one row")
    if not devices:
        raise FailedPrecondition("no devices to shard over; relax the job's constraints or add devices "
                                 "to the inventory")
    seen: set[str] = set()
    for device in devices:
        rate = device.rows_per_second
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise InvalidArgument(f"device {device.device_id!r}: rows_per_second must be a positive finite "
                                  f"number, got {rate!r}; leave out devices that cannot run the program")
        if device.device_id in seen:
            raise InvalidArgument(f"device {device.device_id!r} is listed twice; list each device once")
        seen.add(device.device_id)
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
