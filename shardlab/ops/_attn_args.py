"""The arguments of sharded ``scaled_dot_product_attention``, read as torch reads them.

Pure decisions on global shapes and layouts (the same on every rank) and the local blocks
each rank computes with:

* :func:`broadcast` / :func:`check_shapes`: torch's leading-dim broadcasting and shape rules
  (its ``RuntimeError`` s);
* :func:`check_layouts`: which mesh dims the ring runs along (one, two, or none);
  :func:`whole_where_query_is`: k/v cut where the query is not are gathered;
* :func:`local_kv` / :func:`local_mask`: k/v and the mask cut to the rows of the local
  queries, their gradients Partial where the query is cut and they are not; every
  rank's cut is checked at every mesh coordinate first (:func:`everywhere`), so a bad
  layout is an error on every rank, never some ranks waiting in the ring.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.layout import ShardLayout


def sequence_cut(*tensors) -> bool:
    """Does a mesh dim of more than one rank cut the sequence (dim -2) of q, k or v? (A
    mesh dim of one rank holds the whole sequence: no ring.)"""
    from shardlab.tensor import ShardTensor

    return any(t._layout.cut_by(t.ndim - 2) for t in tensors if isinstance(t, ShardTensor))


def why(msg: str) -> NotImplementedError:
    return NotImplementedError(f"sharded scaled_dot_product_attention: {msg}")


def broadcast(q, k, v, enable_gqa):
    """torch broadcasts the leading dims of q, k and v (multi-query attention: K/V with one
    head, as Falcon's). One K/V head for every query head, the query's heads not cut: the
    grouped-query path (the ring carries the one head); otherwise the tensors are expanded
    (views) to the common leading shape. Returns (q, k, v, enable_gqa)."""
    if enable_gqa or min(q.ndim, k.ndim, v.ndim) < 2:
        return q, k, v, enable_gqa  # check_shapes says what is wrong, as torch
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


def check_shapes(q, k, v, enable_gqa) -> int:
    """Query heads per K/V head (1 without GQA); torch's dtype and shape rules."""
    if not (q.dtype == k.dtype == v.dtype):  # torch's check and words (the ring sends K, V as such)
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{_c_name(q.dtype)} key.dtype: {_c_name(k.dtype)} and value.dtype: "
            f"{_c_name(v.dtype)} instead."
        )
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


def _c_name(dtype) -> str:
    """A dtype as torch's C++ messages name it (``float``, ``double``, ``c10::BFloat16``)."""
    return _C_NAMES.get(dtype, str(dtype).replace("torch.", ""))


_C_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16"}  # fmt: skip


def layout_of(t, mesh) -> ShardLayout:
    """A ShardTensor's layout; a plain tensor is read as replicated."""
    from shardlab.tensor import ShardTensor

    if isinstance(t, ShardTensor):
        if t.device_mesh != mesh:
            raise why("all ShardTensor arguments must be on the query's mesh")
        return t.sharding
    return ShardLayout.build(tuple(t.shape), tuple(mesh.shape), [Replicate()] * mesh.ndim)


def whole_where_query_is(t, lay, ql, seq):
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
    from shardlab.tensor.functions import Redistribute

    whole = moves.replicated(lay, cut)
    cause = "auto-redistribute for scaled_dot_product_attention"
    return Redistribute.apply(t, whole, cause), whole


def check_layouts(ql, kl, vl, nd) -> list[int]:
    """The mesh dims the ring runs along: one, two (the sequence cut by both: flattened
    image tokens of a 2-D mesh) or none (k/v hold the whole sequence)."""
    seq = nd - 2
    for name, lay in (("query", ql), ("key", kl), ("value", vl)):
        for m, p in enumerate(lay.placements):
            if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == nd - 1):
                raise why(
                    f"{name} is {p} on mesh dim {m}; redistribute it (Shard the "
                    "sequence or batch/heads, or Replicate)"
                )
    if kl.placements != vl.placements or kl.sizes != vl.sizes:
        raise why("key and value must be sharded alike (same placements and sizes)")
    on_seq = lambda lay: [m for m, p in enumerate(lay.placements) if p == Shard(seq)]  # noqa: E731
    q_seq, kv_seq = on_seq(ql), on_seq(kl)
    if kv_seq and q_seq != kv_seq:
        raise why(
            f"key/value are sharded along the sequence on mesh dims {kv_seq}, the query on "
            f"{q_seq}: shard the query's dim {seq} on the same mesh dims, or replicate k/v"
        )
    return kv_seq


def local_kv(t, lay, ql, mesh, coord, rep):
    """This rank's k or v: its own sequence block, cut to the batch/head rows of
    the local queries. Gradient: Partial on mesh dims where q is sharded and t is not."""
    local = attached_local(t, lay, ql, mesh)
    for d, start, length in everywhere(kv_cuts, lay, ql, t.ndim, rep, at=coord):
        local = local.narrow(d, start, length)
    return local


def attached_local(t, lay, ql, mesh):
    """``t``'s local block, its gradient Partial on the mesh dims that cut the query but
    not ``t`` (each rank contributes its queries' part); a plain tensor that requires grad
    is read as replicated, so its ``.grad`` is the full sum, as on one device."""
    from shardlab.tensor import ShardTensor, distribute

    if not isinstance(t, ShardTensor) and t.requires_grad:
        t = distribute(t, mesh, [Replicate()] * mesh.ndim)
    if not isinstance(t, ShardTensor):
        return t
    grads = [
        Partial() if isinstance(qp, Shard) and not isinstance(p, Shard) else p
        for p, qp in zip(lay.placements, ql.placements)
    ]
    return t.to_local(grad_placements=grads)


