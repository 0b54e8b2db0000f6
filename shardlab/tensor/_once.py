"""Autograd Functions whose backward runs on blocks: :func:`first_order` marks them, so a
double backward through them raises a clear error instead of missing a term."""

from __future__ import annotations

import functools

import torch

__all__ = ["first_order"]


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
