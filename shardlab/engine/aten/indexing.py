"""Ops that read or write rows by index: embedding (and its backward), ``x[index]``,
``index_put``, ``gather``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.aten import selection
from shardlab.engine.aten.scatter import index_picks, index_writes, picks
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout, moves
from shardlab.layout.elementwise import restrict
from shardlab.layout.views import select_dims_layout

aten = torch.ops.aten


@register(aten.embedding.default)
def _embedding(func, args, kwargs):
    """The plan: the weight's Partial summed, the indices whole where the embedding dim
    is cut (tensor parallel), then each rank's lookup in its block."""
    weight, indices = args[0], args[1]
    st = c.ShardTensor
    mesh = c.the_mesh(c.shards_in((weight, indices)))
    lay = weight._layout if isinstance(weight, st) else c.replicate_layout(weight.shape, mesh)
    wl = c.without_partial(lay)
    if any(isinstance(p, Shard) and p.dim == 0 for p in wl.placements):
        return NotImplemented  # vocab-parallel rows: decomposition / fallback
    il = indices._layout if isinstance(indices, st) else c.replicate_layout(indices.shape, mesh)
    places, entry = [], []
    for m, (p, q) in enumerate(zip(il.placements, wl.placements)):
        if isinstance(q, Shard):  # embedding dim cut (tensor parallel): indices whole
            places.append(Shard(indices.ndim))
            entry.append(wl.sizes[m])
        else:
            places.append(p)
            entry.append(il.sizes[m])
    moved = None
    if any(isinstance(q, Shard) for q in wl.placements) and any(
        isinstance(p, Shard) for p in il.placements
    ):
        il = moved = c.replicate_layout(indices.shape, mesh)
        places = [
            Shard(indices.ndim) if isinstance(q, Shard) else Replicate() for q in wl.placements
        ]
        entry = [wl.sizes[m] if isinstance(q, Shard) else None for m, q in enumerate(wl.placements)]
    atoms = None if il.atoms is None else il.atoms + (None,)
    out = ShardLayout(
        tuple(indices.shape) + (weight.shape[1],),
        il.mesh_shape,
        tuple(places),
        tuple(entry),
        atoms,
        il.cuts,
    )
    moves = [((wl, "embedding.partial"),) if wl != lay else None]
    moves += [((moved, "embedding.align"),) if moved is not None else None]
    moves += [None] * (len(args) - 2 + len(kwargs))
    return Plan(mesh, out, moves)


@register(aten.embedding_dense_backward.default)
def _embedding_backward(func, args, kwargs):
    """Rows of the weight gradient summed over this rank's tokens: Partial(sum) over the
    mesh dims that cut the tokens (one all-reduce when read)."""
    grad, indices, num_weights, padding_idx, scale_by_freq = args[:5]
    if scale_by_freq:
        return NotImplemented
    mesh = c.the_mesh(c.shards_in((grad, indices)))
    st = c.ShardTensor
    gl = grad._layout if isinstance(grad, st) else c.replicate_layout(grad.shape, mesh)
    part = c.without_partial(gl)
    lead = list(range(indices.ndim))
    if any(isinstance(p, Shard) and p.dim == indices.ndim for p in part.placements):
        return NotImplemented
    tokens = select_dims_layout(part, lead)  # the (B, S) of grad's (B, S, D)
    il = indices._layout if isinstance(indices, st) else c.replicate_layout(indices.shape, mesh)
    places = [
        Partial() if isinstance(p, Shard) and p.dim in lead else Replicate()
        for p in part.placements
    ]
    shape = (num_weights, grad.shape[-1])
    out = ShardLayout(shape, part.mesh_shape, tuple(places), (None,) * mesh.ndim)
    moves = [((part, "embedding_backward.partial"),) if part != gl else None]
    moves += [((tokens, "embedding_backward.align"),) if tokens != il else None]
    moves += [None] * (len(args) - 2 + len(kwargs))
    return Plan(mesh, out, moves)  # each rank's rows of the gradient: a Partial sum


