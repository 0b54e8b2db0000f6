"""``take`` / ``put`` / ``put_``: flat indices into a cut tensor, each answered by its owner.

``torch.take(x, index)`` reads ``x`` as if flattened (row-major); ``x.put_(index, source,
accumulate)`` writes there. Each rank owns some of the flat positions (its block's), so
each answers the indices it owns and nothing else::

    x (3, 3) rows cut [1, 0, 2], index [8, 0, 4]  (flat 8 = (2, 2), 0 = (0, 0), 4 = (1, 1))
      rank 0 (row 0):    [0,    x00,  0  ]
      rank 1 (no row):   [0,    0,    0  ]     take = the sum of the three: Partial(sum)
      rank 2 (rows 1-2): [x22,  0,    x11]

1. ``index`` whole on every rank (a plain one is; a ShardTensor one is gathered: as
   many elements as the result, never ``x``'s), so every rank checks it alike and
   raises torch's ``IndexError`` for an index out of range, on every rank
2. each index unravelled to its position in ``x``'s global shape; per dim, the
   position in this rank's block of each global index (-1: not here; any layout: the
   layout's own list of the indices a block holds)
3. ``take``: the entries this rank owns read from its block, zeros elsewhere; the
   result shaped like ``index``, Partial(sum) on the mesh dims that cut ``x`` (and on
   those where ``x`` is Partial(sum): ``take`` is linear), Replicate on the others.
   ``put_`` / ``put``: ``source`` whole too (a Partial one summed), each rank writes (or,
   ``accumulate``, adds) the entries it owns into its block, in torch's order (a
   repeated index: the same last write as one device's); ``x`` keeps its layout

Messages: none for a plain index (and source); else the index (and source) made whole,
said as ``take.align`` / ``put.align``. ``take``'s backward is autograd's formula: a
``put_`` with ``accumulate`` into zeros laid out like ``x`` (this module; the gradient,
often Partial, summed first: as many elements as the index). A Partial ``x`` of
``put``: the next stage.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _whole(t, mesh):
    """The move that makes ``t`` whole on every rank (None: it is already)."""
    if not isinstance(t, c.ShardTensor):
        return None
    want = c.replicate_layout(tuple(t.shape), mesh)
    return None if t._layout == want else want


@register(aten.take.default)
def take(func, args, kwargs):
    x, index = args[0], args[1]
    if not isinstance(x, c.ShardTensor) or kwargs:
        return NotImplemented
    mesh = x.device_mesh
    lay = x._layout
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in lay.placements):
        lay = c.without_partial(lay)
    places = [
        Partial() if isinstance(p, Partial) or (isinstance(p, Shard) and mesh.shape[m] > 1)
        else Replicate()
        for m, p in enumerate(lay.placements)
    ]  # fmt: skip
    out = ShardLayout.build(tuple(index.shape), tuple(mesh.shape), places, None)
    moves = (None if lay == x._layout else lay, _whole(index, mesh))
    return Plan(mesh, out, moves, "take.align", local=_Owned(mesh, lay, "take"))


@register(aten.put_.default, aten.put.default)
def put(func, args, kwargs):
    x, index, source = args[0], args[1], args[2]
    if not isinstance(x, c.ShardTensor) or kwargs:
        return NotImplemented
    if any(isinstance(p, Partial) for p in x._layout.placements):
        return NotImplemented  # (a write into a Partial sum: not here)
    mesh = x.device_mesh
    moves = (None, _whole(index, mesh), _whole(source, mesh)) + (None,) * (len(args) - 3)
    inplace = func is aten.put_.default
    local = _Owned(mesh, x._layout, "put_" if inplace else "put")
    return Plan(mesh, x._layout, moves, "put.align", local=local, inplace=inplace)


class _Owned:
    """Steps 2-3 on this rank's blocks (the coordinate read when it runs: the plan is
    every rank's)."""

    __slots__ = ("kind", "layout", "mesh")

    def __init__(self, mesh, layout, kind):
        self.mesh, self.layout, self.kind = mesh, layout, kind

    def __call__(self, args, kwargs):
        block, index = args[0], args[1]
        shape = self.layout.global_shape
        numel = 1
        for n in shape:
            numel *= n
        flat = index.reshape(-1)
        bad = (flat >= numel) | (flat < -numel)
        if bad.any():  # 1. the same index on every rank: the same error everywhere
            i = int(flat[bad][0])
            raise IndexError(f"out of range: tried to access index {i} on a tensor of "
                             f"{numel} elements.")  # fmt: skip
        flat = torch.where(flat < 0, flat + numel, flat)
        coord = c.me(self.mesh)
        pos, own = [], torch.ones_like(flat, dtype=torch.bool)
        for d in reversed(range(len(shape))):  # 2. unravelled, row-major
            at = flat % shape[d]
            flat = flat // shape[d]
            table = torch.full((shape[d],), -1, dtype=torch.int64, device=index.device)
            held = torch.as_tensor(self.layout.dim_indices(d, coord), device=index.device)
            table[held] = torch.arange(len(held), device=index.device)
            p = table[at]
            own &= p >= 0
            pos.insert(0, p.clamp(min=0))
        if self.kind == "take":  # 3. what this rank owns, zeros elsewhere
            out = torch.zeros(index.shape, dtype=block.dtype, device=block.device)
            if block.numel():
                out.view(-1)[own] = block[tuple(q[own] for q in pos)]
            return out
        target = block if self.kind == "put_" else block.clone()
        accumulate = bool(args[3]) if len(args) > 3 else False
        if block.numel() and own.any():
            values = args[2].reshape(-1)[own]
            target.index_put_(tuple(q[own] for q in pos), values, accumulate=accumulate)
        return target


