"""torch's fused attention kernels (aten) on ShardTensors whose batch or heads are cut:
the attention family's rule below ``F.scaled_dot_product_attention``
(:mod:`shardlab.ops.attention`), registered in the one registry.

``q, k, v (B, H, S, D)`` with B and/or H cut and every sequence whole (cut at most by mesh
dims of one rank): each rank runs
the fused kernel on its own (batch, head) rows, forward and backward, no message (with
fewer K/V heads than query heads, grouped-query attention, only B may be cut)::

    rank r:  out[b_r, h_r] = attention(q[b_r, h_r], k[b_r, h_r], v[b_r, h_r])

A cut sequence is the ring's job (:mod:`shardlab.ops.attention`, under
``shardlab.patched()``); reaching these kernels that way, the op runs on whole tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import moves
from shardlab.layout.elementwise import restrict, target_from
from shardlab.layout.views import select_dims_layout

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _whole_rows(*tensors) -> bool:
    """No mesh dim of more than one rank cuts the last two dims (sequence, features) of
    any argument (a mesh dim of one rank holds them whole)."""
    return not any(_cut(d, t) for t in tensors for d in (-2, -1))


def _cut(dim, *tensors) -> bool:
    """Does a mesh dim of more than one rank cut ``dim`` of any argument?"""
    st = c.ShardTensor
    return any(t._layout.cut_by(dim % t.ndim) for t in tensors if isinstance(t, st))


def _like(t, target, mesh, cause):
    """The steps that take ``t`` (plain or ShardTensor) to ``target`` restricted to its
    shape: its Partial summed, then aligned (None: it stays as it is)."""
    lay = t._layout if isinstance(t, c.ShardTensor) else c.replicate_layout(t.shape, mesh)
    steps, part = [], c.without_partial(lay)
    if part != lay:
        steps.append((part, cause))
    want = restrict(target, t.shape, [False] * mesh.ndim)
    if want != part:
        steps.append((want, cause))
    return tuple(steps) or None


@register(_FWD, _BWD)
def _fused(func, args, kwargs):
    """The plan: q's batch and head cuts for every argument, then the kernel per block."""
    mask = kwargs.get("attn_mask")
    qkv = args[1:4] if func is _BWD else args[0:3]
    gqa = qkv[0].shape[1] != qkv[1].shape[1]  # the kernel repeats the K/V heads itself
    if not _whole_rows(*qkv, mask) or (gqa and _cut(1, *qkv, mask)):
        return NotImplemented  # a cut sequence (or GQA with cut heads): whole tensors
    mesh = c.the_mesh(c.shards_in((args, kwargs)))
    cause = f"{c.op_name(func)}.align"
    q = qkv[0]
    lay = q._layout if isinstance(q, c.ShardTensor) else c.replicate_layout(q.shape, mesh)
    lay = c.without_partial(lay)
    one_rank = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim >= 2]
    if one_rank:  # S_q or D cut by mesh dims of one rank (whole): Replicate says the same
        lay = moves.replicated(lay, one_rank)  # (no message)
    # lay (B, H, S_q, D): batch / heads cut, the rest whole
    b, h, sq = q.shape[:3]
    rows = select_dims_layout(lay, [0, 1, 2])  # (B, H, S_q): the logsumexp
    like = [lay] * 5 + [rows] if func is _BWD else [lay] * 3  # g, q, k, v, o, lse | q, k, v
    steps = [_like(a, t, mesh, cause) for a, t in zip(args, like)]
    steps += [None] * (len(args) - len(steps))
    for name, v in kwargs.items():
        if name == "attn_mask" and v is not None:
            scores = target_from(lay, (b, h, sq, qkv[1].shape[2]), [False] * mesh.ndim)
            steps.append(_like(v, scores, mesh, cause))
        else:
            steps.append(None)
    if func is _FWD:
        v = qkv[2]
        outs = (lay.replace(global_shape=(b, h, sq, v.shape[-1])), rows)
    else:  # dq like q, dk and dv like k and v (their own shapes)
        outs = (lay, *(restrict(lay, t.shape, [False] * mesh.ndim) for t in qkv[1:]))
    return Plan(mesh, outs, steps, cause, local=_Kernel(func))


class _Kernel:
    """The fused kernel on this rank's blocks (it refuses empty ones: then the empty
    results directly)."""

    __slots__ = ("func",)

    def __init__(self, func):
        self.func = func

    def __call__(self, args, kwargs):
        if self.func is _FWD:
            q, k, v = args[:3]
            if q.numel() == 0 or k.numel() == 0:  # nothing here
                out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
                return out, q.new_full(q.shape[:-1], float("-inf"))
        elif args[1].numel() == 0 or args[2].numel() == 0:
            return tuple(torch.zeros_like(t) for t in args[1:4])
        return self.func(*args, **kwargs)
