"""Job strategies: how an admitted job becomes work on the mesh, one module per strategy.

Every strategy has two steps. `propose(ctx, narrowing) -> Proposal` plans the job (builds per
target type, shards or a placement) without reading its inputs, reserving or sending anything,
and says what it `claims`: the devices it would use and the bytes each must hold. The admission
gate (admission/admission.py) checks the owner's quota and reserves those claims, or the job
waits in the queue. `start(ctx, proposal, grant) -> work` then runs in the caller's thread (the
parameters, the device pool, taking the inputs, so that an input error reaches the caller) and
returns a callable that the job's lifecycle (execution/runner.py) runs in the background to
collect the results. What strategies share (parameters, the device pool, one shard attempt, the
in-flight budget) is in `context.py`.

- `data_parallel`: plans shards by throughput and builds per target type, then hands the job to
  `inference` (every shard once, outputs streamed as they finish) or `training` (mini-batch
  steps, gradients averaged by rows, the optimizer applied here).
- `pipeline`: a model's layers placed on devices (requirements B), micro-batches stage to stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dispatch_svc.admission.admission import Grant
from dispatch_svc.admission.scheduling.rounds import Narrowing
from dispatch_svc.execution.strategies import data_parallel
from dispatch_svc.execution.strategies.context import JobContext
from dispatch_svc.execution.strategies.pipeline import Pipeline
from dispatch_svc.jobs import records as m

Work = Callable[[], None]


class Strategy(Protocol):
    def propose(self, ctx: JobContext, narrowing: Narrowing | None) -> Any: ...  # has `claims`
    def start(self, ctx: JobContext, proposal: Any, grant: Grant) -> Work: ...


def strategy_for(spec: m.JobSpec, max_shards: int | None = None) -> Strategy:
    """`max_shards`: a pipeline's micro-batches x stages at most (ACCELMESH_MAX_JOB_SHARDS), known
    only once it is placed; a data-parallel job's shards were checked before it was planned."""
    if spec.placement is not None:
        return Pipeline(max_shards)
    return data_parallel  # its module-level propose and start
