"""The balanced placement's search (balanced.py) over vectors of devices used per class: the
dense form, arrays over every vector, for when there are few enough of them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

MAX_DENSE_STATES = 1 << 22  # vectors of devices used per class dense_cover keeps arrays over


def dense_size(avail: Sequence[int], count: int) -> int:
    return math.prod(min(a, count) + 1 for a in avail)


def dense_cover(reaches: Sequence[np.ndarray], replicas: Sequence[int], avail: Sequence[int], count: int,
                 n: int) -> list[tuple[int, int, int]] | None:
    """cover()'s search over arrays: every vector of devices used per class is a number (class 0
    the most significant digit, so the smallest number is the first vector in order), its
    longest prefix reached and how it was reached kept in arrays; a level's vectors extend by
    every (class, replicas) at once. The same recurrence and the same fewest-devices answer as
    the dictionaries' search, for vectors too many to visit one by one in Python."""
    k_count = len(avail)
    radix = [min(a, count) + 1 for a in avail]
    strides = [math.prod(radix[k + 1:]) for k in range(k_count)]
    size = math.prod(radix)
    best = np.full(size, -1, np.int64)
    best[0] = 0
    parent = np.zeros(size, np.int64)
    how = np.zeros((size, 3), np.int64)  # class, first layer, devices of the stage that reached it
    levels: list[list[np.ndarray]] = [[] for _ in range(count + 1)]
    levels[0].append(np.zeros(1, np.int64))
    for used in range(count):
        if levels[used]:
            codes = np.unique(np.concatenate(levels[used]))
            prefixes = best[codes]
            keep = prefixes < n
            codes, prefixes = codes[keep], prefixes[keep]
            for k in range(k_count):
                digit = (codes // strides[k]) % radix[k]
                for r in range(1, min(replicas[k], count - used) + 1):
                    reached = reaches[r - 1][k, prefixes]
                    ok = (digit + r <= min(avail[k], count)) & (reached > prefixes)
                    new = codes[ok] + r * strides[k]  # distinct: one (class, replicas) from distinct vectors
                    better = reached[ok] > best[new]
                    src, to, start, new = codes[ok][better], reached[ok][better], prefixes[ok][better], new[better]
                    best[new], parent[new] = to, src
                    how[new] = np.stack([np.full(new.size, k), start, np.full(new.size, r)], axis=1)
                    levels[used + r].append(new)
        if levels[used + 1]:
            reached_all = np.unique(np.concatenate(levels[used + 1]))
            done = reached_all[best[reached_all] == n]
            if done.size:
                code, stages = int(done.min()), []
                while code:
                    k, prefix, r = (int(v) for v in how[code])
                    stages.append((k, prefix, r))
                    code = int(parent[code])
                return stages[::-1]
    return None


def cover_path(parents: dict, vec: tuple[int, ...]) -> list[tuple[int, int, int]]:
    stages = []
    while any(vec):
        vec, k, prefix, r = parents[vec]
        stages.append((k, prefix, r))
    return stages[::-1]


def search_states(count: int, classes: int) -> int:
    """Count vectors with at most `count` devices over `classes` classes."""
    return math.comb(count + classes, classes)
