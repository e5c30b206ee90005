"""MeshClient.run of a DATA_PATH_DIRECT job (docs/data-plane.md): one RunJob call carries the spec,
the dispatcher's answers say where each shard's rows go, this process puts them there itself
(accelmesh/object_client.py) and says so on the same call, a group of shards at a time, and it
fetches each shard's outputs from where they lie as soon as the dispatcher says the shard finished,
into one array per output in row order, freeing them at the job's end. No tensor byte passes the
dispatcher.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from accelmesh import object_client
from accelmesh.dispatch.v1 import dispatch_service_pb2 as pb
from accelmesh.dispatch.v1 import job_pb2 as job_pb
from accelmesh.object_client import ObjectClient, PutWindow
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
        call = stub.RunJob(requests(), timeout=timeout)
        window = PutWindow(object_client.PUT_AHEAD_BYTES)
        puts = _Puts(self.objects, arrays, call,
                     lambda indexes: outbox.put(pb.RunJobRequest(stored=pb.InputsStored(shard_indexes=indexes))),
                     window)
        fetches = self.objects.fetches(rows)

        def on_part(part: str, response) -> None:
            if part == "put_inputs":
                puts.add(_ticketed(response.put_inputs))
            elif part == "outputs":  # fetched at once, while the job's other shards run
                told = _ticketed(response.outputs)
                window.finished(s.shard_index for s in told)
                fetches.add(told)

        try:
            try:
                events, folded, job = follow(call, on_event=on_event, on_interrupt=on_interrupt, on_part=on_part)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    puts.raise_failure()  # cancelled because a put failed: that is the error
                raise
            puts.raise_failure()
            outputs = folded.results()
            if fetches.placed:
                fetched = fetches.results()
                outputs.update({name: fetched[name] for name in fetches.placed[0].names if name in fetched})
        finally:
            outbox.put(_END)
            window.close()
            puts.close()
            fetches.close()
        moved = {way: self.objects.moved_bytes[way] - before[way] for way in before}
        return JobResult(job, outputs, events, "direct", {way: n for way, n in moved.items() if n})


class _Puts:
    """The job's puts, on a thread of their own, so the response stream is read (and outputs
    fetched) while they go. A put that fails cancels the call; `raise_failure` raises its error."""

    def __init__(self, objects: ObjectClient, arrays: list[np.ndarray], call, stored: Callable[[list[int]], None],
                 window: PutWindow):
        self._objects, self._arrays, self._call, self._stored, self._window = objects, arrays, call, stored, window
        self._asked: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="direct-puts", daemon=True)
        self._thread.start()

    def add(self, shards: list) -> None:
        self._asked.put(shards)

    def _run(self) -> None:
        while (shards := self._asked.get()) is not _END:
            if self._failure is not None:
                continue
            try:
                self._objects.put(shards, self._arrays, self._stored, self._window)
            except Exception as exc:  # noqa: BLE001 - raised on the caller's thread (raise_failure)
                self._failure = exc
                self._call.cancel()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        self._asked.put(_END)
        self._thread.join()


def _ticketed(message) -> list:
    """The shards of an InputsWanted or OutputsReady, each with its ticket (a shard's own, else its
    worker's in the message's `tickets`)."""
    shards = list(message.shards)
    for shard in shards:
        if not shard.ticket:
            shard.ticket = message.tickets.get(shard.worker_address, b"")
    return shards
