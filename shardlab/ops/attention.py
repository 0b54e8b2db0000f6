"""Sequence-parallel ``F.scaled_dot_product_attention``: exact ring attention on ShardTensors.

q, k, v of shape (B, H, S, D) sharded along the sequence (dim -2), any sizes::

    mesh dim "seq", N = 3        q rows           k/v rows
        rank 0                   q[0:5]           kv[0:4]       each rank keeps its queries;
        rank 1                   q[5:7]           kv[4:9]       the K/V blocks go round the
        rank 2                   q[7:12]          kv[9:12]      ring (see ``_ring.py``)

    1. read the layouts: which mesh dim shards the sequence of k/v (the ring),
       the exact sizes of every rank's block, the global positions of my rows
    2. cut the mask (plain full tensor, or sharded like the query rows) to my rows; a
       mask cut along its keys (a key-padding mask) is gathered first (B x S values)
    3. RingAttention: N-1 K/V hops forward; K/V hops + dK/dV hops backward
    4. out (B, H, S_q, D_v) sharded exactly like q

Batch or heads cut, the sequence whole: torch's own SDPA runs on the blocks (through
shardlab's aten rules; masks may then require grad, as Swin's relative position bias).
Also handled: q and k/v of different lengths and sizes (including 0 and 1);
k/v replicated (plain tensors or ``Replicate()``): local compute, no ring and no
message forward; a query not cut against cut k/v (a decoder's cross-attention): k/v
gathered; batch or heads sharded on another mesh dim (the ring runs along the
sequence mesh dim only); the sequence cut by both dims of a 2-D mesh (an image's
patches cut along H and W): one ring over all of them; ``is_causal`` with global
positions; leading dims broadcast as torch's (one K/V head for every query head: the
ring carries the one head); boolean or additive ``attn_mask``, also a learned one that
requires grad (BEiT's relative position bias: its gradient is computed with the
blocks, no message; a plain mask's is summed over the ranks by one all-reduce in
backward, as any replicated parameter's); ``scale``; ``enable_gqa``.

``dropout_p > 0`` (training): element (batch, head, query, key) of the probabilities is
kept by a counter-based draw indexed by its GLOBAL indices and TRUE positions, so the
result is the same for every world size, shard sizes and head-tail storage (after the
same ``torch.manual_seed`` on every rank: the seed is one ``torch.randint`` draw per
call); the messages are those without dropout; backward uses the same mask. Not torch's
own mask bit for bit (equal in distribution). Cost: every block runs in the explicit
path (scores of S_q_local x S_kv_block per ring step, no fused kernel) plus a boolean
mask of that size. With dropout, batch/heads cut without the sequence also run here
(the global mask, not each rank's RNG). See ``_attn_dropout.py``.

Causal load balancing (head-tail). With ``is_causal`` and contiguous blocks, rank
0 only sees K/V block 0 while rank N-1 sees all N. Cut the sequence in 2N chunks
and give rank r chunks r and 2N-1-r: every rank then does the same work::

    x = attention.balance(x_full, mesh, [Shard(1)], dims=(1,))    # stored head-tail
    with shardlab.patched(), attention.head_tail():
        y = model(x)               # is_causal reads the true positions of the rows
    y_full = attention.unbalance(y.full_tensor(), parts=N, dims=(1,))

Inside ``head_tail()``, every q/k/v sharded along the sequence is read as
head-tail stored (its sizes must be :func:`head_tail_sizes`); ``attn_mask`` is
indexed like the stored tensors (balance it on both of its last dims).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math

import torch
from torch.distributed.tensor import Shard

from shardlab.comm.halo import peers_along
from shardlab.comm.traced import cpu_numbers
from shardlab.engine import whole
from shardlab.layout import chunk_sizes, offsets
from shardlab.layout.strides import stride_like
from shardlab.ops import _ring_kernels as kernels
from shardlab.ops._attn_args import (
    broadcast,
    check_layouts,
    check_shapes,
    layout_of,
    local_kv,
    local_mask,
    sequence_cut,
    whole_if_plain,
    whole_where_query_is,
    why,
)
from shardlab.ops._attn_dropout import AttnDropout, check_p, lead_index
from shardlab.ops._counter import draw_seed
from shardlab.ops._ring import RingAttention, RingPlan
from shardlab.ops.registry import register
from shardlab.tensor.api import build_sizes

__all__ = [
    "balance",
    "head_tail",
    "head_tail_order",
    "head_tail_sizes",
    "scaled_dot_product_attention",
    "unbalance",
]

_HEAD_TAIL: contextvars.ContextVar[bool] = contextvars.ContextVar("head_tail", default=False)


# -- head-tail load balancing --------------------------------------------------
def head_tail_sizes(length: int, parts: int) -> list[int]:
    """Rows of each rank: chunk r plus chunk 2N-1-r of ``chunk_sizes(length, 2N)``.

    Example::

        head_tail_sizes(16, 2)        # [8, 8]: rank 0 holds chunks 0 and 3 of 4
    """
    c = chunk_sizes(length, 2 * parts)
    return [c[r] + c[2 * parts - 1 - r] for r in range(parts)]


def head_tail_order(length: int, parts: int, device=None) -> torch.Tensor:
    """``order[i]`` = true position of stored row i (chunks 0, 2N-1, 1, 2N-2, ...).

    Example::

        head_tail_order(8, 2)         # tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    c = chunk_sizes(length, 2 * parts)
    start = offsets(c)
    chunks = [i for r in range(parts) for i in (r, 2 * parts - 1 - r)]
    return torch.cat(
        [torch.arange(start[i], start[i] + c[i], device=device) for i in chunks]
        or [torch.zeros(0, dtype=torch.long, device=device)]
    )


