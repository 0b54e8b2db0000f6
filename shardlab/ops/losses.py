"""Losses on ShardTensors: compute them unreduced, then reduce with the exact ``mean``/``sum``.

``F.mse_loss(x, y)`` ends in one aten op that reduces inside (``mse_loss(x, y, 1)``) and has
its own backward op. On sharded inputs DTensor 2.13 averages wrongly: the mean of the local
means for chunk sizes [7, 6], and a backward that divides by the *local* element count even
for equal shards. So, at the ``__torch_function__`` level, before autograd sees the call:

1. call the same ``torch.nn.functional`` loss with ``reduction='none'``: one loss per element
   (or per sample), computed where the data lives, no communication;
2. reduce that ShardTensor with ``.mean()`` / ``.sum()``, which know the true sizes: one
   all-reduce of one number.

The backward is the unreduced loss's backward times a constant (``1 / numel`` of the *global*
tensor for a mean): local, no messages.

``nll_loss`` averages with weights: its mean is ``sum(losses) / sum(weight[target])`` over
the targets not ignored. The denominator is the same loss, summed, of an input of -1s.

``F.cross_entropy`` on a ShardTensor goes to shardlab's sharded cross-entropy
(:mod:`shardlab.ops.cross_entropy`) whether or not :func:`shardlab.patched` is active:
DTensor's rule averages the local means, wrong as soon as ranks ignore different numbers
of targets.

Not here: the ``weight=`` forms of ``mse_loss``/``l1_loss``/``huber_loss``, which torch
itself writes as sums of ordinary ops (exact on ShardTensors already).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from shardlab.engine.registry import register
from shardlab.ops import registry
from shardlab.ops.autocast import autocast_call

__all__ = ["LOSSES", "reduce_loss"]

LOSSES = {
    fn: inspect.signature(fn)
    for fn in (
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.soft_margin_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.kl_div,
        F.poisson_nll_loss,
        F.gaussian_nll_loss,
        F.hinge_embedding_loss,
        F.margin_ranking_loss,
        F.cosine_embedding_loss,
        F.triplet_margin_loss,
        F.multi_margin_loss,
        F.multilabel_soft_margin_loss,
        F.multilabel_margin_loss,
        F.nll_loss,
    )
}
_WEIGHTED_BY_SUM = {F.mse_loss, F.l1_loss, F.huber_loss}  # mean = sum(w * e) / sum(w)


def reduce_loss(func, args, kwargs):
    """``func(*args, **kwargs)`` as an unreduced loss plus an exact reduction.

    Returns ``NotImplemented`` when there is nothing to do: ``func`` is not in
    :data:`LOSSES`, the call asks for ``reduction='none'``, or it is one torch already writes
    with exact ops.
    """
    signature = LOSSES.get(func)
    if signature is None:
        return NotImplemented
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    if func in _WEIGHTED_BY_SUM and call.get("weight") is not None:
        return NotImplemented
    reduction = call["reduction"]
    if call.get("size_average") is not None or call.get("reduce") is not None:
        reduction = _reduction.legacy_get_string(call["size_average"], call["reduce"])
        call["size_average"] = call["reduce"] = None
    if reduction == "none":
        return NotImplemented
    batchmean = func is F.kl_div and reduction == "batchmean"
    if reduction not in ("mean", "sum") and not batchmean:
        raise ValueError(f"{func.__name__}: {reduction!r} is not a valid value for reduction")
    call["reduction"] = "none"
    losses = func(*bound.args, **bound.kwargs)  # a ShardTensor again, unreduced this time
    if func is F.nll_loss and reduction == "mean":  # / the weights of the counted targets
        call["input"], call["reduction"] = -torch.ones_like(call["input"].detach()), "sum"
        return losses.sum() / func(*bound.args, **bound.kwargs)
    if batchmean:  # torch: sum / input.size(0), the *global* batch size
        return losses.sum() / call["input"].shape[0]
    return losses.mean() if reduction == "mean" else losses.sum()


def _exact_mean(func, args, kwargs):
    """At ``__torch_function__``: a loss on ShardTensors, its reduction exact (under autocast,
    its arguments cast as torch would)."""

    def loss(*a, **k):
        return reduce_loss(func, a, k)

    device = registry.device_type(args, kwargs)
    return autocast_call(func.__name__, func, loss, args, kwargs, device)


register(*LOSSES, at_function=True)(_exact_mean)
