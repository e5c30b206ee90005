"""execution/direct.DirectJob's naming of finished shards' outputs to the client: the first batch
once the finished shards cover FIRST_TELL_BYTES of input rows, then twice what was told last, up
to TELL_BYTES; whatever is left once every shard finished (before the job's end is recorded),
or when asked for all; in row order; each shard once."""

from __future__ import annotations

from types import SimpleNamespace

from dispatch_svc.execution import direct


def test_finished_shards_are_told_first_soon_then_in_batches_that_double(monkeypatch):
    monkeypatch.setattr(direct, "FIRST_TELL_BYTES", 2)
    monkeypatch.setattr(direct, "TELL_BYTES", 8)
    job = SimpleNamespace(owner="tenant", job_id="job", spec=SimpleNamespace(inputs=[SimpleNamespace(name="x")],
                                                                             row_bytes=1))
    freed = []
    shards = direct.DirectJob(job, sign=lambda *args: b"ticket", emit=lambda message: None,
                              free=lambda address, ticket, ids: freed.extend(ids))
    shards.ask([(index, index, 1, "worker:1") for index in range(20)])
    told = []
    for index in reversed(range(20)):  # finished last row first: told in row order all the same
        shards.finished(index, "worker:1", [f"out/{index}.1/0"], ["y"])
        batch = shards.take_finished()
        if batch:
            told.append([s.shard_index for s in batch])
    assert shards.take_finished(every=True) == []  # the last shard's finish told the rest
    assert [len(batch) for batch in told] == [2, 4, 8, 6]
    assert all(batch == sorted(batch) for batch in told) and sorted(sum(told, [])) == list(range(20))
    assert sorted(freed) == sorted(f"in/{index}/0" for index in range(20))  # each told shard's inputs, once
