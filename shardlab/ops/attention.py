"""Sequence-parallel ``F.scaled_dot_product_attention``: exact ring attention on ShardTensors.

q, k, v of shape (B, H, S, D) sharded along the sequence (dim -2), any sizes::

    mesh dim "seq", N = 3        q rows           k/v rows
        rank 0                   q[0:5]           kv[0:4]       each rank keeps its queries;
        rank 1                   q[5:7]           kv[4:9]       the K/V blocks go round the
        rank 2                   q[7:12]          kv[9:12]      ring (see ``_ring.py``)

    1. read the layouts: which mesh dim shards the sequence of k/v (the ring),
       the exact sizes of every rank's block, the global positions of my rows
    2. cut the mask (plain full tensor, or sharded like the query rows) to my rows
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
``dropout_p > 0`` raises.

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
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.layout import ShardLayout, chunk_sizes, offsets
from shardlab.ops import _ring_kernels as kernels
from shardlab.ops._ring import RingAttention, RingPlan
from shardlab.ops.halo import peers_along
from shardlab.ops.registry import register
from shardlab.tensor.api import build_sizes, stride_like

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
    """Rows of each rank: chunk r plus chunk 2N-1-r of ``chunk_sizes(length, 2N)``."""
    c = chunk_sizes(length, 2 * parts)
    return [c[r] + c[2 * parts - 1 - r] for r in range(parts)]


def head_tail_order(length: int, parts: int, device=None) -> torch.Tensor:
    """``order[i]`` = true position of stored row i (chunks 0, 2N-1, 1, 2N-2, ...)."""
    c = chunk_sizes(length, 2 * parts)
    start = offsets(c)
    chunks = [i for r in range(parts) for i in (r, 2 * parts - 1 - r)]
    return torch.cat(
        [torch.arange(start[i], start[i] + c[i], device=device) for i in chunks]
        or [torch.zeros(0, dtype=torch.long, device=device)]
    )


def balance(x: torch.Tensor, mesh, placements, dims=(-2,)):
    """Store ``x`` (the same full tensor on every rank) head-tail along ``dims`` and
    keep this rank's block (no communication). ``dims[0]`` is the sharded sequence dim."""
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
    """Undo :func:`balance` on a full tensor (e.g. ``y.full_tensor()``)."""
    return _permute(x, parts, dims, inverse=True)


def _permute(x, parts, dims, inverse):
    for d in dims:
        order = head_tail_order(x.shape[d], parts, x.device)
        x = x.index_select(d, torch.argsort(order) if inverse else order)
    return x


@contextlib.contextmanager
def head_tail():
    """Inside: sequence-sharded q/k/v are stored head-tail (see :func:`balance`)."""
    token = _HEAD_TAIL.set(True)
    try:
        yield
    finally:
        _HEAD_TAIL.reset(token)