def balance(x: torch.Tensor, mesh, placements, dims=(-2,)):
    """Store ``x`` (the same full tensor on every rank) head-tail along ``dims`` and
    keep this rank's block (no communication). ``dims[0]`` is the sharded sequence dim.

    Example::

        with head_tail():
            q = balance(q_full, mesh, [Shard(2)])     # (B, H, S, D), S cut head-tail
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y_full = unbalance(y.full_tensor(), parts=mesh.size())
    """
    from shardlab.tensor import distribute

    seq = dims[0] % x.ndim
    along = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim % x.ndim == seq]
    if len(along) != 1:
        raise ValueError(f"balance: exactly one mesh dim must shard dim {dims[0]}")
    parts = mesh.shape[along[0]]
    x = _permute(x, parts, dims, inverse=False)
    sizes = [
        head_tail_sizes(x.shape[seq], parts) if m == along[0] else None for m in range(mesh.ndim)
    ]
    return distribute(x, mesh, placements, sizes)


def unbalance(x: torch.Tensor, parts: int, dims=(-2,)) -> torch.Tensor:
    """Undo :func:`balance` on a full tensor (e.g. ``y.full_tensor()``).

    Example: see :func:`balance`.
    """
    return _permute(x, parts, dims, inverse=True)


def _permute(x, parts, dims, inverse):
    for d in dims:
        order = head_tail_order(x.shape[d], parts, x.device)
        x = x.index_select(d, torch.argsort(order) if inverse else order)
    return x


@contextlib.contextmanager
def head_tail():
    """Inside: sequence-sharded q/k/v are stored head-tail (see :func:`balance`).

    Example: see :func:`balance`.
    """
    token = _HEAD_TAIL.set(True)
    try:
        yield
    finally:
        _HEAD_TAIL.reset(token)


# -- the handler -----------------------------------------------------------------
def _no_dropout(args, kwargs) -> bool:
    """Attention's dropout follows shardlab's own mask definition (the same on any mesh,
    ``ops/_attn_dropout.py``), not torch's generator: only dropout-free calls may take
    the whole-tensor path (:mod:`shardlab.engine.whole`)."""
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return p == 0


whole.ONLY_IF["scaled_dot_product_attention"] = _no_dropout


