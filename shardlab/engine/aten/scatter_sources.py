"""Scatter and index writes from cut sources into a whole target: a Partial result.

The entries to write (an ``index_add``'s index and source rows, a ``scatter_add``'s index
and src) cut across the ranks, the target whole on every rank: each rank writes its own
entries into its copy, and the copies combine, a ``Partial`` result::

    target (5, 3) whole, index (7,) and source (7, 3) cut [4, 3] (edges of a graph):
      rank 0: target.index_add(0, index[0:4], source[0:4])  -> Partial(sum) piece
      rank 1: zeros  .index_add(0, index[4:7], source[4:7])  -> Partial(sum) piece

1. the target counted once: itself on the first rank of the mesh dim, zeros (the
   reduction's identity) on the others (``amax``/``amin``: itself everywhere)
2. torch's op on this rank's entries
3. the result ``Partial(sum)`` (``max``, ``min``) on the mesh dim that cuts the entries

Messages: none (one all-reduce of the target's size when it is needed whole: the lower
bound of a whole result written from everywhere). Taken: ``index_add``, ``scatter_add``,
``scatter_reduce`` (``sum``, ``amax``, ``amin``, with ``include_self``), out of place, the
index and source cut alike along the entries by one mesh dim (nothing else cut). Others:
the next stage.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten

_REDUCE = {"sum": "sum", "amax": "max", "amin": "min"}


def from_cut_sources(func, args, kwargs):
    """The plan of an out-of-place write from cut entries into a whole target, or
    NotImplemented."""
    packet = func.overloadpacket
    x, dim = args[0], args[1]
    if packet is aten.index_add:
        entries = (args[2], args[3])  # index (n,), source (.., n, ..) along dim
        along = (0, dim % max(args[3].ndim, 1))
        op = "sum"
    elif packet is aten.scatter_add:
        entries, op = (args[2], args[3]), "sum"
        along = (dim % max(x.ndim, 1),) * 2  # (cut along another dim, an entry's place
        # along it is its place in the block: not here)
    elif packet is aten.scatter_reduce and func is aten.scatter_reduce.two:
        op = args[4] if len(args) > 4 else kwargs.get("reduce")
        include_self = args[5] if len(args) > 5 else kwargs.get("include_self", True)
        if op not in _REDUCE or not include_self:  # (a row one rank does not write
            # would hold the target there, and combine with the others' values)
            return NotImplemented
        entries, along = (args[2], args[3]), (dim % max(x.ndim, 1),) * 2
    else:
        return NotImplemented
    if "out" in kwargs or not _not_cut(x) or not all(isinstance(e, c.ShardTensor) for e in entries):
        return NotImplemented
    mesh = entries[0].device_mesh
    cut = _entry_cut(entries, along)
    if cut is None:
        return NotImplemented
    m = cut
    reduce_op = _REDUCE[op]
    places = [Partial(reduce_op) if k == m else Replicate() for k in range(mesh.ndim)]
    out = ShardLayout.build(tuple(x.shape), tuple(mesh.shape), places)
    first = c.me(mesh)[m] == 0
    moves = None
    if isinstance(x, c.ShardTensor) and x._layout != c.without_partial(x._layout):
        moves = [c.without_partial(x._layout)] + [None] * (len(args) + len(kwargs) - 1)
    local = _Counted(func, first or reduce_op != "sum")
    return Plan(mesh, out, moves, f"{c.op_name(func)}.partial", local)


def _not_cut(t) -> bool:
    """A plain tensor, or a ShardTensor no mesh dim cuts (Replicate or Partial)."""
    if not isinstance(t, c.ShardTensor):
        return isinstance(t, torch.Tensor)
    return all(not isinstance(p, Shard) for p in t._layout.placements)


def _entry_cut(entries, along):
    """The one mesh dim (more than one rank) cutting the entries alike, in blocks, along
    the dims ``along`` (an index op: the index's dim 0 and the source's ``dim``; a
    scatter: the index's and the src's ``dim``, the one their values address) in the
    same pieces. Else None."""
    layouts = [e._layout for e in entries]
    if any(isinstance(p, Partial) for lay in layouts for p in lay.placements):
        return None
    mesh = entries[0].device_mesh
    cut = None
    for m in range(mesh.ndim):
        places = [lay.placements[m] for lay in layouts]
        if all(isinstance(p, Replicate) for p in places) or mesh.shape[m] == 1:
            continue
        if cut is not None or not all(isinstance(p, Shard) for p in places):
            return None
        dims = [p.dim for p in places]
        if tuple(dims) != along:
            return None
        pieces = [lay.sizes_along(d) for lay, d in zip(layouts, dims, strict=True)]
        if pieces[0] != pieces[1] or not all(
            lay.is_block(d) for lay, d in zip(layouts, dims, strict=True)
        ):
            return None
        cut = m
    return cut


class _Counted:
    """Steps 1-3: the op on this rank's entries, into the target (``first``) or into the
    reduction's identity (zeros: only a sum asks for it)."""

    __slots__ = ("func", "first")

    def __init__(self, func, first):
        self.func, self.first = func, first

    def __call__(self, args, kwargs):
        x = args[0] if self.first else torch.zeros_like(args[0])
        return self.func(x, *args[1:], **kwargs)


def by_cut_index(func, args, kwargs):
    """``x[index]`` / ``index_select`` of a whole ``x`` by a cut index: each rank picks its
    own entries, the result cut like the index (no message; a gradient's
    ``index_select`` by the entries of an ``index_add``). NotImplemented otherwise."""
    x = args[0]
    if func is aten.index_select.default:
        dim, index = args[1] % max(x.ndim, 1), args[2]
    elif func is aten.index.Tensor:
        given = [(d, i) for d, i in enumerate(args[1]) if i is not None]
        if len(given) != 1:
            return NotImplemented
        dim, index = given[0]
    else:
        return NotImplemented
    if not isinstance(index, c.ShardTensor) or index.dtype in (torch.bool, torch.uint8):
        return NotImplemented
    lay = index._layout
    if lay.atoms is not None or any(isinstance(p, Partial) for p in lay.placements):
        return NotImplemented
    if not all(isinstance(p, Shard) or isinstance(p, Replicate) for p in lay.placements):
        return NotImplemented
    if not _not_cut(x) or (
        isinstance(x, c.ShardTensor) and x._layout != c.without_partial(x._layout)
    ):
        return NotImplemented
    shape = (*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])
    places = [Shard(p.dim + dim) if isinstance(p, Shard) else p for p in lay.placements]
    sizes = [lay.sizes_arg(m) for m in range(len(places))]
    out = ShardLayout.build(shape, lay.mesh_shape, places, sizes)
    local = _IndexBlocks() if func is aten.index.Tensor else None
    return Plan(index.device_mesh, out, None, c.op_name(func), local)


class _IndexBlocks:
    """``x[index]`` on the blocks: the index list's ShardTensors as their blocks (a list
    reaches the local call as it is)."""

    __slots__ = ()

    def __call__(self, args, kwargs):
        return aten.index.Tensor(args[0], [None if i is None else c.local(i) for i in args[1]])
