"""The ``torch.nn.functional`` families: their entries in the one registry.

Each op family (``conv.py``, ``pad.py`` …) registers its handler with
``@register("conv2d")``: the handler has the signature of the torch function it replaces,
and goes into :data:`shardlab.engine.registry.RULES` under torch's own function
(``F.conv2d``), wrapped in an :class:`FRule`, which prepares the arguments and follows
torch's autocast policy (:mod:`shardlab.ops.autocast`). :mod:`shardlab.patch` routes a
call of the patched ``F.<name>`` with a ShardTensor argument to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardlab.comm import traced
from shardlab.engine.registry import RULES
from shardlab.engine.registry import register as _register
from shardlab.engine.whole import NAMES as WHOLE_NAMES
from shardlab.engine.whole import whole_call


class FRule:
    """The registry's entry for ``F.<name>``: called as every rule is, ``(func, args,
    kwargs)``, it runs :func:`dispatch`. ``handler``: the family's function, with F's
    signature; ``row_wise``: it treats every row alone (cross-entropy), so strided layouts
    (a flattened (B*S) dim) need not move first; ``raw``: it takes the arguments as they
    come, plain DTensors and Partial or strided layouts too (it passes what it does not
    take to torch's own function)."""

    __slots__ = ("name", "handler", "row_wise", "raw")

    def __init__(self, name, handler, row_wise=False, raw=False):
        self.name, self.handler, self.row_wise, self.raw = name, handler, row_wise, raw

    def __call__(self, func, args, kwargs):
        """At ``__torch_function__`` (the unpatched door: ``torch.conv2d``, an F function
        bound before ``patched()``). A layout the family does not take goes on to torch's
        call on the ShardTensors (aten's rules, or a gather that says so), as it went
        before the family took this door; the patched door raises instead."""
        try:
            return call(self.name, args, kwargs)
        except NotImplementedError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"FRule(F.{self.name} -> {self.handler.__module__}.{self.handler.__qualname__})"


def register(
    *names: str, row_wise: bool = False, raw: bool = False, at_function: bool = False
) -> Callable:
    """``@register("conv2d")``: the decorated function handles ``F.conv2d`` (see
    :class:`FRule` for ``row_wise`` and ``raw``); ``at_function``: also when the call
    reaches the class's ``__torch_function__`` (not patched)."""

    def deco(fn: Callable) -> Callable:
        for name in names:
            _register(original(name), at_function=at_function)(FRule(name, fn, row_wise, raw))
        return fn

    return deco


def rule(name: str) -> FRule | None:
    """The registry's entry for ``F.<name>``, or None."""
    fn = original(name)
    hit = RULES.get(fn)
    return hit if type(hit) is FRule else None


def supported() -> list[str]:
    """The ``torch.nn.functional`` names with a sharded implementation."""
    return sorted(r.name for r in RULES.values() if type(r) is FRule)


def dispatch(name: str, args, kwargs):
    """``F.<name>(*args, **kwargs)`` with ShardTensor (or plain DTensor) arguments:
    the arguments prepared (:func:`shardlab.ops.interop.prepare`: DTensors adopted,
    Partial values reduced, strided dims made consecutive), then the handler. What
    :mod:`shardlab.patch` calls is :func:`call` (eager under ``torch.compile``), or this
    traced through inside ``shardlab.messages_in_graphs()``."""
    from shardlab.ops.autocast import autocast_call
    from shardlab.ops.interop import prepare

    entry = rule(name)
    if entry is None:
        raise NotImplementedError(
            f"torch.nn.functional.{name} has no sharded implementation yet; shardlab "
            f"handles {supported()} on ShardTensors. Redistribute the arguments to "
            "Replicate() and call it on .full_tensor(), or disable the patches."
        )
    if not entry.raw:
        args, kwargs = prepare(args, kwargs, name, keep_strided=entry.row_wise)
    if name in WHOLE_NAMES:  # every rank holds the whole tensor: torch's own op
        out = whole_call(name, original(name), args, kwargs)
        if out is not NotImplemented:
            return out
    handler = entry.handler
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