@register("scaled_dot_product_attention")
def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """``F.scaled_dot_product_attention`` with a sequence-sharded ShardTensor ``query``.

    Called for ``F.scaled_dot_product_attention`` under :func:`shardlab.patched`. Ring
    attention: each rank receives every other rank's K and V block once in forward (point to
    point, overlapped with the blocks' compute) and sends dK/dV back around the ring in
    backward; scores are never larger than (local queries x one K/V block).

    Example::

        with shardlab.patched():
            q, k, v = (shardlab.distribute(t, mesh, [Shard(2)]) for t in (q_, k_, v_))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if dropout_p:  # torch's check, words and type; every rank, before any message
        check_p(dropout_p)
    seed = draw_seed() if dropout_p else None  # dropout_p = 0: no random number drawn
    return attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed)


def attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed):
    """The handler's work, with the dropout mask's ``seed`` given (multi-head attention
    draws it once for the output and the weights it returns)."""
    from shardlab.comm.p2p import my_coord
    from shardlab.tensor import ShardTensor

    ours = sequence_cut(query, key, value) or (
        dropout_p and any(isinstance(t, ShardTensor) for t in (query, key, value))
    )  # with dropout also batch/heads cut only: the global mask, not each rank's own RNG
    if not ours:  # batch/heads cut only: no ring needed
        return torch._C._nn.scaled_dot_product_attention(  # torch's own, on the blocks
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # 1. arguments, as torch checks them
    if is_causal and attn_mask is not None:  # torch's documented rule, its words and type
        raise RuntimeError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
            "is_causal=True"
        )
    query = whole_if_plain(query, key, value)
    query, key, value, enable_gqa = broadcast(query, key, value, enable_gqa)
    mesh, nd = query.device_mesh, query.ndim
    seq = nd - 2
    rep = check_shapes(query, key, value, enable_gqa)
    ql, kl, vl = query.sharding, layout_of(key, mesh), layout_of(value, mesh)
    key, kl = whole_where_query_is(key, kl, ql, seq)
    value, vl = whole_where_query_is(value, vl, ql, seq)
    coord = my_coord(mesh)
    ring = check_layouts(ql, kl, vl, nd)

    # 2. the ring: peers from mesh coordinates, sizes of every K/V block
    if not ring:
        peers, me, group, kv_sizes = [None], 0, None, [key.shape[-2]]
    elif len(ring) == 1:
        peers, me = peers_along(mesh, ring[0])
        group, kv_sizes = mesh.get_group(ring[0]), list(kl.shard_sizes(ring[0], coord))
    else:  # one ring over both mesh dims, in the order of the blocks along the sequence
        peers, me, kv_sizes = _ring_over(mesh, ring, kl, seq, coord)
        group = None  # point to point between global ranks
    kv_starts = list(offsets(kv_sizes))

    # 3. local blocks; replicated k/v get Partial gradients over the query's mesh dims
    q_l = query.to_local()  # (B, H_q, S_local_q, D)
    k_l = local_kv(key, kl, ql, mesh, coord, rep)  # (B, H_kv, S_local_kv, D)
    v_l = local_kv(value, vl, ql, mesh, coord, rep)  # (B, H_kv, S_local_kv, D_v)
    q_pos = kv_pos = drop = None
    if is_causal:  # true positions of my query rows and of every K/V block (on the CPU)
        a, b = ql.local_box(coord)[seq]
        with cpu_numbers():  # (plain tensors, also while torch.compile traces)
            q_pos = _positions(ql, seq, mesh)[a:b]
            kv_all = _positions(kl, seq, mesh)
            kv_pos = [kv_all[s : s + n] for s, n in zip(kv_starts, kv_sizes)]
    if dropout_p:
        drop = dropout_mask(dropout_p, seed, ql, kl, mesh, coord)
    mask_l = local_mask(attn_mask, query, key, mesh, coord)  # (.., S_local_q, S_kv)
    plan = RingPlan(
        peers=peers,
        me=me,
        group=group,
        kv_sizes=kv_sizes,
        kv_starts=kv_starts,
        q_pos=q_pos,
        kv_pos=kv_pos,
        mask=None if mask_l is None else mask_l.detach(),
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
        rep=rep,
        kernel=kernels.choose_for(q_l, v_l),  # the same on every rank: dtype, dims, device
        drop=drop,
    )

    # 4. compute, and wrap the output like the query
    learned = mask_l if mask_l is not None and mask_l.requires_grad else None
    out_l = RingAttention.apply(q_l, k_l, v_l, plan, learned)  # (B, H_q, S_local_q, D_v)
    sizes = build_sizes(ql.sizes)
    shape = (*query.shape[:-1], value.shape[-1])
    stride = stride_like(query.stride(), shape)  # laid out like the query, as torch's
    return ShardTensor.from_local(
        out_l, mesh, ql.placements, sizes, shape=shape, stride=stride, validate=False
    )


# -- helpers ---------------------------------------------------------------------
def dropout_mask(p, seed, ql, kl, mesh, coord) -> AttnDropout:
    """The dropout mask's indices for the local queries of layout ``ql`` against the
    keys of layout ``kl``: global leading rows, true positions (``_attn_dropout.py``)."""
    seq = len(ql.global_shape) - 2
    a, b = ql.local_box(coord)[seq]
    return AttnDropout(
        p=p,
        seed=seed,
        lead=lead_index(ql, coord),
        q_pos=_positions(ql, seq, mesh)[a:b],
        kv_pos=_positions(kl, seq, mesh),
        sq=ql.global_shape[seq],
        skv=kl.global_shape[seq],
    )


def _ring_over(mesh, ring, kl, seq, coord):
    """(peers, my position, K/V block sizes) of a ring over the mesh dims ``ring`` that
    all cut the sequence (outer first): rank (i, j) holds the (i * n_j + j)-th block."""
    from shardlab.comm.p2p import rank_at

    if _HEAD_TAIL.get():
        raise why("head_tail() with the sequence cut by two mesh dims; cut it by one")
    coords = []
    for idx in itertools.product(*(range(mesh.shape[m]) for m in ring)):
        c = list(coord)
        for m, i in zip(ring, idx):
            c[m] = i
        coords.append(tuple(c))
    runs = [kl.dim_intervals(seq, c) for c in coords]
    sizes = [sum(b - a for a, b in r) for r in runs]
    starts = offsets(sizes)
    if any(len(r) > 1 or (r and r[0][0] != st) for r, st in zip(runs, starts)):
        raise why("the sequence's blocks are not in ring order; cut it by one mesh dim")
    return [rank_at(mesh, c) for c in coords], coords.index(tuple(coord)), sizes


def _positions(lay, seq, mesh) -> torch.Tensor:
    """True position of every stored row along ``seq`` (head-tail inside ``head_tail()``)."""
    length = lay.global_shape[seq]
    along = [m for m, p in enumerate(lay.placements) if p == Shard(seq)]
    if not _HEAD_TAIL.get() or not along:
        return torch.arange(length)
    parts = mesh.shape[along[0]]
    if list(lay.sizes_along(seq)) != head_tail_sizes(length, parts):
        raise ValueError(
            f"inside head_tail(), a sequence of {length} on {parts} ranks must have sizes "
            f"{head_tail_sizes(length, parts)} (use attention.balance), got "
            f"{list(lay.sizes_along(seq))}"
        )
    return head_tail_order(length, parts)
