"""Job strategies: how a started job becomes work on the mesh, one module per strategy.

Every strategy has `start(ctx: JobContext) -> work`: it runs in the caller's thread (planning,
building, reserving, taking the inputs, so that an input error reaches the caller) and returns a
callable that the job's lifecycle (dispatch_svc.execution.runner) runs in the background to collect the
results. What strategies share (parameters, reservations, the device pool, one shard attempt,
the in-flight budget) is in `context.py`.

- `data_parallel`: plans shards by throughput and builds per target type, then hands the job to
  `inference` (every shard once, outputs streamed as they finish) or `training` (mini-batch
  steps, gradients averaged by rows, the optimizer applied here).
- `pipeline`: a model's layers placed on devices (MISSION B), micro-batches stage to stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from dispatch_svc.jobs import records as m
from dispatch_svc.execution.strategies import data_parallel, pipeline
from dispatch_svc.execution.strategies.context import JobContext

Work = Callable[[], None]


def strategy_for(spec: m.JobSpec, max_shards: int | None = None) -> Callable[[JobContext], Work]:
    """`max_shards`: a pipeline's micro-batches x stages at most (ACCELMESH_MAX_JOB_SHARDS), known
    only once it is placed; a data-parallel job's shards were checked before it was planned."""
    if spec.placement is not None:
        return functools.partial(pipeline.start, max_shards=max_shards)
    return data_parallel.start
