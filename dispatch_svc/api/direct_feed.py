"""A DATA_PATH_DIRECT RunJob request stream after its spec: the client's parameters (if it sends
any), then `stored` messages saying which shards' inputs it has put into the workers' stores
(docs/data-plane.md). No row reaches the dispatcher: `blocks` yields none.

One thread follows the stream for the job's whole life (`follow`): the parameters first, which
end at the first `stored` message (the Python client sends one naming no shard right after its
parameters, so they are read before the job asks where its inputs go), then each `stored` message
handed to the job's DirectJob as it comes. A message of another kind refuses the job
(INVALID_ARGUMENT), as a misplaced block does on the relay path."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator

import numpy as np

from accelmesh import errors
from dispatch_svc.api.stream_feed import StreamFeed


class DirectFeed(StreamFeed):
    after_parameters = "stored"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ready = threading.Event()  # the parameters are read (or the stream ended trying)
        self._taken: list[tuple[str, np.ndarray]] | None = None
        self._error: errors.AccelmeshError | None = None

    @property
    def short(self) -> bool:
        return False  # no input comes this way: none can be cut short

    def gone(self) -> str:
        return "the client disconnected"

    def read_ahead(self) -> None:
        """Nothing is read before the job starts: the follower thread reads it all (`follow`)."""

    def follow(self, stored: Callable[[list[int]], None], refuse: Callable[[errors.AccelmeshError], None]) -> None:
        threading.Thread(target=contextvars.copy_context().run, args=(self._follow, stored, refuse),
                         name="direct-feed", daemon=True).start()

    def _follow(self, stored, refuse) -> None:
        try:
            if self._spec.client_parameters:
                self._taken = self._read_parameters()
            self._ready.set()
            held, self._held = self._held, None
            for message in self._rest(held):
                part = message.WhichOneof("part")
                if part != "stored":
                    raise errors.InvalidArgument(
                        f"unexpected {part or 'empty message'} on a DATA_PATH_DIRECT RunJob stream: after the spec "
                        "(and parameters), send only `stored` messages; the rows go to the workers' stores",
                        field=part or "part")
                stored(list(message.stored.shard_indexes))
        except errors.Cancelled as exc:  # the client went: the call's end stops the job (_client_gone)
            self._error = exc
        except errors.AccelmeshError as exc:
            self._error = exc
            refuse(exc)
        finally:
            self._ready.set()

    def _rest(self, held) -> Iterator:
        if held is not None:
            yield held
        yield from self._messages()

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        self._ready.wait()
        if self._error is not None:
            raise type(self._error)(str(self._error), field=self._error.field)
        taken, self._taken = self._taken or [], None
        return taken

    def blocks(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        return iter(())
