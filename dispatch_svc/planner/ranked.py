"""The placement of MISSION B4-B6: layers sorted by parameter count, largest first; each goes
to the device with the best task-weighted status (accelmesh.scoring.combine, the inventory's own
formula) among those whose free memory holds it; what the layer needs is reserved and the
statuses are updated before the next layer (B5): free memory drops by what the layer needs, and
free compute by its predicted time on the device over the model's ideal step time (the lower
bound on the N best devices), so a fast device takes more layers than a slow one before it
scores worse. The model's device count N (B6: the client's,
else the fewest best devices whose memory holds it) decides the pool: the N largest layers each
open a new device, the remaining layers go only to chosen ones. Every step is explained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dispatch_svc.planner.layer_model import (
    Model, by_score, capacity, evaluate, initial_scores, lower_bound_seconds, rates, required_devices,
    status_scores, summary,
)
from dispatch_svc.planner.placement_types import RANKED, Device, NoRoom, Placement


def place_ranked(model: Model, devices: Sequence[Device]) -> Placement:
    """MISSION B4-B6; when the device count was derived and the chosen devices cannot take a
    layer, one more device is allowed and the placement starts over (explained)."""
    scores = initial_scores(devices, model.task.weights)
    count = required_devices(model, devices, scores)
    while True:
        try:
            return _ranked(model, devices, scores, count)
        except NoRoom as exc:
            if model.task.device_count or count >= len(devices) or not exc.wider:
                raise
            count += 1


def _ranked(model: Model, devices: Sequence[Device], scores: dict[str, float], count: int) -> Placement:
    """MISSION B4-B6 as one loop: largest layer first, the best-scoring device with room, its status
    updated before the next layer. Kept in one function so that the status arrays it updates (B5)
    are visibly the ones the next choice reads."""
    task = model.task
    weights = task.weights
    caps = {d.id: capacity(d, task) for d in devices}
    pool_devices = sorted(devices, key=lambda d: d.id)  # ties go to the lowest id
    ids = [d.id for d in pool_devices]
    # The status of every device as arrays (B1): what is free is updated after each layer (B5).
    rate, bandwidth = rates(pool_devices)
    free = np.array([caps[i] for i in ids], np.int64)
    # The compute a layer reserves on a device (B5) is its predicted time there over the model's
    # ideal step on the N best devices: a device is full once it holds its fair share of work.
    fair = lower_bound_seconds(model, by_score(devices, scores)[:count])
    load = np.zeros(len(ids))  # fraction of the fair step the device's layers take
    chosen = np.zeros(len(ids), bool)
    where: list[int] = [-1] * len(model)  # device index of each layer
    explain = [
        f"ranked: {len(model)} layers by parameter count, largest first, over {len(devices)} devices; "
        f"weights compute {weights.compute:.2f}, memory {weights.memory:.2f}, bandwidth {weights.bandwidth:.2f}; "
        f"the model needs {model.total_need():,} bytes, so {count} device(s)"
        + (" (the client's count)" if task.device_count else f" (usable memory after {task.headroom:.0%} headroom)")]
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
            largest = int(np.argmax(np.where(pool, free, -1)))
            short = int(need[largest] - free[largest])
            raise NoRoom(
                f"layer {layer.name!r} ({layer.parameter_count:,} parameters) needs {int(need[largest]):,} bytes but "
                f"{'any device' if opening else f'any of the {count} chosen devices'} has at most "
                f"{int(free[largest]):,} bytes free ({ids[largest]}): short by {short:,} bytes",
                shortfall_bytes=short, wider=not opening)
        scored = status_scores(rate, bandwidth, free.astype(float), load, weights)
        ranking = np.where(fits, scored, -np.inf)
        best = int(np.argmax(ranking))
        ranking[best] = -np.inf
        second = int(np.argmax(ranking)) if np.isfinite(ranking).any() else -1
        where[i] = best
        free[best] -= need[best]
        seconds = model.compute_seconds(i, pool_devices[best])
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
    evaluation = evaluate(model, devices, placed)
    explain.append(summary(RANKED, evaluation))
    return Placement(RANKED, placed, evaluation, caps, scores, explain)


def _needs(model: Model, i: int, where: Sequence[int], devices: int) -> np.ndarray:
    """Memory layer i needs on each device: shared parameters count unless their owner is there.
    An owner not yet placed counts (its copy is returned if it lands on the same device)."""
    need = np.full(devices, model.need[i], np.int64)
    if model.owner[i] >= 0:
        need += model.shared_need[i]
        if where[model.owner[i]] >= 0:
            need[where[model.owner[i]]] -= model.shared_need[i]
    return need
