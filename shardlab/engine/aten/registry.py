"""aten-level rules for ShardTensors: ``@register(aten.op.overload, ...)``.

A rule takes ``(func, args, kwargs)`` with every DTensor argument already a ShardTensor,
returns ShardTensors, or ``NotImplemented`` to let the next stage try (torch's
decomposition, then the replicate fallback; see :mod:`shardlab.engine.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable

HANDLERS: dict = {}


def register(*ops) -> Callable:
    """``@register(aten.mean.dim)`` handles that overload; a packet handles all of its."""

    def deco(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return deco
