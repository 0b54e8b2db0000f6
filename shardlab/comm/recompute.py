"""Activation checkpointing meets messages: every rank recomputes at the same point.

``torch.utils.checkpoint`` (non-reentrant) drops a block's saved tensors in forward and
re-runs the block when backward first *unpacks* one of them, stopping as soon as the
last of them is back (early stop). Both are rank-local facts: which autograd node
unpacks first, which op saved last. A rank whose shard is smaller than a halo builds a
slightly different graph than its neighbours (no overlapped convolution, an empty
output), so a block that sends messages re-sends them at another point of its backward
than its peers, and a message lands in the buffer of another one::

    rank 0  backward: conv2 halo back | recompute: conv1 halo, conv2 halo | conv1 ...
    rank 1  backward: recompute: conv1 halo, conv2 halo | conv2 halo back | conv1 ...
                                 ^ rank 0's gradient rows arrive as rank 1's halo rows
                                   (gloo: "Received data size doesn't match", every rank)

The order of shardlab's autograd Functions that send messages is the same on every rank
(every decision is taken from global layouts). :func:`fenced` ties the recomputation to
them:

1. forward, after the Function's messages: it saves one more (empty) tensor, so a
   recomputation never stops early before a Function that sends (it runs every message
   of the block on every rank);
2. backward, before its first message: it unpacks what it saved, so a pending
   recomputation of its block runs *now*, before the messages of its backward, on every
   rank alike.

Only where saved tensors are hooked (``saved_tensors_hooks``: a checkpointed block, its
recomputation, offloading) is the token saved: elsewhere a Function that keeps nothing can be
backpropagated twice, as torch's own ops that save nothing (an input distributed once, used in
two steps).
"""

from __future__ import annotations

import functools

import torch

_HOOKED = torch._C._autograd._top_saved_tensors_default_hooks  # (ignore_is_tracing) -> hooks

__all__ = ["fenced", "kept"]


def fenced(cls):
    """Class decorator for a ``torch.autograd.Function`` that sends messages in its forward
    or backward (steps 1 and 2 above). Its backward reads what its forward saved with
    :func:`kept` (``ctx.saved_tensors`` may be unpacked only once under a checkpoint)."""
    forward, backward = cls.forward, cls.backward

    @functools.wraps(forward)
    def forward_then_token(ctx, *args, **kwargs):
        out = forward(ctx, *args, **kwargs)
        to_save = getattr(ctx, "to_save", None) or ()
        ctx.shardlab_token = _HOOKED(True) is not None  # saved tensors are hooked (checkpoint)
        ctx.shardlab_saved = bool(to_save)
        if ctx.shardlab_token:
            ctx.save_for_backward(*to_save, torch.empty(0))  # 1.
        elif to_save:
            ctx.save_for_backward(*to_save)
        return out

    @functools.wraps(backward)
    def unpack_then_backward(ctx, *grads):
        if ctx.shardlab_token:
            ctx.shardlab_kept = ctx.saved_tensors[:-1]  # 2. a pending recomputation runs here
        else:  # (read once freed, even an empty one raises: read only what was saved)
            ctx.shardlab_kept = ctx.saved_tensors if ctx.shardlab_saved else ()
        return backward(ctx, *grads)

    cls.forward = staticmethod(forward_then_token)
    cls.backward = staticmethod(unpack_then_backward)
    return cls


def kept(ctx) -> tuple:
    """What the forward of a :func:`fenced` Function saved (without the fence's token)."""
    return ctx.shardlab_kept
