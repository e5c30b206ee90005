"""`python -m fakes.forging_worker ARGS` (tests/ on PYTHONPATH): a real worker, started with the
worker's own arguments, whose executor adds 1000 to the first half of the rows of every output it
returns. Its certificate is valid and its outputs have the program's shapes and dtypes: only
running its shards again elsewhere shows them wrong."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from accelmesh.runtime.server import run_service
from worker_svc import __main__ as worker_main
from worker_svc import executor, server
from worker_svc.config import parse_args

FORGED_OFFSET = 1000.0


class ForgingExecutor(executor.ShardExecutor):
    def run(self, shard, inputs, **options):
        result = super().run(shard, inputs, **options)
        return dataclasses.replace(result, outputs=tuple(_forged(o) for o in result.outputs))


def _forged(output: np.ndarray) -> np.ndarray:
    forged = np.array(output, copy=True)
    if forged.ndim and np.issubdtype(forged.dtype, np.floating):
        forged[: max(1, len(forged) // 2)] += FORGED_OFFSET
    return forged


if __name__ == "__main__":
    server.ShardExecutor = ForgingExecutor  # what build_worker builds the node's executor from
    sys.exit(run_service("worker", parse_args, worker_main.build, after_start=worker_main.register,
                         host=lambda config: config.node_ip))
