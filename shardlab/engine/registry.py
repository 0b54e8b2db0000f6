"""The one registry: what shardlab runs for a torch callable that meets a ShardTensor.

Keyed by the callable itself, whatever door it comes through::

    RULES[aten.mm.default]     the rule of one aten overload   (__torch_dispatch__)
    RULES[aten.sum]            ... of every overload of a packet
    RULES[F.conv2d]            an F-level family: halos, rings  (the patched F, and
                               __torch_function__ for those marked at_function; F.conv2d
                               *is* torch.conv2d, one key for both names)
    RULES[F.mse_loss]          an exact mean                    (__torch_function__)
    RULES[torch.Tensor.unfold] a window with halos              (__torch_function__)

Every value is called as ``rule(func, args, kwargs)``: an aten rule returns a
:class:`~shardlab.engine.rule.Plan` (or its result, or ``NotImplemented``); an F-level
entry (:class:`shardlab.ops.registry.FRule`) prepares the arguments and runs its family's
handler. The op families register themselves here when imported (``@register(...)``),
from this layer (``engine/aten``) and from the one above (``ops/``); the class's
``__torch_function__`` reads the entries marked ``at_function`` through the table it
defines (:func:`shardlab.tensor.entry.install`), filled from here.
"""

from __future__ import annotations

from collections.abc import Callable

from shardlab.tensor import entry

__all__ = ["RULES", "register", "rule_for"]

RULES: dict = {}


def register(*callables, at_function: bool = False) -> Callable:
    """``@register(aten.mean.dim)``: the decorated function is the rule of these callables
    (an aten packet: of all its overloads). ``at_function``: taken over at the class's
    ``__torch_function__`` too (a call that reaches the class with a ShardTensor)."""

    def deco(fn):
        for c in callables:
            RULES[c] = fn
        if at_function:
            entry.install(calls=dict.fromkeys(callables, fn))
        return fn

    return deco


def rule_for(func):
    """The rule of aten overload ``func`` (its own, else its packet's), or None."""
    return RULES.get(func) or RULES.get(func.overloadpacket)
