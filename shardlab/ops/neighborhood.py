"""Neighborhood attention (NATTEN's ``na1d``/``na2d``/``na3d``) on plain and sharded tensors.

q, k, v are heads-last, ``(B, *spatial, H, D)``. Each query attends to the k (k x k,
k x k x k) keys around it (``shardlab.layout.neighborhood``: shifted inward at the
borders, optional dilation and causal masking per dim)::

    rank 0 rows 0-4          rank 1 rows 5-9            k = 3 along H, H cut in [5, 5]
    [ q q q q q ] ◀─ row 5   row 4 ─▶ [ q q q q q ]     each rank receives the K/V rows its
                                                         queries see: one row each here

1. per sharded spatial dim (one mesh dim each), the key rows this rank's queries see
   that it does not own come from their owners point to point (K and V in one message;
   multi-hop when shards are smaller than the window), along H first, then along W of
   the H-extended block (the corners come with it); backward sends their gradients home;
2. local attention over the neighborhoods: one score per (query, slot), never a
   (tokens x tokens) matrix: memory O(local tokens x k^n) for the scores and
   O(local tokens x D) per slot (the keys of a slot are gathered, used, dropped), in
   backward too (a custom autograd function recomputes the gathers);
3. the output is laid out like q.

Collectives: none; messages: exactly the K/V rows each rank's queries see and does not
own (the halo lower bound), forward; the same rows' gradients, backward.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Partial, Shard

from shardlab.comm._once import first_order
from shardlab.comm.recompute import fenced, kept
from shardlab.layout.neighborhood import check_dim, neighborhood_plan, neighbors

__all__ = ["na1d", "na2d", "na3d", "neighborhood_attention"]


def na1d(query, key, value, kernel_size, dilation=1, is_causal=False, scale=None):
    """``(B, L, H, D)`` neighborhood attention (NATTEN's ``na1d``).

    Args: ``query``, ``key``, ``value`` (B, L, H, D), plain tensors or ShardTensors cut along
    spatial dims; ``kernel_size``, ``dilation`` an int or one per dim; ``is_causal``;
    ``scale`` (default ``D ** -0.5``). On ShardTensors each rank receives exactly the K/V
    rows its queries see and does not own (one message per neighbour, forward) and sends
    their gradients home (backward); no collective.

    Example: ``y = na1d(q, k, v, kernel_size=7)``.
    """
    return neighborhood_attention(query, key, value, kernel_size, dilation, is_causal, scale, 1)


def na2d(query, key, value, kernel_size, dilation=1, is_causal=False, scale=None):
    """``(B, X, Y, H, D)`` neighborhood attention (NATTEN's ``na2d``).

    Args: ``query``, ``key``, ``value`` (B, X, Y, H, D), plain tensors or ShardTensors cut along
    spatial dims; ``kernel_size``, ``dilation`` an int or one per dim; ``is_causal``;
    ``scale`` (default ``D ** -0.5``). On ShardTensors each rank receives exactly the K/V
    rows its queries see and does not own (one message per neighbour, forward) and sends
    their gradients home (backward); no collective.

    Example: ``y = na2d(q, k, v, kernel_size=7)``.
    """
    return neighborhood_attention(query, key, value, kernel_size, dilation, is_causal, scale, 2)


def na3d(query, key, value, kernel_size, dilation=1, is_causal=False, scale=None):
    """``(B, X, Y, Z, H, D)`` neighborhood attention (NATTEN's ``na3d``).

    Args: ``query``, ``key``, ``value`` (B, X, Y, Z, H, D), plain tensors or ShardTensors cut along
    spatial dims; ``kernel_size``, ``dilation`` an int or one per dim; ``is_causal``;
    ``scale`` (default ``D ** -0.5``). On ShardTensors each rank receives exactly the K/V
    rows its queries see and does not own (one message per neighbour, forward) and sends
    their gradients home (backward); no collective.

    Example: ``y = na3d(q, k, v, kernel_size=7)``.
    """
    return neighborhood_attention(query, key, value, kernel_size, dilation, is_causal, scale, 3)


def _per_dim(value, n: int, name: str) -> tuple:
    if isinstance(value, (tuple, list)):
        if len(value) != n:
            raise ValueError(f"neighborhood attention: {name} needs {n} entries, got {value}")
        return tuple(value)
    return (value,) * n


def neighborhood_attention(q, k, v, kernel_size, dilation=1, is_causal=False, scale=None, n=2):
    """n-D neighborhood attention of heads-last q, k, v; ShardTensors: halos (module doc).

    Example: ``neighborhood_attention(q, k, v, 7, n=2)`` is ``na2d(q, k, v, 7)``.
    """
    from shardlab.tensor import ShardTensor

    # 1. arguments, from global shapes only (the same error on every rank)
    if not (q.ndim == k.ndim == v.ndim == n + 3):
        raise ValueError(
            f"na{n}d: query, key and value must be (B, {n} spatial dims, H, D), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"na{n}d: query {tuple(q.shape)} and key {tuple(k.shape)} must match, and value "
            f"{tuple(v.shape)} may differ only in its last dim"
        )
    ks, ds = _per_dim(kernel_size, n, "kernel_size"), _per_dim(dilation, n, "dilation")
    causal = _per_dim(is_causal, n, "is_causal")
    spatial = tuple(q.shape[1 : n + 1])
    for i in range(n):
        check_dim(spatial[i], ks[i], ds[i], f"spatial dim {i + 1}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not any(isinstance(t, ShardTensor) for t in (q, k, v)):
        index = [
            _index(neighbors(spatial[i], ks[i], ds[i], causal[i]), 0, spatial[i], None, q.device)
            for i in range(n)
        ]
        return _NA.apply(q, k, v, index, scale)
    return _sharded(q, k, v, ks, ds, causal, scale, n)


def _index(nb, a, b, rows, device):
    """(queries a..b-1, slots): each query's keys (``nb``, global, every query's) as
    positions in the local window (-1: no key); ``rows``: the window's global rows (None:
    the whole dim). An empty block (a == b) keeps the slots: (0, slots)."""
    slots = len(nb[0]) if nb else 0
    table = torch.tensor(nb[a:b], dtype=torch.long).view(b - a, slots)
    if rows is not None:
        lookup = torch.full((max(rows, default=0) + 1,), -1, dtype=torch.long)
        lookup[list(rows)] = torch.arange(len(rows))
        table = torch.where(table >= 0, lookup[table.clamp(min=0)], table)
    return table.to(device)


def _sharded(q, k, v, ks, ds, causal, scale, n):
    from shardlab.comm.halo import Halo, peers_along
    from shardlab.comm.p2p import my_coord
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.api import build_sizes

    if not isinstance(q, ShardTensor):
        raise NotImplementedError(
            f"sharded na{n}d: the query must be a ShardTensor when key/value are"
        )
    mesh, lay = q.device_mesh, q.sharding
    for name, t in (("key", k), ("value", v)):
        if not isinstance(t, ShardTensor):
            raise NotImplementedError(
                f"sharded na{n}d: {name} must be a ShardTensor sharded like the query"
            )
        if t.sharding.placements != lay.placements or t.sharding.sizes != lay.sizes:
            raise NotImplementedError(
                f"sharded na{n}d: {name} must be sharded like the query ({lay}); "
                "redistribute it to the query's placements and sizes"
            )
    for m, p in enumerate(lay.placements):
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == n + 2):
            raise NotImplementedError(
                f"sharded na{n}d: the query is {p} on mesh dim {m}; shard batch, spatial "
                "dims or heads, or replicate"
            )
    coord = my_coord(mesh)
    box = lay.local_box(coord)
    # 1. halos, one spatial dim at a time: K and V travel together
    kv = torch.cat([k.to_local(), v.to_local()], dim=-1)  # (B, *local, H, D + D_v)
    index = []
    for i in range(n):
        dim, length = i + 1, q.shape[i + 1]
        cut = [m for m, p in enumerate(lay.placements) if p == Shard(dim)]
        nb = neighbors(length, ks[i], ds[i], causal[i])
        a, b = box[dim]
        if not cut:
            index.append(_index(nb, a, b, None, kv.device))
            continue
        if len(cut) > 1:
            raise NotImplementedError(f"sharded na{n}d: spatial dim {dim} is cut twice")
        plan = neighborhood_plan(tuple(lay.sizes_along(dim)), ks[i], ds[i], causal[i])
        peers, me = peers_along(mesh, cut[0])
        kv = Halo.apply(kv, plan, dim, peers, me, a, 0.0, f"na{n}d.halo")
        index.append(_index(nb, a, b, plan.rows[me], kv.device))
    dk = k.shape[-1]
    out = _NA.apply(q.to_local(), kv[..., :dk], kv[..., dk:], index, scale)
    shape = (*q.shape[:-1], v.shape[-1])
    sizes = build_sizes(lay.sizes)
    return ShardTensor.from_local(out, mesh, lay.placements, sizes, shape=shape, validate=False)


def _gather(x, index, slot):
    """x (B, *window, H, C) at the slot's key of every query: (B, *queries, H, C)."""
    for i, (table, t) in enumerate(zip(index, slot)):
        x = x.index_select(i + 1, table[:, t].clamp(min=0))
    return x


def _valid(index, slot):
    """(*queries) bool: the slot has a key (causal dims have none near the start)."""
    out = None
    for i, (table, t) in enumerate(zip(index, slot)):
        ok = table[:, t] >= 0
        shape = [1] * len(index)
        shape[i] = -1
        ok = ok.view(shape)
        out = ok if out is None else out & ok
    return out


@fenced
class _NA(torch.autograd.Function):
    """Local neighborhood attention; scores (B, *queries, H, slots), nothing bigger."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale):
        slots = list(itertools.product(*[range(t.shape[1]) for t in index]))
        qf = q * scale
        scores = []
        for s in slots:  # (B, *queries, H) each
            sc = (qf * _gather(k, index, s)).sum(-1)
            ok = _valid(index, s)
            if not bool(ok.all()):
                sc = sc.masked_fill(~ok[None, ..., None], float("-inf"))
            scores.append(sc)
        p = torch.softmax(torch.stack(scores, -1), dim=-1)  # (B, *queries, H, slots)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        for j, s in enumerate(slots):
            out += p[..., j, None] * _gather(v, index, s)
        ctx.save_for_backward(q, k, v, p)
        ctx.index, ctx.slots, ctx.scale = index, slots, scale
        return out

    @staticmethod
    @first_order("neighborhood attention")
    def backward(ctx, g):
        q, k, v, p = kept(ctx)
        index, slots, scale = ctx.index, ctx.slots, ctx.scale
        # dp_j = g . v_j ; ds = p (dp - sum_j p_j dp_j)
        dp = torch.stack([(g * _gather(v, index, s)).sum(-1) for s in slots], -1)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, s in enumerate(slots):
            dq += ds[..., j, None] * _gather(k, index, s)
            _scatter(dk, index, s, ds[..., j, None] * q)
            _scatter(dv, index, s, p[..., j, None] * g)
        return dq * scale, dk * scale, dv, None, None


def _scatter(dst, index, slot, src):
    """Adjoint of :func:`_gather`: add ``src`` (B, *queries, H, C) into ``dst``'s window."""
    ok = _valid(index, slot)
    src = src * ok[None, ..., None, None].to(src.dtype)  # (1, *queries, 1, 1)
    for i in reversed(range(len(index))):
        table = index[i][:, slot[i]].clamp(min=0)
        if i == 0:
            dst.index_add_(1, table, src)
            return
        shape = list(src.shape)
        shape[i + 1] = dst.shape[i + 1]
        src = src.new_zeros(shape).index_add_(i + 1, table, src)


def natten_call(name: str, fn, args, kwargs):
    """``natten.<name>`` (``fn``: natten's own ``na1d``/``na2d``/``na3d``) called with a
    ShardTensor: its arguments read by natten's signature, then shardlab's version
    (:mod:`shardlab.patch` routes the call here)."""
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    for unsupported, neutral in (("stride", 1), ("additional_keys", None),
                                 ("additional_values", None)):  # fmt: skip
        if unsupported in a and a[unsupported] not in (neutral, (neutral,) * int(name[2])):
            raise NotImplementedError(
                f"sharded natten.{name}: {unsupported}={a[unsupported]!r} is not "
                f"supported on ShardTensors (shardlab supports kernel_size, dilation, "
                "is_causal, scale)"
            )
    return {"na1d": na1d, "na2d": na2d, "na3d": na3d}[name](
        a["query"], a["key"], a["value"], a["kernel_size"], a.get("dilation", 1),
        a.get("is_causal", False), a.get("scale"),
    )  # fmt: skip
