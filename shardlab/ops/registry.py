"""Which ``torch.nn.functional`` names have a sharded implementation.

Each op family (``conv.py``, ``pad.py`` …) registers its handlers with
``@register("conv2d")``; :mod:`shardlab.patch` routes a call to the handler
when an argument is a ShardTensor. A handler has the signature of the torch
function it replaces. A call follows torch's autocast policy
(:mod:`shardlab.ops.autocast`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardlab.comm import traced
from shardlab.ops._whole import NAMES as WHOLE_NAMES
from shardlab.ops._whole import whole_call

HANDLERS: dict[str, Callable] = {}
ROW_WISE: set[str] = set()  # handlers that take strided dims as they are
RAW: set[str] = set()  # handlers that take the arguments as they come (no prepare)


def register(*names: str, row_wise: bool = False, raw: bool = False) -> Callable:
    """``@register("conv2d")``; ``row_wise=True``: the handler treats every row alone
    (cross-entropy), so strided layouts (a flattened (B*S) dim) need not move first;
    ``raw=True``: the handler gets the arguments as they come, plain DTensors and Partial
    or strided layouts too (it passes what it does not take to torch's own function)."""

    def deco(fn: Callable) -> Callable:
        for name in names:
            HANDLERS[name] = fn
            if row_wise:
                ROW_WISE.add(name)
            if raw:
                RAW.add(name)
        return fn

    return deco


def supported() -> list[str]:
    return sorted(HANDLERS)


def dispatch(name: str, args, kwargs):
    """``F.<name>(*args, **kwargs)`` with ShardTensor (or plain DTensor) arguments:
    the arguments prepared (:func:`shardlab.ops.interop.prepare`: DTensors adopted,
    Partial values reduced, strided dims made consecutive), then the handler. What
    :mod:`shardlab.patch` calls is :func:`call` (eager under ``torch.compile``), or this
    traced through inside ``shardlab.messages_in_graphs()``."""
    from shardlab.ops.autocast import autocast_call
    from shardlab.ops.interop import prepare

    handler = HANDLERS.get(name)
    if handler is None:
        raise NotImplementedError(
            f"torch.nn.functional.{name} has no sharded implementation yet; shardlab "
            f"handles {supported()} on ShardTensors. Redistribute the arguments to "
            "Replicate() and call it on .full_tensor(), or disable the patches."
        )
    if name not in RAW:
        args, kwargs = prepare(args, kwargs, name, keep_strided=name in ROW_WISE)
    if name in WHOLE_NAMES:  # every rank holds the whole tensor: torch's own op
        out = whole_call(name, original(name), args, kwargs)
        if out is not NotImplemented:
            return out
    return autocast_call(name, original(name), handler, args, kwargs, device_type(args, kwargs))


call = traced.eager(dispatch)  # runs eagerly when reached from compiled code


def original(name: str) -> Callable:
    """torch's own ``torch.nn.functional.<name>`` (also while it is patched)."""
    return ORIGINALS.get(name) or getattr(torch.nn.functional, name)


ORIGINALS: dict[str, object] = {}  # name -> torch's function, while patched (shardlab.patch)


def device_type(args, kwargs) -> str:
    """The device type of the mesh of the first distributed argument ("cpu", "cuda" …)."""
    from torch.distributed.tensor import DTensor

    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            return a.device_mesh.device_type
    return "cpu"
