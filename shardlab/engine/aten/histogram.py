"""``torch.histogramdd`` of samples cut along their rows: each rank counts its own.

``histogramdd(x, bins)``: x (N, D) N samples of D coordinates; the bin edges span each
coordinate's min to max (or ``range``), then each sample is counted in its bin::

    x (5, 2) rows cut [2, 0, 3]     rank 0 counts rows 0-1, rank 2 rows 2-4: Partial(sum)

1. (``range`` not given) ONE all-reduce (min) of each rank's per-coordinate minimum and
   negated maximum (2 D numbers): the edges are torch's own, from those two rows
   (``_histogramdd_bin_edges``; they depend on nothing else), Replicate;
2. ``_histogramdd_from_bin_cts``: each rank counts its rows with those edges as ``range``
   (torch's binning, as one device's), the histogram Partial(sum); ``density``: summed
   (ONE all-reduce of the histogram) and divided as torch divides.

``x`` cut along its coordinates: moved to its rows first (ONE all-to-all). ``weight`` (N,)
plain: sliced; cut: moved to ``x``'s rows. Else ``NotImplemented``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten


def _rows(x):
    """``(x cut along its rows, the mesh dims cutting it)``: as it is, or its coordinates'
    cut moved to its rows; None for other layouts."""
    if type(x) is not c.ShardTensor or x.ndim != 2 or not x._layout.is_block():
        return None
    if x._layout.is_whole():
        return None  # (every rank holds it: torch's own op on the block)
    lay = x._layout
    if any(isinstance(p, Partial) for p in lay.placements):
        return None
    if any(isinstance(p, Shard) and p.dim == 1 for p in lay.placements):
        places = [Shard(0) if isinstance(p, Shard) else p for p in lay.placements]
        if sum(isinstance(p, Shard) for p in places) > 1:
            return None
        x = c.move(
            x, ShardLayout.build(tuple(x.shape), lay.mesh_shape, places), "histogramdd.to_rows"
        )
    lay = x._layout
    cut = [
        k for k, p in enumerate(lay.placements) if isinstance(p, Shard) and lay.mesh_shape[k] > 1
    ]
    return x, cut


def _extremes(x, cut):
    """Every coordinate's (min, max) over all rows: one all-reduce."""
    local = x._local_tensor
    if local.shape[0]:
        both = torch.stack([local.amin(0), -local.amax(0)])
    else:
        both = torch.full((2, x.shape[1]), torch.inf, dtype=local.dtype, device=local.device)
    for k in cut:
        with label("histogramdd.range"):
            collectives.all_reduce_(both, dist.ReduceOp.MIN, x.device_mesh.get_group(k))
    return both[0], -both[1]


def _edges(func, x, cut, bins, rng, density):
    if rng is not None:
        return aten._histogramdd_bin_edges(x._local_tensor[:0], bins, range=rng, density=density)
    lo, hi = _extremes(x, cut)
    return aten._histogramdd_bin_edges(torch.stack([lo, hi]), bins, density=density)


@register(aten._histogramdd_bin_edges.default)
def bin_edges(func, args, kwargs):
    got = _rows(args[0])
    if got is None or args[0].numel() == 0 or len(args) > 2:
        return NotImplemented
    x, cut = got
    kw = dict(kwargs)
    if type(kw.get("weight")) is c.ShardTensor:
        kw["weight"] = None  # (the edges never read the weights)
    edges = _edges(func, x, cut, args[1], kw.get("range"), kw.get("density", False))
    return [c.as_shard(e, x.device_mesh) for e in edges]


@register(aten._histogramdd_from_bin_cts.default)
def from_bin_cts(func, args, kwargs):
    got = _rows(args[0])
    if got is None or args[0].numel() == 0 or len(args) > 2:
        return NotImplemented
    x, cut = got
    bins, rng = args[1], kwargs.get("range")
    density, weight = kwargs.get("density", False), kwargs.get("weight")
    mesh = x.device_mesh
    edges = _edges(func, x, cut, bins, rng, density)
    span = [v for e in edges for v in (float(e[0]), float(e[-1]))]  # 2. torch's own range
    if weight is not None:
        lo, hi = x._layout.local_box(c.me(mesh))[0]
        if type(weight) is c.ShardTensor:
            sizes = [x._layout.sizes_arg(k) for k in range(mesh.ndim)]
            want = ShardLayout.build(
                tuple(weight.shape), x._layout.mesh_shape, x._layout.placements, sizes
            )
            weight = c.move(c.reduced(weight, "histogramdd.weight"), want, "histogramdd.weight")
            weight = weight._local_tensor
        else:
            weight = weight[lo:hi]
    hist = aten._histogramdd_from_bin_cts(x._local_tensor, bins, range=span, weight=weight)
    places = [Partial() if k in cut else Replicate() for k in range(mesh.ndim)]
    lay = ShardLayout.build(tuple(hist.shape), tuple(mesh.shape), places)
    if not density:
        return c.wrap(hist, mesh, lay)
    for k in cut:
        with label("histogramdd.density"):
            collectives.all_reduce_(hist, group=mesh.get_group(k))
    hist = hist / hist.sum()
    for d, e in enumerate(edges):  # torch's: divided by each dim's bin widths
        shape = [1] * hist.ndim
        shape[d] = -1
        hist = hist / e.diff().reshape(shape)
    return c.as_shard(hist, mesh)
