"""``multilabel_margin_loss`` of scores cut along their classes or their samples.

For each sample, the targets are ``target``'s entries before its first -1, and::

    loss = sum over targets y, over classes j not a target, of max(0, 1 - (x[y] - x[j])) / C

Scores ``x`` (C,) or (N, C), ``target`` whole (a plain tensor):

- cut along the samples: each rank its samples (torch's kernel on its block), no message:
  ``reduction='none'`` cut alike, ``'mean'`` / ``'sum'`` Partial(sum);
- cut along the classes:
  1. every rank reads the targets' scores: each rank fills those it holds, ONE all-reduce
     of (N, K) numbers (K the most targets of a sample);
  2. each rank sums the terms of its classes j: the loss Partial(sum), no message.
  The backward: the same all-reduce, and ONE more of each target's count of violating
  classes (N, K); each rank its classes' gradient.

``is_target`` (the kernel's second result) is cut as ``x``. Else ``NotImplemented``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2


def _cut(x, target):
    """('classes' | 'samples', the mesh dims cutting) or None."""
    if type(x) is not c.ShardTensor or type(target) is c.ShardTensor or x.ndim not in (1, 2):
        return None
    lay = x._layout
    if not lay.is_block() or any(isinstance(p, Partial) for p in lay.placements):
        return None
    dims = {p.dim for p in lay.placements if isinstance(p, Shard)}
    cuts = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard)]
    if len(dims) != 1:
        return None
    return ("classes" if dims == {x.ndim - 1} else "samples"), cuts


def _targets(x, target, cuts, name):
    """(2-D scores block, 2-D target, valid (N, K), the targets' scores (N, K) whole,
    this rank's class range)."""
    n = x.shape[0] if x.ndim == 2 else 1
    xs = x._local_tensor.reshape(n, x._local_tensor.shape[-1])
    t = target.reshape(-1, target.shape[-1]).long()
    valid = (t >= 0).long().cumprod(-1).bool()
    k = max(int(valid.sum(-1).max()) if valid.numel() else 0, 1)
    t, valid = t[:, :k], valid[:, :k]
    lo, hi = x._layout.local_box(c.me(x.device_mesh))[-1]
    here = valid & (t >= lo) & (t < hi)
    vals = torch.zeros(t.shape, dtype=xs.dtype)
    vals[here] = xs[here.nonzero()[:, 0], t[here] - lo]
    for m in cuts:  # 1.
        with label(f"{name}.targets"):
            collectives.all_reduce_(vals, group=x.device_mesh.get_group(m))
    return xs, t, valid, vals, (lo, hi)


def _terms(xs, t, valid, vals, lo, hi):
    """(N, K, C_i) the hinge terms of this rank's classes, and its is_target (N, C_i)."""
    j = torch.arange(lo, hi)
    is_t = ((t[:, :, None] == j) & valid[:, :, None]).any(1)  # (N, C_i)
    z = (1 - (vals[:, :, None] - xs[:, None, :])).clamp_min(0)
    keep = valid[:, :, None] & ~is_t[:, None, :]
    return torch.where(keep, z, 0.0), keep & (z > 0), is_t.to(xs.dtype)


@register(aten.multilabel_margin_loss_forward.default)
def forward(func, args, kwargs):
    x, target, reduction = args
    got = _cut(x, target)
    if got is None or kwargs:
        return NotImplemented
    kind, cuts = got
    mesh, n_cls = x.device_mesh, x.shape[-1]
    summed = [Partial() if k in cuts else Replicate() for k in range(mesh.ndim)]
    if kind == "samples":
        lo, hi = x._layout.local_box(c.me(mesh))[0]
        loss, is_t = func(x._local_tensor, target[lo:hi], _NONE)
    else:
        xs, t, valid, vals, (lo, hi) = _targets(x, target, cuts, "multilabel_margin_loss")
        terms, _, is_t = _terms(xs, t, valid, vals, lo, hi)
        loss = terms.sum((1, 2)) / n_cls  # 2. (N,)
        is_t = is_t.reshape(x._local_tensor.shape)
        loss = loss.reshape(x.shape[:-1])
    if reduction == _NONE:
        if kind == "samples":
            lay = ShardLayout.build(tuple(x.shape[:-1]), tuple(mesh.shape), x._layout.placements,
                                    [x._layout.sizes_arg(k) for k in range(mesh.ndim)])  # fmt: skip
        else:
            lay = ShardLayout.build(tuple(x.shape[:-1]), tuple(mesh.shape), summed)
        out = c.wrap(loss, mesh, lay)
    else:
        total = loss.sum() / (x.shape[0] if reduction == _MEAN and x.ndim == 2 else 1)
        out = c.wrap(total.to(x.dtype), mesh, ShardLayout.build((), tuple(mesh.shape), summed))
    return out, c.wrap(is_t, mesh, x._layout)


@register(aten.multilabel_margin_loss_backward.default)
def backward(func, args, kwargs):
    grad, x, target, reduction, is_target = args
    got = _cut(x, target)
    if got is None or kwargs or (type(grad) is c.ShardTensor and not grad._layout.is_whole()):
        return NotImplemented
    kind, cuts = got
    mesh, g = x.device_mesh, c.local(grad)
    if kind == "samples":
        lo, hi = x._layout.local_box(c.me(mesh))[0]
        scale = x.shape[0] if reduction == _MEAN else 1
        gb = g[lo:hi] if reduction == _NONE else g  # (the mean or sum: a whole number)
        out = func(gb, x._local_tensor, target[lo:hi], _NONE if reduction == _NONE else _SUM,
                   c.local(is_target))  # fmt: skip
        return c.wrap(out / scale, mesh, x._layout)
    xs, t, valid, vals, (lo, hi) = _targets(x, target, cuts, "multilabel_margin_loss_backward")
    _, hit, _ = _terms(xs, t, valid, vals, lo, hi)  # (N, K, C_i) where the hinge is active
    counts = hit.sum(-1).to(xs.dtype)  # (N, K): this rank's violating classes per target
    for m in cuts:
        with label("multilabel_margin_loss_backward.counts"):
            collectives.all_reduce_(counts, group=mesh.get_group(m))
    n = xs.shape[0]
    if reduction == _NONE:
        gn = g.reshape(n)
    else:
        gn = g.reshape(()).expand(n) / (n if reduction == _MEAN and x.ndim == 2 else 1)
    gn = gn / x.shape[-1]
    out = hit.sum(1).to(xs.dtype) * gn[:, None]  # (N, C_i): + for each violated pair
    here = valid & (t >= lo) & (t < hi)
    rows = here.nonzero()[:, 0]
    out.index_put_((rows, t[here] - lo), -(counts * gn[:, None])[here], accumulate=True)
    return c.wrap(out.reshape(x._local_tensor.shape), mesh, x._layout)
