"""Autograd Functions whose backward runs on blocks: :func:`first_order` marks them, so a
double backward through them raises a clear error instead of missing a term;
:func:`passes_no_gradient`: a Function that moves one tensor passes no gradient on as no
gradient."""

from __future__ import annotations

import functools

import torch

__all__ = ["first_order", "passes_no_gradient"]


def first_order(name: str):
    """Mark an autograd Function's backward as computed on blocks, not differentiable:
    under ``create_graph=True`` its results get a node that raises, naming ``name``, when
    a second backward reaches it (``torch.autograd.function.once_differentiable``'s
    mechanism, also when only the saved inputs require grad)."""
    message = (
        f"shardlab: the backward of {name} on ShardTensors is computed on the blocks and is "
        "not differentiable: a double backward through it (create_graph=True, a gradient "
        "penalty) is not supported"
    ).encode()

    def mark(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():  # the usual backward (no create_graph)
                return backward(ctx, *grads)
            with torch.no_grad():
                out = backward(ctx, *grads)
            outs = out if isinstance(out, tuple) else (out,)
            at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
            if not at:
                return out
            raised = torch._C._functions.DelayedError(message, len(at))(
                *[outs[i].detach().requires_grad_() for i in at]
            )
            raised = raised if isinstance(raised, tuple) else (raised,)
            outs = list(outs)
            for i, r in zip(at, raised):
                outs[i] = r
            return tuple(outs) if isinstance(out, tuple) else outs[0]

        return wrapper

    return mark


def passes_no_gradient(cls):
    """Class decorator for an autograd Function of one output that makes or moves a
    ShardTensor (``from_local``, ``distribute``, ``redistribute``, ...): no gradient
    (``None``) for its output is no gradient for its inputs, as torch's own ops pass it.

    torch's default (``set_materialize_grads(True)``) turned it into zeros. A compiled
    graph returns None for an input that reaches its outputs only through a comparison
    (``x.masked_fill(y > 0, v)``), where eager autograd never reaches these Functions: ``y``
    got a zero gradient instead of torch's None, and an optimizer then steps it (weight
    decay, momentum). Whether a gradient is None follows from the ops, not the data: the
    same on every rank, so no rank skips a message the others send."""
    forward, backward = cls.forward, cls.backward

    @functools.wraps(forward)
    def forward_unmaterialized(ctx, *args, **kwargs):
        ctx.set_materialize_grads(False)
        ctx.shardlab_inputs = len(args) + len(kwargs)
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def backward_or_none(ctx, grad):
        if grad is None:
            return (None,) * ctx.shardlab_inputs
        return backward(ctx, grad)

    cls.forward = staticmethod(forward_unmaterialized)
    cls.backward = staticmethod(backward_or_none)
    return cls
