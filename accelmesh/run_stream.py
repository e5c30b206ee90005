"""What both of MeshClient.run's paths (the relay, accelmesh/client.py, and DATA_PATH_DIRECT,
accelmesh/direct_runs.py) share of a RunJob call: the parameters as request parts, the reading of
the response stream, and the result handed back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.runtime.batches import unbatched
from accelmesh.runtime.tensors import TensorCollector, split


@dataclass
class JobResult:
    job: job_pb.Job
    outputs: dict[str, np.ndarray]
    events: list[job_pb.JobEvent]
    data_path: str = "relay"  # "relay": the bytes went through the dispatcher; "direct": to and from workers
    # DATA_PATH_DIRECT: the job's tensor bytes by the way they went (object_client.SHARED, .STREAMED)
    moved_bytes: dict[str, int] = field(default_factory=dict)


def parameter_parts(parameters: Sequence[tuple[str, np.ndarray]] | None,
                    chunk_bytes: int) -> Iterator[tuple[str, object]]:
    """(field, message) pairs of the client's parameters: each leaf's header, then its chunks."""
    for name, value in parameters or ():
        header, chunks = split(name, value, chunk_bytes)
        yield "parameter", header
        for chunk in chunks:
            yield "parameter_chunk", chunk


def follow(call, *, on_event: Callable[[job_pb.JobEvent], None] | None = None,
           on_interrupt: Callable[[], None] | None = None,
           on_part: Callable[[str, object], None] | None = None
           ) -> tuple[list[job_pb.JobEvent], TensorCollector, job_pb.Job | None]:
    """Read a RunJob response stream to its end: (its events, its result tensors, the job).
    `on_part(part, response)` hears every other part (DATA_PATH_DIRECT's put_inputs and outputs).
    `on_interrupt` runs on KeyboardInterrupt while the call is still open, before the interrupt goes on;
    the call is cancelled on the way out (a no-op once it ended; else it ends here, not at garbage collection)."""
    events, results, job = [], TensorCollector("result"), None
    try:
        for response in unbatched(call):
            part = response.WhichOneof("part")
            if part == "event":
                events.append(response.event)
                if on_event is not None:
                    on_event(response.event)
            elif part == "tensor":
                results.header(response.tensor)
            elif part == "chunk":
                results.chunk(response.chunk)
            elif part == "job":
                job = response.job
            elif on_part is not None:
                on_part(part, response)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        raise
    finally:
        call.cancel()
    return events, results, job
