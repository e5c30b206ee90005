"""The balanced placement's tables (balanced.py): every contiguous stage's time on each class of
identical devices, and how far from each layer a class's memory reaches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dispatch_svc.planner.layer_model import BANDWIDTH_EFFICIENCY, Model, link_gbps
from dispatch_svc.planner.placement_types import Device
from dispatch_svc.planner.throughput import CATALOG_EFFICIENCY

SPAN_CELLS = 1 << 22  # (class, first layer, last layer) cells held as one array; past it, one per first layer


class Spans:
    """The time of every stage (layers i..j-1 on a device of class k, its stage call's overhead
    included, over r of its devices)
    that the class's memory holds: the candidate step times, and for a limit the longest stage
    from each i within it. One (k, i, j) array when it is small enough, else one (k, j) array per
    first layer i. Trained, a stage's device also returns its parameter bytes' gradients every
    micro-batch (`per_call[k]` a byte) and receives them as new parameters every step
    (`per_step[k]` a byte, per micro-batch): over r devices a stage takes (its time + the
    gradients' return) / r + the parameters' load (Model.gradient_seconds, Model.load_seconds).

    A stage holding a layer its class cannot run (`stalled`: stage_tables) does not fit, however
    much memory the class has: it would never finish, so it is no candidate step time either.
    Its reach stops where the next such layer begins, and the prefix sums leave such layers out,
    so every time computed is finite: no inf - inf (NaN) reaches a comparison."""

    def __init__(self, cum: np.ndarray, send: np.ndarray, reach_mem: np.ndarray, gradients: np.ndarray,
                 per_call: np.ndarray, per_step: np.ndarray, overhead: np.ndarray,
                 stalled: np.ndarray | None = None):
        k_count, n = reach_mem.shape
        if stalled is not None:  # stage i..j-1 fits only if none of its layers stalls the class
            reach_mem = np.minimum(reach_mem, _runnable_reach(stalled))
        self._n, self._whole = n, k_count * n * n <= SPAN_CELLS
        self._per_call, self._per_step = per_call[:, None], per_step[:, None]
        self._trained = bool(per_call.any() or per_step.any())
        last = np.arange(1, n + 1)
        if self._whole:  # times[k, i, j - 1]: stage i..j-1, the same arithmetic as the rows below
            self._times = cum[:, None, 1:] - cum[:, :n, None] + send[:, None, 1:] + overhead[:, None, None]
            self._grads = (gradients[None, 1:] - gradients[:n, None])[None]
            self._fits = ((last[None, None, :] > np.arange(n)[None, :, None])
                          & (last[None, None, :] <= reach_mem[:, :, None]))
        else:
            self._rows = [(cum[:, i + 1:] - cum[:, i:i + 1] + send[:, i + 1:] + overhead[:, None],
                           gradients[None, i + 1:] - gradients[i],
                           last[None, i:] <= reach_mem[:, i:i + 1])
                          for i in range(n)]

    def _over(self, times: np.ndarray, grads: np.ndarray, r: int) -> np.ndarray:
        if not self._trained:
            return times if r == 1 else times / r
        per_call, per_step = ((a[:, :, None] if times.ndim == 3 else a) for a in (self._per_call, self._per_step))
        return (times + per_call * grads) / r + per_step * grads

    def any(self) -> bool:
        return bool(self._fits.any()) if self._whole else any(fits.any() for _, _, fits in self._rows)

    def candidates(self, r: int = 1) -> np.ndarray:
        if self._whole:
            return np.unique(self._over(self._times, self._grads, r)[self._fits])
        return np.unique(np.concatenate([self._over(t, g, r)[fits] for t, g, fits in self._rows]))

    def reach(self, limit: float, r: int = 1) -> np.ndarray:
        """reach[k, i]: the end j of the longest stage from i on r devices of class k within
        ``limit``; -1 if none."""
        if self._whole:
            ok = self._fits & (self._over(self._times, self._grads, r) <= limit)
            last = self._n - 1 - np.argmax(ok[:, :, ::-1], axis=2)
            return np.where(ok.any(axis=2), last + 1, -1)
        reach = np.full((len(self._rows[0][0]), self._n), -1, dtype=np.int64)
        for i, (times, grads, fits) in enumerate(self._rows):
            ok = fits & (self._over(times, grads, r) <= limit)
            last = ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1)
            reach[:, i] = np.where(ok.any(axis=1), i + 1 + last, -1)
        return reach


def stage_tables(model: Model, examples: Sequence[Device]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per class (rows): prefix sums of Model.compute_seconds over the layers, send[k][j], what a
    stage ending before layer j pays to send layer j-1's output (Model.send_seconds), the same
    arithmetic as those methods, over arrays; and stalled[k][i], whether class k cannot run layer
    i at all (FLOPs on a device with no free compute, whose time compute_seconds makes infinite).

    A stalled layer adds 0 to the prefix sums rather than inf: a device with no free compute (its
    rate reserved by other jobs) would otherwise make every later prefix inf, and a stage after
    it inf - inf = NaN, which no limit is ever above. Spans keeps stages off stalled layers."""
    n = len(model)
    rate = np.array([d.peak_tflops for d in examples], float)[:, None] * 1e12 * CATALOG_EFFICIENCY
    bandwidth = np.array([d.memory_bandwidth_gbps for d in examples], float)[:, None] * 1e9 * BANDWIDTH_EFFICIENCY
    flops, traffic = np.array(model.flops, float)[None, :], np.array(model.traffic, float)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        flops_s = np.where(rate > 0, flops / rate, 0.0)
        bytes_s = np.where(bandwidth > 0, traffic / bandwidth, 0.0)
    stalled = (rate <= 0) & (flops > 0)
    cum = np.zeros((len(examples), n + 1))
    cum[:, 1:] = np.cumsum(np.where(stalled, 0.0, np.maximum(flops_s, bytes_s)), axis=1)
    send = np.zeros((len(examples), n + 1))
    link = np.array([link_gbps(d) for d in examples], float)[:, None]
    send[:, 1:n] = np.array(model.act[:-1], float)[None, :] / (link * 1e9 * BANDWIDTH_EFFICIENCY)
    return cum, send, stalled


def _runnable_reach(stalled: np.ndarray) -> np.ndarray:
    """reach[k][i]: the largest j such that class k can run every layer of i..j-1 (i itself when
    it cannot run layer i): the next stalled layer at or after i, per class."""
    k_count, n = stalled.shape
    reach = np.full((k_count, n + 1), n, np.int64)
    for i in range(n - 1, -1, -1):
        reach[:, i] = np.where(stalled[:, i], i, reach[:, i + 1])
    return reach[:, :n]


def memory_reach(model: Model, capacity_bytes: np.ndarray) -> np.ndarray:
    """reach[k][i]: the largest j such that layers i..j-1 fit a device of usable memory
    capacity_bytes[k] as one stage (Model.stage_needs)."""
    n = len(model)
    reach = np.zeros((len(capacity_bytes), n), np.int64)
    for i in range(n):
        reach[:, i] = i + np.searchsorted(model.stage_needs(i), capacity_bytes, side="right")
    return reach
