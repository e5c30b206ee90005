"""Parameter pytrees <-> named flat leaves.

A model's parameters are nested dicts whose top-level keys are layers. jax.tree_util flattens
dicts in sorted-key order, which gives every process the same leaf order without a side table;
a leaf's name is its key path joined by '/', e.g. 'block_0/attn/wq'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

SEPARATOR = "/"


def flatten_params(tree: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """Return (leaf names, leaves) in jax's sorted-key flatten order."""
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    names: list[str] = []
    leaves: list[Any] = []
    for path, leaf in paths_and_leaves:
        keys = []
        for entry in path:
            key = getattr(entry, "key", None)
            # Only string dict keys round-trip through a name; lists or tuples would need an index syntax.
            if not isinstance(key, str) or SEPARATOR in key or not key:
                raise ValueError(f"parameter trees must be nested dicts with non-empty str keys without "
                                 f"{SEPARATOR!r}; got path {jax.tree_util.keystr(path)}")
            keys.append(key)
        names.append(SEPARATOR.join(keys))
        leaves.append(leaf)
    return names, leaves


def unflatten_params(names: Sequence[str], leaves: Sequence[Any]) -> dict[str, Any]:
    """Rebuild the nested dict from leaf names; the inverse of flatten_params."""
    if len(names) != len(leaves):
        raise ValueError(f"{len(names)} names for {len(leaves)} leaves")
    tree: dict[str, Any] = {}
    for name, leaf in zip(names, leaves):
        *parents, last = name.split(SEPARATOR)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree
