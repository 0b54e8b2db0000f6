"""The messages of expert parallelism, as autograd Functions on plain tensors.

Three kinds, all on the process group of the expert mesh dim::

    forward                                   backward
    counts    all_to_all  E int64 per rank    (none: integers have no gradient)
    dispatch  all_to_all  rows, uneven        combine's transpose (the same splits, swapped)
    combine   all_to_all  rows, uneven        dispatch's transpose

An ``all_to_all`` with uneven splits: rank r hands ``rows`` cut into ``send_splits[s]``
rows for each rank s (in rank order) and gets ``recv_splits[s]`` rows from each, stacked
in rank order. Its gradient is the same exchange run backwards: the gradient of what rank r
received goes back to where it came from, with the splits swapped.

The tracer records each one as the ``all_to_all`` that ``torch.distributed`` posts (its
bytes: the rows this rank hands in, rows kept on the rank included), labelled
``"experts.dispatch forward"``, ``"experts.combine backward"``, ... (:func:`label`).

:func:`summed` is the data-parallel side: a parameter every rank holds alike (the router)
used on each rank's own tokens gets a partial gradient on each rank; their sum, over the
ranks, is the gradient. It is kept for the one all-reduce of every such gradient at the
end of the backward (:mod:`shardlab.tensor.grad_sum`, labelled ``"params backward"``).
:func:`summed_together` does it for several blocks that are not leaves (the experts'
weights, read as their local blocks), in one all-reduce as their gradients arrive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.comm.recompute import fenced
from shardlab.tensor import grad_sum
from shardlab.trace import label

__all__ = ["all_to_all", "exchange_counts", "summed", "summed_together"]


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (E,): how many rows this rank sends each expert, experts in rank order
    (E/p per rank). Returns (p, E/p): row s holds what rank s sends each of this rank's
    experts. One ``all_to_all`` of E int64 per rank, even splits: metadata (the receivers
    must size their buffers before the rows arrive)."""
    p = dist.get_world_size(group)
    got = torch.empty_like(counts)  # (E,)
    with label("experts.counts", "forward"):
        dist.all_to_all_single(got, counts.contiguous(), group=group)
    return got.view(p, -1)  # (p, E/p)


def all_to_all(rows: torch.Tensor, send_splits, recv_splits, group, cause: str):
    """``rows`` (S, H), cut in ``send_splits`` (one count per rank, summing to S), sent
    to their ranks; returns (R, H), R = sum(``recv_splits``): what each rank sent here,
    in rank order. Differentiable; ``cause`` names it in the tracer (``"experts.dispatch"``).
    """
    return _AllToAll.apply(rows, list(send_splits), list(recv_splits), group, cause)


def _exchange(rows, send_splits, recv_splits, group):
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))  # (R, H)
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


@fenced
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group, cause):
        ctx.splits, ctx.group, ctx.cause = (send_splits, recv_splits), group, cause
        with label(cause, "forward"):
            return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        with label(ctx.cause, "backward"):  # the transpose: the splits swapped
            back = _exchange(grad, recv_splits, send_splits, ctx.group)
        return back, None, None, None, None


def summed(param: torch.Tensor, group, cause: str = "experts.replicated") -> torch.Tensor:
    """``param`` as it is (a view), whose gradient is summed over the ranks of ``group``
    (a process group, or a list of them: one after the other): kept for the one all-reduce
    at the end of the backward where torch allows it (a leaf parameter,
    :func:`shardlab.tensor.grad_sum.keep`), else all-reduced at once, labelled ``cause``."""
    groups = _sending(group)
    if not (torch.is_grad_enabled() and param.requires_grad) or not groups:
        return param
    return _Summed.apply(param, groups, cause)


def _sending(group) -> list:
    """``group`` (a process group, or a list of them): those of more than one rank."""
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    return [g for g in groups if dist.get_world_size(g) > 1]


@fenced
class _Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, groups, cause):
        ctx.groups, ctx.cause = groups, cause
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        if grad_sum.keep(ctx, 0, grad, ctx.groups):
            return None, None, None  # summed with the others at the end of the backward
        grad = grad.clone()
        with label(ctx.cause, "backward"):
            for group in ctx.groups:
                dist.all_reduce(grad, group=group)
        return grad, None, None


def summed_together(params, group, cause: str) -> list:
    """``params`` as they are (views), whose gradients are summed over the ranks of
    ``group`` (a process group, or a list of them) in one all-reduce per group: the
    gradients, flattened into one buffer, as they all arrive in the backward (per dtype,
    where they differ). For blocks that are not leaves (a ShardTensor parameter's local
    block), which the end-of-backward sum cannot keep."""
    groups = _sending(group)
    if not (torch.is_grad_enabled() and any(p.requires_grad for p in params)) or not groups:
        return list(params)
    return list(_SummedTogether.apply(groups, cause, *params))


@fenced
class _SummedTogether(torch.autograd.Function):
    @staticmethod
    def forward(ctx, groups, cause, *params):
        ctx.groups, ctx.cause = groups, cause
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):  # (a gradient not reached is zeros: materialized)
        out = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            mine = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = torch.cat([grads[i].reshape(-1) for i in mine])  # (sum of numels,)
            with label(ctx.cause, "backward"):
                for group in ctx.groups:
                    dist.all_reduce(flat, group=group)
            for i, part in zip(mine, flat.split([grads[i].numel() for i in mine])):
                out[i] = part.view(grads[i].shape)
        return (None, None, *out)
