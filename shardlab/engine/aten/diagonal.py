"""``diagonal`` (and its backward) with the two diagonal dims whole: each rank takes the
diagonals of its own matrices, no message::

    A (6, n, n) Shard(0) sizes [4, 2]   ->   diagonal(A, dim1=-2, dim2=-1) (6, n) Shard(0) [4, 2]

The result's dims are the input's without ``dim1`` and ``dim2``, then the diagonal (a
new last dim, whole); each cut dim keeps its sizes. Backward (``diagonal_backward``)
puts each rank's gradient rows back on its own matrices' diagonals. A cut diagonal dim
(or a strided layout) keeps torch's decomposition and the fallback.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.engine import _common as c
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _args(func, args, kwargs, skip: int):
    """(offset, dim1, dim2) after the first ``skip`` arguments, torch's defaults."""
    names = [a.name for a in func._schema.arguments][skip:]
    given = dict(zip(names, args[skip:]), **kwargs)
    return given.get("offset", 0), given.get("dim1", 0), given.get("dim2", 1)


def diagonal_layout(layout: ShardLayout, d1: int, d2: int, shape) -> ShardLayout | None:
    """The layout of ``diagonal`` (result ``shape``) of a tensor in ``layout``: its dims
    without ``d1``, ``d2`` keep their cuts; None when ``d1`` or ``d2`` is cut."""
    keep = [d for d in range(len(layout.global_shape)) if d not in (d1, d2)]
    places = []
    for p in layout.placements:
        if isinstance(p, Shard):
            if p.dim in (d1, d2):
                return None
            p = Shard(keep.index(p.dim))
        places.append(p)
    sizes = [layout.sizes_arg(m) for m in range(len(places))]
    return ShardLayout.build(tuple(shape), layout.mesh_shape, places, sizes)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(func, args, kwargs):
    x = args[0]
    _, d1, d2 = _args(func, args, kwargs, 1)
    n = max(x.ndim, 1)
    if not x._layout.is_block():
        return NotImplemented
    meta = meta_call(func, args, kwargs)
    out = diagonal_layout(x._layout, d1 % n, d2 % n, tuple(meta.shape))
    if out is None:
        return NotImplemented
    return Plan(x.device_mesh, out)  # (the block's own diagonal)


class _LocalBackward:
    """``diagonal_backward`` on a block: the input sizes made this rank's (its extents of
    the dims the gradient keeps)."""

    __slots__ = ("keep",)

    def __init__(self, keep):
        self.keep = tuple(keep)

    def __call__(self, args, kwargs):
        grad, sizes, *rest = args
        sizes = list(sizes)
        for j, d in enumerate(self.keep):
            sizes[d] = grad.shape[j]
        return aten.diagonal_backward.default(grad, sizes, *rest, **kwargs)


@register(aten.diagonal_backward.default)
def _diagonal_backward(func, args, kwargs):
    grad, input_sizes = args[0], list(args[1])
    st = c.ShardTensor
    if type(grad) is not st or not grad._layout.is_block():
        return NotImplemented
    _, d1, d2 = _args(func, args, kwargs, 2)
    n = len(input_sizes)
    d1, d2 = d1 % n, d2 % n
    keep = [d for d in range(n) if d not in (d1, d2)]
    lay = grad._layout
    places = []
    for p in lay.placements:
        if isinstance(p, Shard):
            if p.dim >= len(keep):  # the diagonal itself cut
                return NotImplemented
            p = Shard(keep[p.dim])
        places.append(p)
    sizes = [lay.sizes_arg(m) for m in range(len(places))]
    out = ShardLayout.build(tuple(input_sizes), lay.mesh_shape, places, sizes)
    return Plan(grad.device_mesh, out, local=_LocalBackward(keep))  # each block's own
