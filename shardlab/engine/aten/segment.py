"""``segment_reduce`` of data cut along its segments' dim: each rank reduces its part of
each segment.

``segment_reduce(data, reduce, lengths=...)``: the rows of ``data`` (axis 0) in
consecutive segments, one result per segment::

    data (5,) cut [2, 0, 3], lengths [0, 1, 2, 2]    segments [], [0], [1, 2], [3, 4]
      rank 0 (rows 0-1): its lengths [0, 1, 1, 0]     rank 2 (rows 2-4): [0, 0, 1, 2]

1. each rank: its overlap with each segment, from the whole ``lengths`` (or ``offsets``),
   no message;
2. torch's ``segment_reduce`` of its block with those lengths: ``max`` / ``min`` (with
   ``initial`` on every rank) give Partial(max / min); ``sum`` (``initial`` on one rank)
   and ``mean`` (each part divided by the segment's whole length, ``initial`` once) give
   Partial(sum). No message; the sum when the result is read.

``data`` cut along other dims: each rank its block, the result cut alike. ``prod``, a cut
``lengths``, ``axis`` other than 0, 2-D ``lengths``: ``NotImplemented``. The backward is
autograd's (``_segment_reduce_backward``, the fallback).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout

aten = torch.ops.aten


@register(aten.segment_reduce.default)
def segment_reduce(func, args, kwargs):
    data, reduce = args[0], args[1]
    kw = dict(kwargs)
    lengths, offsets = kw.get("lengths"), kw.get("offsets")
    if len(args) > 2 or kw.get("indices") is not None or kw.get("axis", 0) != 0:
        return NotImplemented
    if reduce not in ("max", "min", "sum", "mean") or type(data) is not c.ShardTensor:
        return NotImplemented
    given = lengths if lengths is not None else offsets
    if given is None or given.ndim != 1 or (type(given) is c.ShardTensor
                                             and not given._layout.is_whole()):  # fmt: skip
        return NotImplemented
    lay, mesh = data._layout, data.device_mesh
    if not lay.is_block() or any(isinstance(p, Partial) for p in lay.placements):
        return NotImplemented
    whole = c.local(given).long()
    lengths = whole if lengths is not None else whole.diff()
    ends = lengths.cumsum(0)
    starts = ends - lengths
    coord = c.me(mesh)
    lo, hi = lay.local_box(coord)[0]
    mine = torch.minimum(ends, torch.tensor(hi)) - torch.maximum(starts, torch.tensor(lo))
    mine = mine.clamp_min(0)  # 1.
    cut0 = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim == 0
            and lay.mesh_shape[k] > 1]  # fmt: skip
    first = all(coord[k] == 0 for k in cut0)
    initial = kw.get("initial")
    local_kw = {"lengths": mine.to(given.dtype), "unsafe": kw.get("unsafe", False)}
    if reduce in ("max", "min"):
        if initial is not None:
            local_kw["initial"] = initial
        y = func(data._local_tensor, reduce, **local_kw)  # 2.
        summed = Partial(reduce)
    else:
        y = func(data._local_tensor, "sum", **local_kw)
        if initial is not None and first:
            y = y + initial
        if reduce == "mean":
            length = lengths.to(y.dtype).reshape(-1, *[1] * (y.ndim - 1))
            if initial is not None:  # torch's: (sum + initial) / length, initial if empty
                y = torch.where(length > 0, y / length.clamp_min(1), y)
            elif first:  # (an empty segment: nan, as torch's 0 / 0)
                y = torch.where(length > 0, y / length.clamp_min(1), torch.nan)
            else:
                y = torch.where(length > 0, y / length.clamp_min(1), 0.0)
        summed = Partial("sum")
    places = [summed if k in cut0 else (p if isinstance(p, Shard) and p.dim else Replicate())
              for k, p in enumerate(lay.placements)]  # fmt: skip
    sizes = [lay.sizes_arg(k) if isinstance(p, Shard) else None for k, p in enumerate(places)]
    shape = (len(lengths), *data.shape[1:])
    return c.wrap(y, mesh, ShardLayout.build(shape, tuple(mesh.shape), places, sizes))