# -- the handler -----------------------------------------------------------------
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
    """``F.scaled_dot_product_attention`` with a sequence-sharded ShardTensor ``query``."""
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.comm import my_coord

    if not _sequence_cut(query, key, value):  # batch/heads cut only: no ring needed
        return torch._C._nn.scaled_dot_product_attention(  # torch's own, on the blocks
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # 1. arguments, as torch checks them
    if dropout_p:
        raise NotImplementedError(
            f"sharded scaled_dot_product_attention: dropout_p={dropout_p} is not supported "
            "(no reproducible sharded RNG yet); pass dropout_p=0.0 (e.g. model.eval())"
        )
    if is_causal and attn_mask is not None:  # torch's documented rule, its words and type
        raise RuntimeError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
            "is_causal=True"
        )
    if not isinstance(query, ShardTensor):  # a plain query (SigLIP's learned probe): whole
        from shardlab.tensor import distribute

        mesh = next(t.device_mesh for t in (key, value) if isinstance(t, ShardTensor))
        query = distribute(query, mesh, [Replicate()] * mesh.ndim)
    query, key, value, enable_gqa = _broadcast(query, key, value, enable_gqa)
    mesh, nd = query.device_mesh, query.ndim
    seq = nd - 2
    rep = _check_shapes(query, key, value, enable_gqa)
    ql, kl, vl = query.sharding, _layout_of(key, mesh), _layout_of(value, mesh)
    key, kl = _whole_where_query_is(key, kl, ql, seq)
    value, vl = _whole_where_query_is(value, vl, ql, seq)
    coord = my_coord(mesh)
    ring = _check_layouts(ql, kl, vl, nd)

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
    k_l = _local_kv(key, kl, ql, mesh, coord, rep)  # (B, H_kv, S_local_kv, D)
    v_l = _local_kv(value, vl, ql, mesh, coord, rep)  # (B, H_kv, S_local_kv, D_v)
    q_pos = kv_pos = None
    if is_causal:  # true positions of my query rows and of every K/V block (on the CPU)
        a, b = ql.local_box(coord)[seq]
        q_pos = _positions(ql, seq, mesh)[a:b]
        kv_all = _positions(kl, seq, mesh)
        kv_pos = [kv_all[s : s + n] for s, n in zip(kv_starts, kv_sizes)]
    mask_l = _local_mask(attn_mask, query, key, mesh, coord)  # (.., S_local_q, S_kv)
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
def _sequence_cut(*tensors) -> bool:
    """Does a mesh dim cut the sequence (dim -2) of q, k or v?"""
    from shardlab.tensor import ShardTensor

    return any(
        isinstance(p, Shard) and p.dim == t.ndim - 2
        for t in tensors
        if isinstance(t, ShardTensor)
        for p in t.sharding.placements
    )


def _why(msg: str) -> NotImplementedError:
    return NotImplementedError(f"sharded scaled_dot_product_attention: {msg}")


def _broadcast(q, k, v, enable_gqa):
    """torch broadcasts the leading dims of q, k and v (multi-query attention: K/V with one
    head, as Falcon's). One K/V head for every query head, the query's heads not cut: the
    grouped-query path (the ring carries the one head); otherwise the tensors are expanded
    (views) to the common leading shape. Returns (q, k, v, enable_gqa)."""
    if enable_gqa or min(q.ndim, k.ndim, v.ndim) < 2:
        return q, k, v, enable_gqa  # _check_shapes says what is wrong, as torch
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        return q, k, v, False
    nd = max(q.ndim, k.ndim, v.ndim)
    q, k, v = (x if x.ndim == nd else x.reshape((1,) * (nd - x.ndim) + tuple(x.shape))
               for x in (q, k, v))  # fmt: skip
    leads = [tuple(x.shape[:-2]) for x in (q, k, v)]
    try:
        target = torch.broadcast_shapes(*leads)
    except RuntimeError:
        return q, k, v, False
    heads_cut = any(p == Shard(nd - 3) for p in q.sharding.placements)
    if (
        nd >= 3
        and leads[0] == target
        and leads[1] == leads[2] == (*target[:-1], 1)
        and not heads_cut
    ):
        return q, k, v, True  # one K/V head for all: GQA with H_kv = 1
    q, k, v = (x.expand(*target, *x.shape[-2:]) for x in (q, k, v))
    return q, k, v, False


