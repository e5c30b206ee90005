"""The placement of requirements B4-B6: layers sorted by parameter count, largest first; each goes
to the device with the best task-weighted status (accelmesh.scoring.combine, the inventory's own
formula) among those whose free memory holds it; what the layer needs is reserved and the
statuses are updated before the next layer (B5): free memory drops by what the layer needs, and
free compute by its predicted time on the device over the model's ideal step time (the lower
bound on the N best devices), so a fast device takes more layers than a slow one before it
scores worse. The model's device count N (B6: the client's,
else the fewest best devices whose memory holds it) decides the pool: the N largest layers each
open a new device, the remaining layers go only to chosen ones. Every step is explained.

The statuses are arrays in the order the devices come, and a tie in score goes to the lower device
id (``_first_by_id``) rather than to the first of an id-sorted copy: over 80,000 devices the
sorting alone took longer than the placement.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from accelmesh.scoring import Weights, normalised, weighted
from dispatch_svc.planner.layer_model import (
    Model,
    capacities,
    evaluate,
    initial_score_array,
    rates,
    required_devices,
    status_scores,
    summary,
    top_by_score,
)
from dispatch_svc.planner.lower_bound import lower_bound_seconds
from dispatch_svc.planner.placement_types import RANKED, ByDevice, Device, NoRoom, Placement


def place_ranked(model: Model, devices: Sequence[Device]) -> Placement:
    """requirements B4-B6; when the device count was derived and the chosen devices cannot take a
    layer, one more device is allowed and the placement starts over (explained)."""
    values = initial_score_array(devices, model.task.weights)
    count = required_devices(model, devices, values)
    while True:
        try:
            return _ranked(model, devices, values, count)
        except NoRoom as exc:
            if model.task.device_count or count >= len(devices) or not exc.wider:
                raise
            count += 1


def _ranked(model: Model, devices: Sequence[Device], values: np.ndarray, count: int) -> Placement:
    """requirements B4-B6 as one loop: largest layer first, the best-scoring device with room, its status
    updated before the next layer. Kept in one function so that the status arrays it updates (B5)
    are visibly the ones the next choice reads."""
    task = model.task
    weights = task.weights
    ids = [d.id for d in devices]
    # The status of every device as arrays (B1): what is free is updated after each layer (B5).
    rate, bandwidth = rates(devices)
    free = capacities(devices, task)
    caps = ByDevice(ids, free.copy())  # free changes as layers are placed; the capacities do not
    # The compute a layer reserves on a device (B5) is its predicted time there over the model's
    # ideal step on the N best devices: a device is full once it holds its fair share of work.
    fair = lower_bound_seconds(model, top_by_score(devices, values, count), mixed_replicas=False)
    load = np.zeros(len(ids))  # fraction of the fair step the device's layers take
    idle_peaks = None  # once every device is chosen: the largest rate, memory, bandwidth of the rest
    chosen = np.zeros(len(ids), bool)
    where: list[int] = [-1] * len(model)  # device index of each layer
    explain = [
        f"ranked: {len(model)} layers by parameter count, largest first, over {len(devices)} devices; "
        f"weights compute {weights.compute:.2f}, memory {weights.memory:.2f}, bandwidth {weights.bandwidth:.2f}; "
        f"the model needs {model.total_need():,} bytes, so {count} device(s)"
        + (" (the client's count)" if task.device_count else
           f" (usable memory after {task.headroom:.0%} headroom: requirements B6's count, which ranked keeps; balanced "
           "and auto take as many devices as lower the step)")]
    order = sorted(range(len(model)), key=lambda i: (-model.layers[i].parameter_count, i))
    for i in order:
        layer = model.layers[i]
        need = _needs(model, i, where, len(ids))
        # Until `count` devices are chosen each layer opens a new one (the largest layers spread
        # over the devices the model needs); after that only chosen devices take layers (B6).
        opening = int(chosen.sum()) < count
        pool = ~chosen if opening else chosen
        fits = pool & (need <= free)
        if not fits.any() and opening:  # no new device holds it: a chosen one may
            pool = chosen
            fits = pool & (need <= free)
        if not fits.any():
            pool = pool if pool.any() else np.ones(len(ids), bool)
            largest = _first_by_id(np.where(pool, free, -1), ids)
            short = int(need[largest] - free[largest])
            raise NoRoom(
                f"layer {layer.name!r} ({layer.parameter_count:,} parameters) needs {int(need[largest]):,} bytes but "
                f"{'any device' if opening else f'any of the {count} chosen devices'} has at most "
                f"{int(free[largest]):,} bytes free ({ids[largest]}): short by {short:,} bytes",
                shortfall_bytes=short, wider=not opening)
        if opening:
            scored = status_scores(rate, bandwidth, free.astype(float), load, weights)
        else:  # only chosen devices take layers now: score them alone (the others never change)
            if idle_peaks is None:
                idle_peaks = [values_[~chosen].max(initial=0.0) for values_ in (rate, free.astype(float), bandwidth)]
            scored = _chosen_scores(rate, bandwidth, free, load, weights, chosen, idle_peaks)
        ranking = np.where(fits, scored, -np.inf)
        best = _first_by_id(ranking, ids)
        ranking[best] = -np.inf
        second = _first_by_id(ranking, ids) if np.isfinite(ranking).any() else -1
        where[i] = best
        free[best] -= need[best]
        seconds = model.compute_seconds(i, devices[best])
        load[best] += seconds / fair if fair > 0 else 0.0
        if model.owner[i] < 0:  # an owner joining a layer that shares its parameters frees the copy
            for j, owner in enumerate(model.owner):
                if owner == i and where[j] == best:
                    free[best] += model.shared_need[j]
        new = not chosen[best]
        chosen[best] = True
        runner_up = f"; next best {ids[second]} {scored[second]:.3f}" if second >= 0 else ""
        explain.append(
            f"{layer.name} ({layer.parameter_count:,} params, needs {int(need[best]):,} B) -> {ids[best]} "
            f"score {scored[best]:.3f}{runner_up}; {int(fits.sum())} of {int(pool.sum())} "
            f"{'new' if new else 'chosen'} devices had room; reserved {seconds * 1e3:.3g} ms of a "
            f"{fair * 1e3:.3g} ms fair step ({min(load[best], 9.99):.0%} busy) and memory, {int(free[best]):,} B left"
            + (f"; device {int(chosen.sum())} of {count}" if new else ""))
    placed = tuple(ids[k] for k in where)
    evaluation = evaluate(model, [devices[k] for k in set(where)], placed)
    explain.append(summary(RANKED, evaluation))
    return Placement(RANKED, placed, evaluation, caps, ByDevice(ids, values), explain)


def _chosen_scores(rate: np.ndarray, bandwidth: np.ndarray, free: np.ndarray, load: np.ndarray, weights: Weights,
                   chosen: np.ndarray, idle_peaks: list[float]) -> np.ndarray:
    """``status_scores`` at the chosen devices (-inf elsewhere), the same arithmetic: each metric
    over its largest among all devices, the unchosen ones' being ``idle_peaks`` (their load is 0)."""
    at = np.flatnonzero(chosen)
    idle = np.clip(1.0 - load[at], 0.0, None)
    metrics = (rate[at] * idle, free[at].astype(float), bandwidth[at] * idle)
    parts = normalised(*(np.append(m, peak) for m, peak in zip(metrics, idle_peaks)))  # the peak joins the max
    out = np.full(len(rate), -np.inf)
    out[at] = weighted({name: part[:-1] for name, part in parts.items()}, weights)
    return out


def _first_by_id(values: np.ndarray, ids: Sequence[str]) -> int:
    """The index of the largest value; among equal ones, the one with the lowest device id."""
    tied = np.flatnonzero(values == values.max())
    return int(tied[0]) if len(tied) == 1 else min(tied.tolist(), key=ids.__getitem__)


def _needs(model: Model, i: int, where: Sequence[int], devices: int) -> np.ndarray:
    """Memory layer i needs on each device: shared parameters count unless their owner is there.
    An owner not yet placed counts (its copy is returned if it lands on the same device)."""
    need = np.full(devices, model.need[i], np.int64)
    if model.owner[i] >= 0:
        need += model.shared_need[i]
        if where[model.owner[i]] >= 0:
            need[where[model.owner[i]]] -= model.shared_need[i]
    return need
