"""Reductions of ShardTensors with the true global sizes.

* ``sum`` / ``mean`` / ``amax`` / ``amin`` over a cut dim: local reduction, the result
  ``Partial(sum|max|min)`` on that mesh dim (reduced when read: one all-reduce). ``mean``
  is ``sum / n`` with the global ``n`` (DTensor averages the local means: wrong on uneven
  shards). A rank whose block is empty adds the identity (0, -inf, +inf).
* ``prod`` / ``all`` / ``any`` over a cut dim: local, then one all-reduce (product,
  min, max) per mesh dim: the result is Replicate.
* ``argmax`` / ``argmin`` / ``max.dim`` / ``min.dim`` over a cut dim: each rank's best
  value and its *global* index, then one all-gather per mesh dim picks the winner (NaN
  wins, then the smaller index, as torch).
* ``var``, ``std``: :mod:`.moments` (one all-gather of counts, means and squared
  deviations); ``logsumexp``, norms ... over a cut dim: torch's decomposition into the
  reductions above (exact two-pass formulas); over uncut dims they run locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout.elementwise import reduce_layout
from shardlab.trace import label

aten = torch.ops.aten


def _dims(x, dims) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % max(x.ndim, 1) for d in dims}) if x.ndim else []


def _cut(layout, dims) -> list[int]:
    return [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim in dims]


def _keep_only(x, kind: str | None, cause: str):
    """Reduce the Partial mesh dims of ``x`` except those of ``kind`` (which pass through)."""
    target = _kept(x._layout, kind)
    return x if target is x._layout else c.move(x, target, cause)


def _kept(layout, kind: str | None):
    """``layout`` with its Partial mesh dims reduced, except those of ``kind``."""
    bad = [
        m
        for m, p in enumerate(layout.placements)
        if isinstance(p, Partial) and (kind is None or p != Partial(kind))
    ]
    return c.without_partial(layout, bad) if bad else layout


def _first_moves(x, target, args, kwargs):
    """A plan's moves when only its first argument, ``x``, may move (to ``target``)."""
    if target is x._layout:
        return None
    return (target,) + (None,) * (len(args) + len(kwargs) - 1)


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


@register(aten.sum.default, aten.sum.dim_IntList)
def _sum(func, args, kwargs):
    """The sum of each block: over a cut dim, ``Partial(sum)`` (summed when read)."""
    x = args[0]
    lay = _kept(x._layout, "sum")  # 1. any other Partial summed first
    if func is aten.sum.default:
        dims, keepdim = _dims(x, None), False
    else:
        dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
        keepdim = _arg(args, kwargs, 2, "keepdim", False)
    layout = reduce_layout(lay, dims, keepdim, "sum")
    moves = _first_moves(x, lay, args, kwargs)
    return Plan(x.device_mesh, layout, moves, "sum.reduce")  # 2. the op on each block


@register(aten.mean.default, aten.mean.dim)
def _mean(func, args, kwargs):
    """mean = sum / count with the true global count."""
    x = args[0]
    if func is aten.mean.default:
        dims, keepdim, dtype = None, False, _arg(args, kwargs, 1, "dtype", None)
    else:
        dims = _arg(args, kwargs, 1, "dim", None)
        keepdim, dtype = _arg(args, kwargs, 2, "keepdim", False), kwargs.get("dtype")
    dims = _dims(x, dims)
    if (
        dims
        and not any(isinstance(p, Partial) for p in x._layout.placements)
        and not _cut(x._layout, dims)
    ):  # no cut dim reduced: the op itself on the block
        return Plan(x.device_mesh, reduce_layout(x._layout, dims, keepdim, "sum"))
    count = 1
    for d in dims:
        count *= x.shape[d]
    total = aten.sum.dim_IntList(x, dims, keepdim, dtype=dtype)
    return aten.div.Tensor(total, count)


def _identity(dtype, is_max: bool):
    if dtype.is_floating_point or dtype.is_complex:
        return -float("inf") if is_max else float("inf")
    if dtype == torch.bool:
        return not is_max
    info = torch.iinfo(dtype)
    return info.min if is_max else info.max