def _check_shapes(q, k, v, enable_gqa) -> int:
    """Query heads per K/V head (1 without GQA); torch's shape rules."""
    if not (q.ndim == k.ndim == v.ndim >= 2):
        raise RuntimeError(
            f"q, k, v must have the same ndim >= 2, got {q.ndim}, {k.ndim}, {v.ndim}"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise RuntimeError(
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k need "
            "the same last dim, k and v the same sequence length"
        )
    lead = q.ndim - 3 if enable_gqa and q.ndim >= 3 else q.ndim - 2
    hq, hk = (q.shape[-3], k.shape[-3]) if lead == q.ndim - 3 else (1, 1)
    if q.shape[:lead] != k.shape[:lead] or k.shape[:-2] != v.shape[:-2] or hq % hk:
        raise RuntimeError(
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
            + (" (enable_gqa: query heads must be a multiple of key heads)" if enable_gqa else "")
        )
    return hq // hk


def _layout_of(t, mesh) -> ShardLayout:
    """A ShardTensor's layout; a plain tensor is read as replicated."""
    from shardlab.tensor import ShardTensor

    if isinstance(t, ShardTensor):
        if t.device_mesh != mesh:
            raise _why("all ShardTensor arguments must be on the query's mesh")
        return t.sharding
    return ShardLayout.build(tuple(t.shape), tuple(mesh.shape), [Replicate()] * mesh.ndim)


def _whole_where_query_is(t, lay, ql, seq):
    """k or v cut along the sequence on a mesh dim where the query is not (the decoder's
    queries against the encoder's keys, the decoder not cut): every rank needs all of it,
    gathered (labelled ``auto-redistribute for scaled_dot_product_attention``)."""
    cut = [
        m
        for m, p in enumerate(lay.placements)
        if p == Shard(seq) and ql.placements[m] != Shard(seq)
    ]
    if not cut:
        return t, lay
    from shardlab.layout import moves
    from shardlab.tensor.api import _Redistribute

    whole = moves.replicated(lay, cut)
    cause = "auto-redistribute for scaled_dot_product_attention"
    return _Redistribute.apply(t, whole, cause), whole


def _check_layouts(ql, kl, vl, nd) -> list[int]:
    """The mesh dims the ring runs along: one, two (the sequence cut by both: flattened
    image tokens of a 2-D mesh) or none (k/v hold the whole sequence)."""
    seq = nd - 2
    for name, lay in (("query", ql), ("key", kl), ("value", vl)):
        for m, p in enumerate(lay.placements):
            if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == nd - 1):
                raise _why(
                    f"{name} is {p} on mesh dim {m}; redistribute it (Shard the "
                    "sequence or batch/heads, or Replicate)"
                )
    if kl.placements != vl.placements or kl.sizes != vl.sizes:
        raise _why("key and value must be sharded alike (same placements and sizes)")
    on_seq = lambda lay: [m for m, p in enumerate(lay.placements) if p == Shard(seq)]  # noqa: E731
    q_seq, kv_seq = on_seq(ql), on_seq(kl)
    if kv_seq and q_seq != kv_seq:
        raise _why(
            f"key/value are sharded along the sequence on mesh dims {kv_seq}, the query on "
            f"{q_seq}: shard the query's dim {seq} on the same mesh dims, or replicate k/v"
        )
    return kv_seq


def _local_kv(t, lay, ql, mesh, coord, rep):
    """This rank's k or v: its own sequence block, cut to the batch/head rows of
    the local queries. Gradient: Partial on mesh dims where q is sharded and t is not."""
    from shardlab.tensor import ShardTensor, distribute

    grads = [
        Partial() if isinstance(qp, Shard) and not isinstance(p, Shard) else p
        for p, qp in zip(lay.placements, ql.placements)
    ]
    if not isinstance(t, ShardTensor) and t.requires_grad:
        t = distribute(t, mesh, [Replicate()] * mesh.ndim)
    local = t.to_local(grad_placements=grads) if isinstance(t, ShardTensor) else t
    for d, start, length in _everywhere(_kv_cuts, lay, ql, t.ndim, rep, at=coord):
        local = local.narrow(d, start, length)
    return local


def _ring_over(mesh, ring, kl, seq, coord):
    """(peers, my position, K/V block sizes) of a ring over the mesh dims ``ring`` that
    all cut the sequence (outer first): rank (i, j) holds the (i * n_j + j)-th block."""
    from shardlab.tensor.comm import rank_at

    if _HEAD_TAIL.get():
        raise _why("head_tail() with the sequence cut by two mesh dims; cut it by one")
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
        raise _why("the sequence's blocks are not in ring order; cut it by one mesh dim")
    return [rank_at(mesh, c) for c in coords], coords.index(tuple(coord)), sizes


