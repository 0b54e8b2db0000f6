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
``lengths``, ``axis`` other than 0, 2-D ``lengths``: ``NotImplemented``.

The backward (``_segment_reduce_backward``), each rank the gradient of its own rows:

1. the result's gradient whole along the segments (cut as ``data`` along its other dims):
   no message when it is so, or Replicate; else moved (a Partial: one all-reduce of the
   result's size);
2. ``sum``: each row the gradient of its segment; ``mean``: divided by the segment's whole
   length. No message;
3. ``max`` / ``min``: the result whole along the segments (its Partial(max / min): one
   all-reduce of the result's size); a row takes its segment's gradient where it equals the
   result (or is nan), divided by the segment's count of such rows on every rank (one
   all-reduce of the result's size) where that is 2 or more and the gradient is positive,
   as torch's kernel divides it.
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
    got = _my_segments(data, lengths, offsets)  # 1.
    if got is None:
        return NotImplemented
    lengths, mine, dtype = got
    lay, mesh = data._layout, data.device_mesh
    coord = c.me(mesh)
    cut0 = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim == 0
            and lay.mesh_shape[k] > 1]  # fmt: skip
    first = all(coord[k] == 0 for k in cut0)
    initial = kw.get("initial")
    local_kw = {"lengths": mine.to(dtype), "unsafe": kw.get("unsafe", False)}
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
    out = _whole_along_segments(lay, (len(lengths), *data.shape[1:]))
    places = [summed if k in cut0 else p for k, p in enumerate(out.placements)]
    return c.wrap(y, mesh, out.replace(placements=tuple(places)))


def _my_segments(data, lengths, offsets):
    """``(lengths (S,), mine (S,), dtype)``: every segment's whole length, how many of
    each segment's rows this rank holds, and the dtype the lengths came in; or None where
    ``data`` is not a block cut of rows (no Partial) or the lengths (offsets) are not
    whole and 1-D. No message: the lengths are whole on every rank."""
    given = lengths if lengths is not None else offsets
    if given is None or given.ndim != 1 or (type(given) is c.ShardTensor
                                             and not given._layout.is_whole()):  # fmt: skip
        return None
    lay = data._layout
    if not lay.is_block() or any(isinstance(p, Partial) for p in lay.placements):
        return None
    whole = c.local(given).long()
    lengths = whole if lengths is not None else whole.diff()
    ends = lengths.cumsum(0)
    lo, hi = lay.local_box(c.me(data.device_mesh))[0]
    mine = torch.minimum(ends, torch.tensor(hi)) - torch.maximum(ends - lengths, torch.tensor(lo))
    return lengths, mine.clamp_min(0), given.dtype


def _whole_along_segments(lay: ShardLayout, shape) -> ShardLayout:
    """The result's layout with every mesh dim cutting the segments (dim 0) Replicate."""
    places = [p if isinstance(p, Shard) and p.dim else Replicate() for p in lay.placements]
    sizes = [lay.sizes_arg(k) if isinstance(p, Shard) else None for k, p in enumerate(places)]
    return ShardLayout.build(tuple(shape), lay.mesh_shape, places, sizes)


@register(aten._segment_reduce_backward.default)
def segment_reduce_backward(func, args, kwargs):
    kw = c.schema_args(func, args, kwargs)
    grad, out, data, reduce = kw["grad"], kw["output"], kw["data"], kw["reduce"]
    lengths, offsets = kw["lengths"], kw["offsets"]
    if kw["axis"] != 0 or reduce not in ("max", "min", "sum", "mean"):
        return NotImplemented
    if type(data) is not c.ShardTensor or not isinstance(grad, torch.Tensor):
        return NotImplemented
    lay, mesh = data._layout, data.device_mesh
    if any(type(t) is c.ShardTensor and t.device_mesh != mesh for t in (grad, out)):
        return NotImplemented
    got = _my_segments(data, lengths, offsets)
    if got is None:
        return NotImplemented
    lengths, mine, _ = got
    if int(lengths.sum()) != data.shape[0] or (lengths < 0).any():
        return NotImplemented  # (torch's own error, from the fallback)
    want = _whole_along_segments(lay, (len(lengths), *data.shape[1:]))
    cause = "segment_reduce backward"
    g = c.block_in(grad, mesh, want, cause)  # 1. (S, *inner_local)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), mine)  # (rows_local,)
    rows = g[seg]  # 2. (rows_local, *inner_local): each row its segment's gradient
    if reduce == "sum":
        return c.wrap(rows, mesh, lay)
    if reduce == "mean":
        return c.wrap(rows / lengths[seg].to(rows.dtype).reshape(-1, *[1] * (rows.ndim - 1)),
                      mesh, lay)  # fmt: skip
    x = data._local_tensor
    o = c.block_in(out, mesh, want, cause)  # 3. (S, *inner_local)
    hit = torch.isnan(x) | (x == o[seg])
    count = torch.zeros_like(g).index_add_(0, seg, hit.to(g.dtype))  # this rank's ties
    cut0 = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim == 0]
    if cut0:  # summed over the ranks that share the segments
        places = [Partial() if k in cut0 else p for k, p in enumerate(want.placements)]
        counted = c.wrap(count, mesh, want.replace(placements=tuple(places)))
        count = c.reduced(counted, cause)._local_tensor
    rows = torch.where(hit, rows, torch.zeros((), dtype=rows.dtype))
    n = count[seg]
    return c.wrap(torch.where((n >= 2) & (rows > 0), rows / n, rows), mesh, lay)
