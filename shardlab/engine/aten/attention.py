"""torch's fused attention kernels on ShardTensors whose batch or heads are cut.

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
from shardlab.layout import moves
from shardlab.layout.elementwise import restrict, target_from
from shardlab.layout.views import select_dims_layout

from .registry import register

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
    """``t`` (plain or ShardTensor) moved to ``target`` restricted to its shape."""
    st = c.ShardTensor
    t = c.reduced(t if isinstance(t, st) else c.as_shard(t, mesh), cause)
    return c.move(t, restrict(target, t.shape, [False] * mesh.ndim), cause)


@register(_FWD, _BWD)
def _fused(func, args, kwargs):
    mask = kwargs.get("attn_mask")
    qkv = args[1:4] if func is _BWD else args[0:3]
    gqa = qkv[0].shape[1] != qkv[1].shape[1]  # the kernel repeats the K/V heads itself
    if not _whole_rows(*qkv, mask) or (gqa and _cut(1, *qkv, mask)):
        return NotImplemented  # a cut sequence (or GQA with cut heads): whole tensors
    mesh = c.the_mesh(c.shards_in((args, kwargs)))
    cause = f"{c.op_name(func)}.align"
    q = c.reduced(qkv[0] if isinstance(qkv[0], c.ShardTensor) else c.as_shard(qkv[0], mesh), cause)
    places = q._layout.placements
    one_rank = [m for m, p in enumerate(places) if isinstance(p, Shard) and p.dim >= 2]
    if one_rank:  # S_q or D cut by mesh dims of one rank (whole): Replicate says the same
        q = c.move(q, moves.replicated(q._layout, one_rank), cause)  # (no message)
    lay = q._layout  # (B, H, S_q, D): batch / heads cut, the rest whole
    b, h, sq = q.shape[:3]
    scores = target_from(lay, (b, h, sq, qkv[1].shape[2]), [False] * mesh.ndim)
    local_kwargs, used, ran = dict(kwargs), {}, False
    if mask is not None:
        used[len(args) + list(kwargs).index("attn_mask")] = m = _like(mask, scores, mesh, cause)
        local_kwargs["attn_mask"] = m._local_tensor
    rows = select_dims_layout(lay, [0, 1, 2])  # (B, H, S_q): the logsumexp
    if func is _FWD:
        k, v = (_like(t, lay, mesh, cause) for t in args[1:3])
        if q._local_tensor.numel() == 0 or k._local_tensor.numel() == 0:  # nothing here
            ql = q._local_tensor  # (the kernel refuses empty blocks)
            out = ql.new_zeros((*ql.shape[:-1], v._local_tensor.shape[-1]))
            lse = ql.new_full(ql.shape[:-1], float("-inf"))
        else:
            out, lse = func(
                q._local_tensor, k._local_tensor, v._local_tensor, *args[3:], **local_kwargs
            )
            used.update({0: q, 1: k, 2: v})
            ran = True
        results = (
            c.wrap(out, mesh, lay.replace(global_shape=(b, h, sq, v.shape[-1]))),
            c.wrap(lse, mesh, rows),
        )
        if ran:  # the kernel on this rank's blocks: kept per signature
            layouts = tuple(r._layout for r in results)
            c.keep_moves(func, args, kwargs, used, results[0], mesh, layouts, cause)
        return results
    g, k, v, o = (_like(t, lay, mesh, cause) for t in (args[0], args[2], args[3], args[4]))
    lse = _like(args[5], rows, mesh, cause)
    if q._local_tensor.numel() == 0 or k._local_tensor.numel() == 0:
        dq, dk, dv = (torch.zeros_like(t._local_tensor) for t in (q, k, v))
    else:
        dq, dk, dv = func(
            g._local_tensor,
            q._local_tensor,
            k._local_tensor,
            v._local_tensor,
            o._local_tensor,
            lse._local_tensor,
            *args[6:],
            **local_kwargs,
        )
        used.update({0: g, 1: q, 2: k, 3: v, 4: o, 5: lse})
        ran = True
    results = (c.wrap(dq, mesh, lay), c.wrap(dk, mesh, k._layout), c.wrap(dv, mesh, v._layout))
    if ran:  # the kernel on this rank's blocks: kept per signature
        layouts = tuple(r._layout for r in results)
        c.keep_moves(func, args, kwargs, used, results[0], mesh, layouts, cause)
    return results
