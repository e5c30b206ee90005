"""Bucketed shard sizes: every shard of a job is one of a few row counts, so one program and input
size builds the same few executables however the devices' measured rates move.

Each distinct shard row count is its own XLA executable per target type (a compile of seconds and
a cache entry), and rates drift with every measured shard: sized freely, 102 jobs of one size
asked for 243 executables of 82 batch sizes. So a job's row counts come from a ladder fixed by
the job's shape alone, never by the rates:

- the largest shard L is the job's rows, or ``max_shard_rows`` when that is smaller;
- the unit q is L // 2**(rungs - 1) (at least 1), and the rungs are q, 2q, 4q, ... up to L;
- the tail is total_rows % q, the one piece off the ladder (none when q divides the rows).

The planner splits whole units by rate (see ``sharding.plan_shards``), gives the tail to the
device that finishes earliest with it, and cuts each device's units into the fewest rungs: as many
top rungs as fit, then the binary digits of the rest (at most rungs - 1 pieces more). So a job
uses at most ``rungs`` + 1 row counts, the same for every target type, whatever the rates.

Splitting, not padding, keeps results exact for every combine rule: a shard is real rows only,
so a sum or a row-weighted mean folds nothing that was not in the batch, and a worker's outputs
have exactly the shard's rows (dispatch_svc.jobs.validation stays strict). The price is balance
granularity and shard count: a device's share is a multiple of q, so the makespan is at most the
LP optimum N / R plus one unit on the slowest device plus the tail on the fastest (measured on
200-row jobs under drifting rates: 2% longer in the median, 5% at worst, twice the shards);
a job many shards long loses almost nothing, its pieces being top rungs but for a few.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelmesh.errors import InvalidArgument

# Rungs of the ladder: 5 gives the sizes q, 2q, 4q, 8q, 16q (q = the largest shard / 16) and the
# tail, 6 executables per target type at most, within dispatch_svc's MAX_EXECUTABLE_SIZES (8) and
# the compile service's 16 per call; a share is then rounded to a sixteenth of the largest shard.
BUCKET_RUNGS = 5


@dataclass(frozen=True)
class BucketLadder:
    """The row counts one job's shards may have."""

    unit: int  # q: shares are whole multiples of it (the tail aside)
    rungs: tuple[int, ...]  # q * 2**k, ascending, the last at most the largest shard
    tail: int  # total_rows % unit: the one shard off the ladder; 0 when there is none

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every row count a shard of the job may have, ascending."""
        return tuple(sorted({*self.rungs, *((self.tail,) if self.tail else ())}))

    def pieces(self, rows: int) -> list[int]:
        """``rows`` (a whole number of units) as rungs, largest first: top rungs, then binary."""
        if rows % self.unit:
            raise InvalidArgument(f"{rows} rows is not a whole number of {self.unit}-row units")
        top = self.rungs[-1]
        out = [top] * (rows // top)
        rest = rows % top
        for rung in reversed(self.rungs[:-1]):
            if rest >= rung:
                out.append(rung)
                rest -= rung
        return out


def bucket_ladder(total_rows: int, max_shard_rows: int | None = None, rungs: int = BUCKET_RUNGS) -> BucketLadder:
    """The ladder of a job of ``total_rows`` whose shards hold at most ``max_shard_rows`` rows."""
    if isinstance(rungs, bool) or not isinstance(rungs, int) or rungs < 1:
        raise InvalidArgument(f"bucket rungs must be a whole number >= 1, got {rungs!r}")
    largest = total_rows if max_shard_rows is None else min(total_rows, max_shard_rows)
    unit = max(1, largest >> (rungs - 1))
    ladder = tuple(unit << k for k in range(rungs) if unit << k <= largest)
    return BucketLadder(unit, ladder, total_rows % unit)
