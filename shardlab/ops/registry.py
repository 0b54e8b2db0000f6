"""Which ``torch.nn.functional`` names have a sharded implementation.

Each op family (``conv.py``, ``pad.py`` …) registers its handlers with
``@register("conv2d")``; :mod:`shardlab.patch` routes a call to the handler
when an argument is a ShardTensor. A handler has the signature of the torch
function it replaces.
"""

from __future__ import annotations

from collections.abc import Callable

HANDLERS: dict[str, Callable] = {}


def register(*names: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        for name in names:
            HANDLERS[name] = fn
        return fn

    return deco


def supported() -> list[str]:
    return sorted(HANDLERS)
