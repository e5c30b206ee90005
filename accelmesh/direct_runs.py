"""MeshClient.run of a DATA_PATH_DIRECT job (docs/data-plane.md): one RunJob call carries the spec,
the dispatcher's answers say where each shard's rows go, this process puts them there itself
(accelmesh/object_client.py) and says so on the same call, and at the job's end it fetches the
outputs from where they lie, in row order, then frees them. No tensor byte passes the dispatcher.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.object_client import ObjectClient
from accelmesh.run_stream import JobResult, follow, parameter_parts
from accelmesh.security.config import Security, security_from_env
from accelmesh.security.identity import Role

_END = object()


class DirectRuns:
    def __init__(self, security: Security | None, *, chunk_bytes: int, max_message_bytes: int, tracer_provider=None):
        self._chunk_bytes = chunk_bytes
        self.objects = ObjectClient(security if security is not None else security_from_env(Role.CLIENT),
                                    chunk_bytes=chunk_bytes, max_message_bytes=max_message_bytes,
                                    tracer_provider=tracer_provider)

    def close(self) -> None:
        self.objects.close()

    def run(self, stub, spec: job_pb.JobSpec, inputs: Mapping[str, np.ndarray],
            parameters: Sequence[tuple[str, np.ndarray]] | None, *,
            on_event: Callable[[job_pb.JobEvent], None] | None = None, timeout: float | None = None,
            on_interrupt: Callable[[], None] | None = None):
        arrays = [np.ascontiguousarray(v) for v in inputs.values()]
        rows = int(spec.inputs[0].shape[0]) if spec.inputs else 0
        outbox: queue.SimpleQueue = queue.SimpleQueue()

        def requests():
            yield pb.RunJobRequest(spec=spec, accept_batches=True)
            for field, message in parameter_parts(parameters, self._chunk_bytes):
                yield pb.RunJobRequest(**{field: message})
            if parameters is not None:
                yield pb.RunJobRequest(stored=pb.InputsStored())  # the parameters end here
            while (message := outbox.get()) is not _END:
                yield message

        before = dict(self.objects.moved_bytes)
        placed: list = []

        def on_part(part: str, response) -> None:
            if part == "put_inputs":
                shards = list(response.put_inputs.shards)
                self.objects.put(shards, arrays)
                outbox.put(pb.RunJobRequest(stored=pb.InputsStored(shard_indexes=[s.shard_index for s in shards])))
            elif part == "outputs":
                placed.extend(response.outputs.shards)

        try:
            events, folded, job = follow(stub.RunJob(requests(), timeout=timeout), on_event=on_event,
                                         on_interrupt=on_interrupt, on_part=on_part)
        finally:
            outbox.put(_END)
        outputs = folded.results()
        if placed:
            try:
                fetched = self.objects.fetch(placed, rows)
                outputs.update({name: fetched[name] for name in placed[0].names if name in fetched})
            finally:
                self.objects.release(placed)
        moved = {way: self.objects.moved_bytes[way] - before[way] for way in before}
        return JobResult(job, outputs, events, "direct", {way: n for way, n in moved.items() if n})