@register(aten.index.Tensor)
def _index(func, args, kwargs):
    """``x[idx]`` with whole (replicated) integer index tensors on dims no mesh dim cuts:
    every rank indexes its block; other cases go to the fallback."""
    x, indices = args[0], list(args[1])
    st = c.ShardTensor
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        if len(indices) == 1 and indices[0].dtype == torch.bool:  # x[mask]: uneven rows
            return selection.bool_index(x, indices[0])
        return NotImplemented
    picked = index_picks(func, args, kwargs)  # along the cut dim: each rank its own
    if picked is not NotImplemented:
        return picked
    if any(
        isinstance(i, st) and any(not isinstance(p, Replicate) for p in i._layout.placements)
        for i in indices
    ):
        return NotImplemented
    x = c.reduced(x, "index.partial")
    dims = [d for d, i in enumerate(indices) if i is not None]
    cut = [m for m, p in enumerate(x._layout.placements) if isinstance(p, Shard) and p.dim in dims]
    flat = _flat_positions(x, indices) if cut else None
    if flat is not None:  # every dim picked: each rank its own entries, a Partial sum
        return torch.take(x, flat)
    if cut:
        x = c.move(x, moves.replicated(x._layout, cut), "auto-redistribute for index")
    loc = [None if i is None else c.local(i) for i in indices]
    y = func(x._local_tensor, loc)
    _, where, _ = _index_dims(x, indices)  # result dims of x's other dims
    gshape = list(y.shape)
    for d, e in where.items():
        gshape[e] = x.shape[d]
    return c.wrap(y, x.device_mesh, _relabel(x._layout, where, gshape))