class _Extreme:
    """amax/amin of a block over ``dims``; an empty block (of a non-empty global tensor)
    gives the identity (-inf for max), which the ranks' Partial then ignores."""

    __slots__ = ("dims", "keepdim", "is_max", "shape")

    def __init__(self, dims, keepdim, is_max, shape):
        self.dims, self.keepdim, self.is_max, self.shape = dims, keepdim, is_max, shape

    def __call__(self, args, kwargs):
        local, dims, keepdim = args[0], self.dims, self.keepdim
        if any(local.shape[d] == 0 and self.shape[d] > 0 for d in dims):
            shape = [1 if d in dims else n for d, n in enumerate(local.shape)]
            if not keepdim:
                shape = [n for d, n in enumerate(shape) if d not in dims]
            fill = _identity(local.dtype, self.is_max)
            return torch.full(shape, fill, dtype=local.dtype, device=local.device)
        fn = torch.amax if self.is_max else torch.amin
        return fn(local, dim=dims, keepdim=keepdim) if dims else local.clone()


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _extreme(func, args, kwargs):
    """The extreme of each block: over a cut dim, ``Partial(max|min)``."""
    is_max = func in (aten.amax.default, aten.max.default)
    kind = "max" if is_max else "min"
    x = args[0]
    lay = _kept(x._layout, kind)
    if func in (aten.max.default, aten.min.default):
        dims, keepdim = _dims(x, None), False
    else:
        dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
        keepdim = _arg(args, kwargs, 2, "keepdim", False)
    local = _Extreme(dims, keepdim, is_max, tuple(x.shape))
    layout = reduce_layout(lay, dims, keepdim, kind)
    return Plan(x.device_mesh, layout, _first_moves(x, lay, args, kwargs), f"{kind}.reduce", local)


def _all_reduce_over(t, mesh, mesh_dims, op, cause):
    t = t.contiguous().clone()
    with label(cause):
        for m in mesh_dims:
            collectives.all_reduce_(t, op, mesh.get_group(m))
    return t


def _replicated_on(layout, mesh_dims):
    places = tuple(Replicate() if m in mesh_dims else p for m, p in enumerate(layout.placements))
    return layout.replace(placements=places)


@register(
    aten.prod.default,
    aten.prod.dim_int,
    aten.all.default,
    aten.all.dim,
    aten.all.dims,
    aten.any.default,
    aten.any.dim,
    aten.any.dims,
)
def _eager(func, args, kwargs):
    """prod / all / any: local, then one all-reduce per cut mesh dim."""
    x = c.reduced(args[0], f"{c.op_name(func)}.reduce")
    pk = func.overloadpacket
    dims_arg = None if func._overloadname == "default" else _arg(args, kwargs, 1, "dim", None)
    dims = _dims(x, dims_arg)
    keepdim = False if dims_arg is None else _arg(args, kwargs, 2, "keepdim", False)
    local = func(x._local_tensor, *args[1:], **kwargs)
    cut = _cut(x._layout, dims)
    layout = _replicated_on(reduce_layout(x._layout, dims, keepdim), cut)
    if cut:
        cause = f"{c.op_name(func)}.reduce"
        if pk is aten.prod:
            local = _all_reduce_over(local, x.device_mesh, cut, dist.ReduceOp.PRODUCT, cause)
        else:
            op = dist.ReduceOp.MIN if pk is aten.all else dist.ReduceOp.MAX
            local = _all_reduce_over(local.to(torch.uint8), x.device_mesh, cut, op, cause)
            local = local.to(torch.bool)
    return c.wrap(local, x.device_mesh, layout)