def _storage_to_flat(x, idx: torch.Tensor):
    """Storage positions ``idx`` of ``x`` (its global strides, offset 0, as one device's
    dense tensor) as row-major flat positions; None unless those strides are dense (a
    permutation of a contiguous tensor's: each position one element)."""
    dims = [d for d in range(x.ndim) if x.shape[d] != 1]
    order = sorted(dims, key=lambda d: -x.stride(d))
    step = 1
    for d in reversed(order):
        if x.stride(d) != step:
            return None
        step *= x.shape[d]
    flat = torch.zeros_like(idx)
    for d in range(x.ndim):  # row-major: flat = sum coord[d] * prod(shape[d+1:])
        coord = (idx // x.stride(d)) % x.shape[d] if d in dims else torch.zeros_like(idx)
        flat = flat * x.shape[d] + coord
    return flat


@register(aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default)
def as_strided(func, args, kwargs):
    """``as_strided`` (and ``_copy``) as :func:`take` of the storage positions the view
    reads, ``as_strided_scatter`` as :func:`put` of ``src`` there: each rank its own
    positions, no message (the result Partial(sum), as ``take``'s). A write into the view
    goes back to ``x``: the view summed (ONE all-reduce of its size), each rank writes the
    positions it owns. Positions read from the
    global shape and strides (the ShardTensor's, as one device's dense tensor: offset 0),
    alike on every rank; strides no dense tensor has, or positions past the end (torch's
    error, from the fallback): ``NotImplemented``."""
    scatter = func is aten.as_strided_scatter.default
    kw = c.schema_args(func, args, kwargs)
    x = kw["self"]
    size, stride = list(kw["size"]), list(kw["stride"])
    offset = kw.get("storage_offset")
    if type(x) is not c.ShardTensor or x.dtype == torch.bool or x.numel() == 0:
        return NotImplemented
    if x._layout.is_whole():  # (a view of the block, as one device's: not here)
        return NotImplemented
    if len(size) != len(stride) or any(s < 0 for s in stride):
        return NotImplemented
    idx = torch.full(size, int(offset or 0), dtype=torch.int64, device=x.device)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (torch.arange(n, device=x.device) * s).reshape(shape)
    if idx.numel() and int(idx.max()) >= x.numel():
        return NotImplemented
    flat = _storage_to_flat(x, idx)
    if flat is None:
        return NotImplemented
    if scatter:
        src = kw["src"]
        if tuple(src.shape) != tuple(size) or flat.unique().numel() != flat.numel():
            return NotImplemented  # (a position written twice: torch's error, every rank)
        return torch.put(x, flat, src)
    y = torch.take(x, flat)
    if func is aten.as_strided.default:  # a view: what is written into it goes back to x
        block, layout, mesh = x._local_tensor, x._layout, x.device_mesh

        def writeback():
            whole = c.replicated(y, "as_strided.write back")._local_tensor
            _Owned(mesh, layout, "put_")((block, flat, whole), {})
            c.written(x)

        c.with_writeback(y, writeback)
    return y
