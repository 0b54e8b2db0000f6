"""Results whose size depends on the values: ``nonzero`` (``argwhere``), ``masked_select``
and ``x[mask]``.

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
``x``, a slice when it is whole). Any other layout: the next stage (a gather, said).
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


def _cut_result(local, x, m, name):
    """``local`` (this rank's hits, in order) as the rows of the global result: the
    sizes from one all-gather of the counts (step 2), cut on mesh dim ``m`` (step 3)."""
    mesh = x.device_mesh
    count = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    counts = [torch.empty_like(count) for _ in range(mesh.shape[m])]
    with label(f"{name}.counts"):
        collectives.all_gather(counts, count, mesh.get_group(m))
    sizes = [int(n) for n in torch.cat(counts).tolist()]
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


@register(aten.masked_select.default)
def _masked_select(func, args, kwargs):
    x, mask = args[0], args[1]
    if not isinstance(x, c.ShardTensor) or kwargs or tuple(mask.shape) != tuple(x.shape):
        return NotImplemented  # (a mask that broadcasts x: not here)
    m = _rows_cut(x._layout, x.device_mesh) if x.ndim else None
    if m is None:
        return NotImplemented
    mesh = x.device_mesh
    want = restrict(x._layout, tuple(mask.shape), [False] * mesh.ndim)
    if isinstance(mask, c.ShardTensor):
        mask = c.move(mask, want, "masked_select.align")
    else:
        mask = c.move(c.as_shard(mask, mesh), want, "masked_select.align")
    local = func(x._local_tensor, mask._local_tensor)  # 1. this block's hits, in order
    return _cut_result(local, x, m, "masked_select")


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