def _index_dims(x, indices):
    """(indexed dims, the dims of ``x[indices]`` that the other dims of x land on), as
    torch places them: the index shape replaces the indexed dims, in place when adjacent,
    else in front."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    ishape = torch.broadcast_shapes(*[tuple(i.shape) for i in indices if i is not None])
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    front = dims[0] if adjacent else 0
    rest = [d for d in range(x.ndim) if d not in dims]
    where = {
        d: ((d if d < front else d - len(dims) + len(ishape)) if adjacent
            else len(ishape) + rest.index(d))
        for d in rest
    }  # fmt: skip
    return dims, where, len(ishape)


def _relabel(lay: ShardLayout, where: dict, shape) -> ShardLayout | None:
    """``lay`` with each sharded dim d moved to dim ``where[d]`` of a tensor of global
    ``shape`` (the same pieces: no data moves); None if a sharded dim has no place."""
    places, atoms = [], [None] * len(shape)
    for p in lay.placements:
        if isinstance(p, Shard):
            if p.dim not in where:
                return None
            places.append(Shard(where[p.dim]))
            atoms[where[p.dim]] = lay.dim_atoms(p.dim)
        else:
            places.append(p)
    if all(a is None or len(a) == 1 for a in atoms):
        return ShardLayout(tuple(shape), lay.mesh_shape, tuple(places), lay.sizes)
    cuts = tuple(lay.cut_of(m) for m in range(len(places)))
    atoms = tuple(None if a is None or len(a) == 1 else a for a in atoms)
    return ShardLayout(tuple(shape), lay.mesh_shape, tuple(places), lay.sizes, atoms, cuts)


def _flat_positions(x, indices):
    """``x[i_0, .., i_{n-1}]`` with a whole integer tensor for every dim of ``x``: the
    flat (row-major) positions it reads, broadcast, for :func:`.take.take` / ``put``
    (each rank answers the positions it owns); None otherwise, or for an index out of
    range (torch's error, from the fallback)."""
    if len(indices) != x.ndim or x.ndim == 0 or x.numel() == 0:
        return None
    if any(i is None or i.dtype not in (torch.int64, torch.int32) for i in indices):
        return None
    if any(isinstance(i, c.ShardTensor) and not i._layout.is_whole() for i in indices):
        return None
    idx = torch.broadcast_tensors(*[c.local(i).long() for i in indices])
    flat = torch.zeros_like(idx[0])
    for i, n in zip(idx, x.shape):
        if i.numel() and (int(i.max()) >= n or int(i.min()) < -n):
            return None
        flat = flat * n + torch.where(i < 0, i + n, i)
    return flat


@register(aten.index_put.default)
def _index_put(func, args, kwargs):
    """``x.index_put(indices, values, accumulate)`` (``x[idx]``'s gradient is one) with
    whole integer index tensors, values cut like ``x[indices]`` would be: x cut the same way,
    or x replicated (then cut like them, no message); every rank writes its block. Other
    cases go to the fallback."""
    written = index_writes(func, args, kwargs)  # along the cut dim, values whole
    if written is not NotImplemented:
        return written
    x, indices, values = args[0], list(args[1]), args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    st = c.ShardTensor
    flat = _flat_positions(x, indices) if isinstance(x, st) else None
    if flat is not None and (not isinstance(values, st) or values._layout.is_whole()):
        if accumulate or flat.unique().numel() == flat.numel():  # every dim picked: each
            vals = c.local(values).expand(flat.shape).reshape(-1)  # rank writes its own
            return torch.put(x, flat.reshape(-1), vals, accumulate=bool(accumulate))
    if (
        not isinstance(x, st)
        or not isinstance(values, st)
        or not any(i is not None for i in indices)
    ):
        return NotImplemented
    for i in indices:
        if i is None:
            continue
        if i.dtype in (torch.bool, torch.uint8) or (
            isinstance(i, st) and any(not isinstance(p, Replicate) for p in i._layout.placements)
        ):
            return NotImplemented
    if any(isinstance(p, Partial) for p in x._layout.placements + values._layout.placements):
        return NotImplemented
    dims, where, n_index = _index_dims(x, indices)
    if values.ndim != x.ndim - len(dims) + n_index:
        return NotImplemented  # values broadcast: the fallback
    back = {e: d for d, e in where.items()}  # a dim of values -> the dim of x it fills
    target = _relabel(values._layout, back, tuple(x.shape))
    if target is None or any(values.shape[e] != x.shape[d] for e, d in back.items()):
        return NotImplemented  # a cut dim of values torch broadcasts: the fallback
    if x._layout != target:
        if any(not isinstance(p, Replicate) for p in x._layout.placements):
            return NotImplemented
        x = c.move(x, target, "index_put.cut")  # whole -> pieces: local slicing
    loc = [None if i is None else c.local(i) for i in indices]
    y = func(x._local_tensor, loc, values._local_tensor, accumulate)
    return c.wrap(y, x.device_mesh, target)


@register(aten.gather.default)
def _gather(func, args, kwargs):
    """``gather(x, dim, index)``: dim whole in x, index cut like x elsewhere -> local;
    x cut along dim, the index whole: each rank its own picks (:func:`.scatter.picks`)."""
    picked = picks(func, args, kwargs)
    if picked is not NotImplemented:
        return picked
    x, dim, index = args[0], args[1], args[2]
    st = c.ShardTensor
    mesh = c.the_mesh(c.shards_in((x, index)))
    x = c.reduced(x if isinstance(x, st) else c.as_shard(x, mesh), "gather.partial")
    index = index if isinstance(index, st) else c.as_shard(index, mesh)
    dim %= x.ndim
    lay = x._layout
    bad = [
        m
        for m, p in enumerate(lay.placements)
        if isinstance(p, Shard) and (p.dim == dim or index.shape[p.dim] != x.shape[p.dim])
    ]
    if bad:
        x = c.move(x, moves.replicated(lay, bad), "auto-redistribute for gather")
        lay = x._layout
    target = restrict(lay, index.shape, [False] * mesh.ndim)
    index = c.move(index, target, "gather.align")
    y = func(x._local_tensor, dim, index._local_tensor, *args[3:], **kwargs)
    return c.wrap(y, mesh, target)
