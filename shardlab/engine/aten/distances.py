"""``cdist`` with ``x1`` cut and ``x2`` whole: each rank its rows, or its part of the sum.

``torch.cdist(x1, x2, p)``: x1 (..., P, M), x2 (..., R, M) -> (..., P, R), the p-norm of
each row difference over the M features::

    x1 (5, 4) rows cut [2, 0, 3]       rank 0: rows 0-1 of the result     no message
    x1 (5, 4) features cut [1, 3, 0]   rank 0: sum over feature 0 of |d|^p ...

- ``x1`` cut along its batch dims or its rows: each rank its rows against ``x2`` (its
  batch dims sliced to the same range), the result cut alike, no message;
- ``x1`` cut along its features (``x2``'s sliced alike): each rank the norm of its
  features' part. ``p`` 0 (a count) and 1 (a sum): the result is Partial(sum); ``p`` inf
  (a max): Partial(max); no message. Any other ``p``: each rank its sum of ``|d|^p``,
  ONE all-reduce of the result's size, then the p-th root (Replicate).

``_cdist_backward`` (autograd's formula) for the same cuts: the gradient and the distances
made whole on every rank where ``x1``'s features are cut (the distances: ONE all-reduce of
the result, a Partial one), else cut like ``x1``'s rows; each rank its block of the
gradient of ``x1``. Else (``x2`` cut, a Partial ``x1``): ``NotImplemented``.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten


def _cuts(x1, x2):
    """``{mesh dim: x1's dim}`` of x1's cuts, or None where the rule does not apply."""
    if type(x1) is not c.ShardTensor or (type(x2) is c.ShardTensor and not x2._layout.is_whole()):
        return None
    lay = x1._layout
    if not lay.is_block() or any(isinstance(p, Partial) for p in lay.placements):
        return None
    if x2.ndim > 2 and tuple(x2.shape[:-2]) != tuple(x1.shape[:-2]):
        return None  # (broadcast batch dims: the fallback)
    return {k: p.dim for k, p in enumerate(lay.placements)
            if isinstance(p, Shard) and lay.mesh_shape[k] > 1}  # fmt: skip


def _x2_block(x1, x2, cuts):
    """x2 sliced to this rank's range of x1's cut batch dims and features."""
    box, b, nd = x1._layout.local_box(c.me(x1.device_mesh)), c.local(x2), x1.ndim
    for d in set(cuts.values()):
        lo, hi = box[d]
        if d == nd - 1:
            b = b.narrow(-1, lo, hi - lo)
        elif d < nd - 2 and x2.ndim == nd:
            b = b.narrow(d, lo, hi - lo)
    return b


@register(aten._cdist_forward.default)
def cdist(func, args, kwargs):
    x1, x2, p = args[0], args[1], float(args[2])
    cuts = _cuts(x1, x2)
    if cuts is None or kwargs:
        return NotImplemented
    mesh, nd = x1.device_mesh, x1.ndim
    y = func(x1._local_tensor, _x2_block(x1, x2, cuts), *args[2:])
    shape = (*x1.shape[:-1], x2.shape[-2])
    places, sizes = [Replicate()] * mesh.ndim, [None] * mesh.ndim
    summed = [k for k, d in cuts.items() if d == nd - 1]
    for k, d in cuts.items():
        if d != nd - 1:
            places[k], sizes[k] = Shard(d), x1._layout.sizes_arg(k)
    if summed and p in (0.0, 1.0, math.inf):
        for k in summed:
            places[k] = Partial("max" if p == math.inf else "sum")
    elif summed:  # the sum of |d|^p: one all-reduce, then the root
        y = y.pow(p)
        with label("cdist.sum"):
            for k in summed:
                collectives.all_reduce_(y, group=mesh.get_group(k))
        y = y.pow(1.0 / p)
    return c.wrap(y, mesh, ShardLayout.build(shape, tuple(mesh.shape), places, sizes))


@register(aten._cdist_backward.default)
def cdist_backward(func, args, kwargs):
    grad, x1, x2, p, dist = args
    cuts = _cuts(x1, x2)
    if cuts is None or kwargs:
        return NotImplemented
    mesh, nd = x1.device_mesh, x1.ndim
    places, sizes = [Replicate()] * mesh.ndim, [None] * mesh.ndim
    for k, d in cuts.items():  # the result's layout where x1's features are whole
        if d != nd - 1:
            places[k], sizes[k] = Shard(d), x1._layout.sizes_arg(k)
    want = ShardLayout.build(tuple(dist.shape), tuple(mesh.shape), places, sizes)

    def block(t, cause):
        return c.block_in(t, mesh, want, cause, partial=cause)

    g = block(grad, "cdist_backward.align")
    dd = block(dist, "cdist_backward.align")
    out = func(g, x1._local_tensor, _x2_block(x1, x2, cuts), p, dd)
    return c.wrap(out, mesh, x1._layout)