def whole_if_plain(query, key, value):
    """A plain query next to sharded keys/values (SigLIP's learned probe): the same on
    every rank, read as replicated (differentiably)."""
    from shardlab.tensor import ShardTensor, distribute

    if isinstance(query, ShardTensor):
        return query
    mesh = next(t.device_mesh for t in (key, value) if isinstance(t, ShardTensor))
    return distribute(query, mesh, [Replicate()] * mesh.ndim)


def everywhere(cuts, lay, *args, at):
    """``cuts(lay, *args, coord)`` checked at every mesh coordinate first, so that an
    argument error is raised on every rank (never on some, the others then waiting in
    the ring); returns its value at ``at``."""
    for c in lay.coords():
        cuts(lay, *args, c)
    return cuts(lay, *args, at)


def kv_cuts(lay, ql, ndim, rep, coord) -> list:
    """[(dim, start, length)]: k/v's block at ``coord`` narrowed to the batch/head rows its
    queries need (GQA: whole K/V heads)."""
    box, qbox, cuts = lay.local_box(coord), ql.local_box(coord), []
    for d in range(ndim - 2):  # batch/head dims
        a, b = qbox[d]
        if d == ndim - 3 and rep > 1:
            if a % rep or b % rep:
                raise why("with enable_gqa, each rank's query heads must cover whole K/V heads")
            a, b = a // rep, b // rep
        if not box[d][0] <= a <= b <= box[d][1]:
            raise why(
                f"k/v do not hold rows {a}:{b} of dim {d} that the queries of mesh coordinate "
                f"{tuple(coord)} need; shard batch/heads of q, k, v alike, or replicate k/v"
            )
        if (a, b) != box[d]:
            cuts.append((d, a - box[d][0], b - a))
    return cuts


def local_mask(mask, query, key, mesh, coord):
    """The mask's rows of my queries (its columns stay global: the ring cuts them per block).
    A mask that requires grad (a learned bias) stays attached: its gradient is Partial on
    the mesh dims that cut the query but not the mask (each rank has its query rows')."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise RuntimeError(f"attn_mask must be boolean or floating point, got {mask.dtype}")
    off = query.ndim - mask.ndim
    target = (*query.shape[:-1], key.shape[-2])  # (B, H_q, S_q, S_kv)
    if off < 0 or any(n not in (1, target[i + off]) for i, n in enumerate(mask.shape)):
        raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target}")
    mask = keys_whole(mask, query, mesh)
    lay = layout_of(mask, mesh)
    local = attached_local(mask, lay, query.sharding, mesh)
    for d, start, length in everywhere(mask_cuts, lay, query.sharding, off, at=coord):
        local = local.narrow(d, start, length)
    return local


def keys_whole(mask, query, mesh):
    """``mask`` laid out so that every rank holds all key columns of its query rows (the
    ring takes a block of columns per step). A mask cut along its key dim (a key-padding
    mask of cut keys: ``nn.MultiheadAttention``'s ``(B, 1, 1, S)``) moves, per mesh dim
    that cuts the keys: to the query's cut of its query rows where it has rows and the
    query is cut there (an all-to-all), else it is gathered (an all-gather: ``B x S``
    values for a key-padding mask). Labelled ``auto-redistribute for attn_mask``."""
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.functions import Redistribute

    if not isinstance(mask, ShardTensor) or mask.ndim == 0 or mask.device_mesh != mesh:
        return mask  # (layout_of says what is wrong with another mesh)
    lay, ql, key = mask.sharding, query.sharding, mask.ndim - 1
    cutting = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim == key]
    if not cutting or mask.shape[key] == 1:
        return mask
    places, sizes = list(lay.placements), list(lay.sizes)
    row, q_row = key - 1, query.ndim - 2  # the mask's and the query's query-row dims
    rows_free = row >= 0 and mask.shape[row] == query.shape[q_row] > 1 and not lay.cut_by(row)
    for m in cutting:
        qp = ql.placements[m]
        if (
            rows_free
            and isinstance(qp, Shard)
            and qp.dim == q_row
            and ql.nested_outer(m) is None
            and len(ql.cut_by(q_row)) == 1
            and lay.nested_outer(m) is None
        ):
            places[m], sizes[m] = Shard(row), ql.sizes[m]  # the query's rows
            rows_free = False
        else:
            places[m], sizes[m] = Replicate(), None
    dst = lay.replace(placements=tuple(places), sizes=tuple(sizes))
    return Redistribute.apply(mask, dst, "auto-redistribute for attn_mask")


def mask_cuts(lay, ql, off, coord) -> list:
    """[(dim, start, length)]: the mask's block at ``coord`` narrowed to its queries' rows
    (``off``: how many leading dims the query has more than the mask)."""
    box, qbox, cuts = lay.local_box(coord), ql.local_box(coord), []
    for i, n in enumerate(lay.global_shape):
        if n == 1:
            continue
        if i + off == len(ql.global_shape) - 1:  # key columns: every rank needs them all
            if box[i] != (0, n):
                raise why("attn_mask must not be sharded along its last (key) dim")
            continue
        (a, b), (c, e) = qbox[i + off], box[i]
        if not c <= a <= b <= e:
            raise why(
                "attn_mask must hold the rows of the local queries: shard it like the "
                "query (dim -2, same sizes) or pass the full mask on every rank"
            )
        if (a, b) != (c, e):
            cuts.append((i, a - c, b - a))
    return cuts
