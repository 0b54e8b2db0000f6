"""The two walks over an op's arguments that shardlab needs, below every layer.

aten arguments are tensors, scalars and (nested) lists/tuples of them, plus kwargs: these
two walk exactly that (torch's pytree handles every container, at a cost).
"""

from __future__ import annotations

__all__ = ["tree_leaves", "tree_map"]


def tree_leaves(tree) -> list:
    out: list = []
    _leaves(tree, out)
    return out


def _leaves(x, out) -> None:
    if isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)


def tree_map(fn, tree):
    if isinstance(tree, list):
        return [tree_map(fn, v) for v in tree]
    if isinstance(tree, tuple):
        items = [tree_map(fn, v) for v in tree]
        return type(tree)(*items) if hasattr(type(tree), "_fields") else tuple(items)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)
