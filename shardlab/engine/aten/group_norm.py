"""``native_group_norm`` (and its backward) called at aten's level on a batch cut: each
rank its own samples.

The statistics of group norm are per sample and group, so with only the batch dim (0)
cut each rank normalises its samples alone::

    x (N=5, C, H, W) Shard(0) sizes [2, 0, 3]   rank 0: native_group_norm(x[0:2], N=2, ...)
                                               mean, rstd (N, group): Shard(0) alike

``native_group_norm_backward``: every argument with a batch dim cut alike, ``weight``
whole: ``grad_input`` cut alike, ``grad_weight`` / ``grad_bias`` Partial(sum) (each rank
its samples' part). No message. Other cuts: ``NotImplemented`` (torch's decomposition
over the cut dims, :mod:`.prims`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _batch_cut(x) -> bool:
    """Only dim 0 cut (in blocks), nothing Partial."""
    if type(x) is not c.ShardTensor or not x._layout.is_block(0):
        return False
    places = x._layout.placements
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in places)


def _like(x, shape):
    """``shape``'s layout, dim 0 cut as ``x``'s."""
    lay = x._layout
    return ShardLayout.build(tuple(shape), lay.mesh_shape, lay.placements,
                             [lay.sizes_arg(k) for k in range(len(lay.placements))])  # fmt: skip


def _same_cut(a, x) -> bool:
    return type(a) is c.ShardTensor and a._layout == _like(x, a.shape)


@register(aten.native_group_norm.default)
def group_norm(func, args, kwargs):
    x, weight, bias, n, ch, hxw, group, eps = args
    if (
        kwargs
        or not _batch_cut(x)
        or not all(
            t is None or type(t) is not c.ShardTensor or t._layout.is_whole()
            for t in (weight, bias)
        )
    ):
        return NotImplemented
    local = x._local_tensor
    y, mean, rstd = func(local, c.local(weight), c.local(bias), local.shape[0], ch, hxw, group, eps)
    mesh = x.device_mesh
    return (c.wrap(y, mesh, x._layout), c.wrap(mean, mesh, _like(x, (n, group))),
            c.wrap(rstd, mesh, _like(x, (n, group))))  # fmt: skip


@register(aten.native_group_norm_backward.default)
def group_norm_backward(func, args, kwargs):
    grad, x, mean, rstd, weight, n, ch, hxw, group, mask = args
    if kwargs or not _batch_cut(x) or not (_same_cut(grad, x) and _same_cut(mean, x)
                                           and _same_cut(rstd, x)):  # fmt: skip
        return NotImplemented
    if weight is not None and type(weight) is c.ShardTensor and not weight._layout.is_whole():
        return NotImplemented
    local = x._local_tensor
    gi, gw, gb = func(grad._local_tensor, local, mean._local_tensor, rstd._local_tensor,
                      c.local(weight), local.shape[0], ch, hxw, group, mask)  # fmt: skip
    mesh, lay = x.device_mesh, x._layout
    summed = [Partial() if isinstance(p, Shard) and lay.mesh_shape[k] > 1 else Replicate()
              for k, p in enumerate(lay.placements)]  # fmt: skip

    def part(t):
        if t is None or not mask[1] and t is gw or not mask[2] and t is gb:
            return t
        return c.wrap(t, mesh, ShardLayout.build(tuple(t.shape), lay.mesh_shape, summed))

    return (c.wrap(gi, mesh, lay) if mask[0] and gi is not None else gi, part(gw), part(gb))
