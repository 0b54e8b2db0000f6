"""Results whose size depends on the values: ``nonzero`` (``argwhere``), ``masked_select``
and ``x[mask]``; and ``masked_scatter``, which reads as many values as there are hits.

Their natural result is a tensor cut in uneven pieces, which is what a ShardTensor is for.
With the rows (dim 0) cut in blocks by one mesh dim, row-major order is rank order, so
each rank's own hits, in order, are its piece of the result::

    x (6, 3) rows cut [2, 4]:    rank 0: rows 0-1 -> 1 hit     rank 1: rows 2-5 -> 4 hits
    nonzero(x) (5, 2):           rank 0 holds row 0 of it      rank 1 holds rows 1-4
                                 Shard(0) sizes [1, 4]

1. the op on this rank's block (``masked_select``, ``x[mask]``: the mask first laid out
   like ``x``'s leading dims);
   ``nonzero``'s row indices moved from the block's to the tensor's (+ the block's start)
2. one all-gather of one number per rank: how many each found (the result's sizes)
3. the result: cut along its dim 0 in those sizes on that mesh dim, Replicate elsewhere

Messages: one all-gather of an int64 per rank (and ``masked_select``'s mask aligned to
``x``, a slice when it is whole; a mask that broadcasts, its part of ``x``'s layout). A
tensor of two or more dims cut along another dim by one mesh dim: that cut first moves
to the rows, one all-to-all (``masked_select.align``). Any other layout: the next stage
(a gather, said).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.layout.elementwise import restrict
from shardlab.layout.views import select_dims_layout
from shardlab.trace import label

aten = torch.ops.aten


def _rows_cut(layout, mesh):
    """The one mesh dim of more than one rank that cuts dim 0 in blocks, when nothing
    else is cut (nor Partial); else None."""
    cut = None
    for m, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            return None
        if isinstance(p, Shard) and mesh.shape[m] > 1:
            if p.dim != 0 or cut is not None:
                return None
            cut = m
    if cut is None or not layout.is_block(0):
        return None
    return cut


def _counts(n: int, mesh, m: int, name: str, device) -> list[int]:
    """Every rank's ``n`` along mesh dim ``m``, in rank order: one all-gather of one int64
    (``<name>.counts``)."""
    count = torch.tensor([n], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(mesh.shape[m])]
    with label(f"{name}.counts"):
        collectives.all_gather(counts, count, mesh.get_group(m))
    return [int(k) for k in torch.cat(counts).tolist()]


def _cut_result(local, x, m, name):
    """``local`` (this rank's hits, in order) as the rows of the global result: the
    sizes from one all-gather of the counts (step 2), cut on mesh dim ``m`` (step 3)."""
    mesh = x.device_mesh
    sizes = _counts(local.shape[0], mesh, m, name, local.device)
    shape = (sum(sizes), *local.shape[1:])
    places = [Shard(0) if k == m else Replicate() for k in range(mesh.ndim)]
    layout = ShardLayout.build(shape, tuple(mesh.shape), places,
                               [sizes if k == m else None for k in range(mesh.ndim)])  # fmt: skip
    return c.wrap(local, mesh, layout)


@register(aten.nonzero.default)
def _nonzero(func, args, kwargs):
    x = args[0]
    m = _rows_cut(x._layout, x.device_mesh) if x.ndim else None
    if m is None or kwargs:
        return NotImplemented
    local = func(x._local_tensor)  # 1. (hits, ndim), row indices of the block
    start = x._layout._piece(0, c.me(x.device_mesh))[0]
    if start:
        local[:, 0] += start
    return _cut_result(local, x, m, "nonzero")


def _rows_of(x, name):
    """``x`` cut along its rows in blocks, and the mesh dim that cuts them: as it is, or
    (one mesh dim of more than one rank cutting another dim) that cut moved to the rows
    in chunks, one all-to-all said as ``<name>.align``; (None, None) for anything else."""
    lay, mesh = x._layout, x.device_mesh
    m = _rows_cut(lay, mesh) if x.ndim else None
    if m is not None:
        return x, m
    big = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard) and mesh.shape[k] > 1]
    if x.ndim < 2 or len(big) != 1 or any(isinstance(p, Partial) for p in lay.placements):
        return None, None
    m = big[0]
    places = [Shard(0) if k == m else Replicate() for k in range(mesh.ndim)]
    rows = ShardLayout.build(tuple(x.shape), tuple(mesh.shape), places, None)
    return c.move(x, rows, f"{name}.align"), m


def _mask_like(mask, x, name):
    """``mask`` (its shape broadcasting to ``x``'s) laid out as its part of ``x``'s layout."""
    mesh = x.device_mesh
    want = restrict(x._layout, tuple(mask.shape), [False] * mesh.ndim)
    mask = mask if isinstance(mask, c.ShardTensor) else c.as_shard(mask, mesh)
    return c.move(mask, want, f"{name}.align")


@register(aten.masked_select.default)
def _masked_select(func, args, kwargs):
    x, mask = args[0], args[1]
    if not isinstance(x, c.ShardTensor) or kwargs:
        return NotImplemented
    if c.broadcast_shapes([tuple(x.shape), tuple(mask.shape)]) != tuple(x.shape):
        return NotImplemented  # (x broadcast to the mask's shape: not here)
    x, m = _rows_of(x, "masked_select")
    if m is None:
        return NotImplemented
    mask = _mask_like(mask, x, "masked_select")
    local = func(x._local_tensor, mask._local_tensor)  # 1. this block's hits, in order
    return _cut_result(local, x, m, "masked_select")


@register(aten.masked_scatter.default, aten.masked_scatter_.default)
def _masked_scatter(func, args, kwargs):
    """``x.masked_scatter(mask, source)``: the hits take ``source``'s elements in row-major
    order, so with the rows cut in blocks rank r's hits take the ``n_r`` elements after
    those of the ranks before it: one all-gather of the counts (step 2), then this rank's
    hits filled from its slice of ``source`` (whole on every rank: a plain one is, a
    ShardTensor one is made so, said). ``x`` cut along another dim: its cut moved to the
    rows and back (an all-to-all each way); the result in ``x``'s layout."""
    x, mask, source = args[0], args[1], args[2]
    if not isinstance(x, c.ShardTensor) or kwargs or mask.dtype != torch.bool:
        return NotImplemented
    if c.broadcast_shapes([tuple(x.shape), tuple(mask.shape)]) != tuple(x.shape):
        return NotImplemented
    rows, m = _rows_of(x, "masked_scatter")
    if m is None:
        return NotImplemented
    mesh = x.device_mesh
    mask = _mask_like(mask, rows, "masked_scatter")
    hits = mask._local_tensor.expand(rows._local_tensor.shape)
    counts = _counts(int(hits.sum()), mesh, m, "masked_scatter", hits.device)
    count, start = counts[c.me(mesh)[m]], sum(counts[: c.me(mesh)[m]])
    if sum(counts) > source.numel():  # (every rank: the same counts)
        raise RuntimeError("Number of elements of source < number of ones in mask")
    if isinstance(source, c.ShardTensor):
        source = c.replicated(source, "masked_scatter.align")._local_tensor
    piece = source.reshape(-1)[start : start + int(count)]
    inplace = func is aten.masked_scatter_.default
    block = rows._local_tensor if inplace and rows is x else rows._local_tensor.clone()
    block.masked_scatter_(hits, piece)
    out = c.wrap(block, mesh, rows._layout)
    if rows is not x:  # (back to x's own cut)
        out = c.move(out, x._layout, "masked_scatter.align")
    if inplace and out is not x:
        x._local_tensor.copy_(out._local_tensor)
        return x
    return x if inplace else out


@register(aten.masked_scatter_backward.default)
def _masked_scatter_backward(func, args, kwargs):
    """The gradient of ``masked_scatter``'s ``source`` (shape ``sizes``): the hits of
    ``grad`` in row-major order, then zeros. Rank r's hits are elements ``[start_r,
    start_r + n_r)`` of it (one all-gather of the counts), so each rank writes its own
    into zeros and the result is Partial(sum) on the mesh dim cutting the rows (summed
    where it is read: as many elements as ``source``)."""
    grad, mask, sizes = args[0], args[1], list(args[2])
    if not isinstance(grad, c.ShardTensor) or kwargs:
        return NotImplemented
    rows, m = _rows_of(grad, "masked_scatter_backward")
    if m is None:
        return NotImplemented
    mesh = grad.device_mesh
    mask = _mask_like(mask, rows, "masked_scatter_backward")
    hits = rows._local_tensor[mask._local_tensor.expand(rows._local_tensor.shape)]
    counts = _counts(hits.numel(), mesh, m, "masked_scatter_backward", hits.device)
    start = sum(counts[: c.me(mesh)[m]])
    numel = 1
    for n in sizes:
        numel *= n
    out = torch.zeros(numel, dtype=hits.dtype, device=hits.device)
    out[start : start + hits.numel()] = hits[: max(0, numel - start)]
    places = [Partial() if k == m else Replicate() for k in range(mesh.ndim)]
    layout = ShardLayout.build(tuple(sizes), tuple(mesh.shape), places, None)
    return c.wrap(out.view(sizes), mesh, layout)


def bool_index(x, mask):
    """``x[mask]``, ``mask`` a bool tensor of ``x``'s leading dims: this rank's rows of the
    result (the index rule's case of a mask, :mod:`.indexing`); NotImplemented else."""
    k = mask.ndim
    if not isinstance(x, c.ShardTensor) or tuple(mask.shape) != tuple(x.shape[:k]) or not k:
        return NotImplemented
    m = _rows_cut(x._layout, x.device_mesh)
    if m is None:
        return NotImplemented
    mesh = x.device_mesh
    want = select_dims_layout(x._layout, list(range(k)))
    if not isinstance(mask, c.ShardTensor):
        mask = c.as_shard(mask, mesh)
    mask = c.move(mask, want, "index.align")
    local = x._local_tensor[mask._local_tensor]  # 1. (hits, *x.shape[k:])
    return _cut_result(local, x, m, "index")