@register(aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim)
def _arg_extreme(func, args, kwargs):
    is_max = func in (aten.argmax.default, aten.max.dim)
    x = c.reduced(args[0], f"{c.op_name(func)}.reduce")
    dim = _arg(args, kwargs, 1, "dim", None)
    keepdim = _arg(args, kwargs, 2, "keepdim", False)
    dims = _dims(x, dim)
    cut = _cut(x._layout, dims)
    mesh = x.device_mesh
    with_values = func in (aten.max.dim, aten.min.dim)
    if not cut and x is args[0]:  # the op on each block
        layout = reduce_layout(x._layout, dims, keepdim)
        return Plan(mesh, (layout, layout) if with_values else layout)
    if not cut:
        out = func(x._local_tensor, *args[1:], **kwargs)
        layout = reduce_layout(x._layout, dims, keepdim)
        return (
            (c.wrap(out[0], mesh, layout), c.wrap(out[1], mesh, layout))
            if with_values
            else (c.wrap(out, mesh, layout))
        )
    local = x._local_tensor
    flat = dim is None
    src = local.reshape(-1) if flat else local
    d = 0 if flat else dims[0]
    if src.shape[d] == 0:
        shape = list(src.shape)
        del shape[d]
        vals = local.new_full(shape, _identity(local.dtype, is_max))
        idx = local.new_full(shape, torch.iinfo(torch.int64).max, dtype=torch.int64)
    else:
        vals, idx = (torch.max if is_max else torch.min)(src, dim=d)
        idx = _global_index(idx, x, d, flat)
    with label(f"{c.op_name(func)}.reduce"):
        for m in cut:
            if mesh.shape[m] > 1:  # one rank: its winner is the winner
                vals, idx = _combine(vals, idx, mesh.get_group(m), is_max)
    if keepdim:
        if flat:
            vals, idx = vals.reshape([1] * x.ndim), idx.reshape([1] * x.ndim)
        else:
            vals, idx = vals.unsqueeze(d), idx.unsqueeze(d)
    layout = _replicated_on(reduce_layout(x._layout, dims, keepdim), cut)
    if with_values:
        return c.wrap(vals, mesh, layout), c.wrap(idx, mesh, layout)
    return c.wrap(idx, mesh, layout)


def _global_index(idx, x, d, flat):
    """Local indices along dim ``d`` (or into the flattened block) -> global ones."""
    coord = c.me(x.device_mesh)
    if not flat:
        table = torch.as_tensor(x._layout.dim_indices(d, coord), device=idx.device)
        return table[idx]
    local_shape = x._local_tensor.shape
    out = torch.zeros_like(idx)
    rest = idx.clone()
    for k in range(x.ndim - 1, -1, -1):
        digit = rest % local_shape[k]
        rest = rest // local_shape[k]
        table = torch.as_tensor(x._layout.dim_indices(k, coord), device=idx.device)
        stride = 1
        for n in x.shape[k + 1 :]:
            stride *= n
        out += table[digit] * stride
    return out


def _combine(vals, idx, group, is_max):
    """Winner over the ranks of ``group``: NaN first, then the best value, then the
    smallest index."""
    n = dist.get_world_size(group)
    all_v = [torch.empty_like(vals) for _ in range(n)]
    all_i = [torch.empty_like(idx) for _ in range(n)]
    collectives.all_gather(all_v, vals.contiguous(), group)
    collectives.all_gather(all_i, idx.contiguous(), group)
    best_v, best_i = all_v[0], all_i[0]
    for v, i in zip(all_v[1:], all_i[1:]):
        vn, bn = _isnan(v), _isnan(best_v)
        better = (v > best_v) if is_max else (v < best_v)
        tie = (v == best_v) | (vn & bn)
        take = (vn & ~bn) | (better & ~bn) | (tie & (i < best_i))
        best_v, best_i = torch.where(take, v, best_v), torch.where(take, i, best_i)
    return best_v, best_i


def _isnan(v):
    return (
        torch.isnan(v)
        if v.is_floating_point() or v.is_complex()
        else torch.zeros_like(v, dtype=torch.bool)
    )


# logsumexp / norms: local over uncut dims, else torch's decomposition
_LOCAL_IF_UNCUT = {
    aten.logsumexp.default: (1, 2),
    aten.linalg_vector_norm.default: (2, 3),
    aten.nansum.default: (1, 2),
    aten.count_nonzero.dim_IntList: (1, None),
}  # op: (position of dim, position of keepdim)


@register(*_LOCAL_IF_UNCUT)
def _local_if_uncut(func, args, kwargs):
    x = args[0]
    dim_at, keep_at = _LOCAL_IF_UNCUT[func]
    name = func._schema.arguments[dim_at].name
    dims = _dims(x, _arg(args, kwargs, dim_at, name, None))
    keepdim = False if keep_at is None else _arg(args, kwargs, keep_at, "keepdim", False)
    if _cut(x._layout, dims) or any(isinstance(p, Partial) for p in x._layout.placements):
        return NotImplemented  # -> decomposition into sums and maxima
    layout = reduce_layout(x._layout, dims, keepdim)
    many = len(func._schema.returns) > 1  # (var_mean, std_mean)
    return Plan(x.device_mesh, (layout, layout) if many else layout)  # the op on each block