def _everywhere(cuts, lay, *args, at):
    """``cuts(lay, *args, coord)`` checked at every mesh coordinate first, so that an
    argument error is raised on every rank (never on some, the others then waiting in
    the ring); returns its value at ``at``."""
    for c in lay.coords():
        cuts(lay, *args, c)
    return cuts(lay, *args, at)


def _kv_cuts(lay, ql, ndim, rep, coord) -> list:
    """[(dim, start, length)]: k/v's block at ``coord`` narrowed to the batch/head rows its
    queries need (GQA: whole K/V heads)."""
    box, qbox, cuts = lay.local_box(coord), ql.local_box(coord), []
    for d in range(ndim - 2):  # batch/head dims
        a, b = qbox[d]
        if d == ndim - 3 and rep > 1:
            if a % rep or b % rep:
                raise _why("with enable_gqa, each rank's query heads must cover whole K/V heads")
            a, b = a // rep, b // rep
        if not box[d][0] <= a <= b <= box[d][1]:
            raise _why(
                f"k/v do not hold rows {a}:{b} of dim {d} that the queries of mesh coordinate "
                f"{tuple(coord)} need; shard batch/heads of q, k, v alike, or replicate k/v"
            )
        if (a, b) != box[d]:
            cuts.append((d, a - box[d][0], b - a))
    return cuts


def _local_mask(mask, query, key, mesh, coord):
    """The mask's rows of my queries (its columns stay global: the ring cuts them per block).
    A mask that requires grad (a learned bias) stays attached: its gradient is Partial on
    the mesh dims that cut the query but not the mask (each rank has its query rows')."""
    from shardlab.tensor import ShardTensor, distribute

    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise RuntimeError(f"attn_mask must be boolean or floating point, got {mask.dtype}")
    off = query.ndim - mask.ndim
    target = (*query.shape[:-1], key.shape[-2])  # (B, H_q, S_q, S_kv)
    if off < 0 or any(n not in (1, target[i + off]) for i, n in enumerate(mask.shape)):
        raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target}")
    lay = _layout_of(mask, mesh)
    if mask.requires_grad and not isinstance(mask, ShardTensor):
        mask = distribute(mask, mesh, [Replicate()] * mesh.ndim)  # a full, plain gradient
    if isinstance(mask, ShardTensor):
        grads = [
            Partial() if isinstance(qp, Shard) and not isinstance(p, Shard) else p
            for p, qp in zip(lay.placements, query.sharding.placements)
        ]
        local = mask.to_local(grad_placements=grads)
    else:
        local = mask
    for d, start, length in _everywhere(_mask_cuts, lay, query.sharding, off, at=coord):
        local = local.narrow(d, start, length)
    return local


def _mask_cuts(lay, ql, off, coord) -> list:
    """[(dim, start, length)]: the mask's block at ``coord`` narrowed to its queries' rows
    (``off``: how many leading dims the query has more than the mask)."""
    box, qbox, cuts = lay.local_box(coord), ql.local_box(coord), []
    for i, n in enumerate(lay.global_shape):
        if n == 1:
            continue
        if i + off == len(ql.global_shape) - 1:  # key columns: every rank needs them all
            if box[i] != (0, n):
                raise _why("attn_mask must not be sharded along its last (key) dim")
            continue
        (a, b), (c, e) = qbox[i + off], box[i]
        if not c <= a <= b <= e:
            raise _why(
                "attn_mask must hold the rows of the local queries: shard it like the "
                "query (dim -2, same sizes) or pass the full mask on every rank"
            )
        if (a, b) != (c, e):
            cuts.append((i, a - c, b - a))
    return cuts


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
