"""Ops that couple the elements along some dims: softmax, cumsum, sort, topk, flip, roll,
layer norm ... Each rank computes locally when no mesh dim cuts a coupled dim::

    softmax(x, -1), x (B, T, C) cut on T   ->  local; the result cut like x

When one does:

* softmax / log_softmax / layer norm (and their backward) decompose (torch's own
  decomposition) into maxima and sums that the reductions compute exactly: two small
  all-reduces, no block ever leaves its rank;
* cumsum / cumprod along a cut block dim: local scan, plus the totals of the blocks
  before (one all-gather of one slice per rank);
* the rest (sort, topk, flip, roll, cummax ...) first move the tensor to the cheapest
  layout that leaves the coupled dims whole (another dim cut instead, or Replicate),
  labelled ``auto-redistribute for <op>``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine import decisions
from shardlab.layout import ShardLayout, moves
from shardlab.layout.elementwise import restrict
from shardlab.trace import label

from .registry import register

aten = torch.ops.aten


def _at(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _norm_dims(dims, ndim):
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % max(ndim, 1) for d in dims})


# op -> (tensor args moved like the first, coupled dims of args[0], decomposes exactly)
_SPEC = {
    aten._softmax.default: ((0,), lambda a, k, n: [a[1]], True),
    aten._log_softmax.default: ((0,), lambda a, k, n: [a[1]], True),
    aten._softmax_backward_data.default: ((0, 1), lambda a, k, n: [a[2]], True),
    aten._log_softmax_backward_data.default: ((0, 1), lambda a, k, n: [a[2]], True),
    aten.cumsum.default: ((0,), lambda a, k, n: [a[1]], False),
    aten.cumprod.default: ((0,), lambda a, k, n: [a[1]], False),
    aten.logcumsumexp.default: ((0,), lambda a, k, n: [a[1]], False),
    aten.cummax.default: ((0,), lambda a, k, n: [a[1]], False),
    aten.cummin.default: ((0,), lambda a, k, n: [a[1]], False),
    aten.sort.default: ((0,), lambda a, k, n: [_at(a, k, 1, "dim", -1)], False),
    aten.sort.stable: ((0,), lambda a, k, n: [k.get("dim", -1)], False),
    aten.topk.default: ((0,), lambda a, k, n: [_at(a, k, 2, "dim", -1)], False),
    aten.flip.default: ((0,), lambda a, k, n: list(a[1]), False),
    aten.roll.default: ((0,), lambda a, k, n: list(_at(a, k, 2, "dims", [])) or range(n), False),
    aten.native_layer_norm.default: ((0,), lambda a, k, n: list(range(n - len(a[1]), n)), True),
    aten.kthvalue.default: ((0,), lambda a, k, n: [_at(a, k, 2, "dim", -1)], False),
    aten.median.dim: ((0,), lambda a, k, n: [a[1]], False),
    aten.mode.default: ((0,), lambda a, k, n: [_at(a, k, 1, "dim", -1)], False),
}


def _cutting(layout, dims) -> list[int]:
    return [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim in dims]


def _whole_on(layout: ShardLayout, dims) -> ShardLayout:
    """Cheapest layout where no mesh dim cuts ``dims`` (a cut moves to another dim, or
    that mesh dim becomes Replicate)."""
    cut = _cutting(layout, dims)
    candidates = [moves.replicated(layout, cut)]
    free = [
        d
        for d in range(len(layout.global_shape))
        if d not in dims
        and all(not (isinstance(p, Shard) and p.dim == d) for p in layout.placements)
    ]
    for d in free:
        places = [Shard(d) if m in cut else p for m, p in enumerate(layout.placements)]
        if layout.is_block():
            sizes = [
                None
                if m in cut or not isinstance(p, Shard)
                else (
                    [list(s) for s in layout.sizes[m]]
                    if len(layout.sizes[m]) > 1
                    else list(layout.sizes[m][0])
                )
                for m, p in enumerate(layout.placements)
            ]
            try:
                candidates.append(
                    ShardLayout.build(layout.global_shape, layout.mesh_shape, places, sizes)
                )
            except ValueError:
                pass
    return moves.cheapest(layout, candidates)


@register(*_SPEC)
def _along_dims(func, args, kwargs):
    moved_args, spec = list(args), _SPEC[func]
    x = c.reduced(args[0], f"{c.op_name(func)}.partial")
    dims = _norm_dims(spec[1](args, kwargs, x.ndim), x.ndim)
    if _cutting(x._layout, dims):
        if spec[2]:
            return NotImplemented  # torch's decomposition: exact sums and maxima
        if func is aten.cumsum.default and _scan_ok(x, dims[0]):
            return _cumsum(x, dims[0], kwargs.get("dtype", _at(args, kwargs, 2, "dtype")))
        x = c.move(x, _whole_on(x._layout, dims), f"auto-redistribute for {c.op_name(func)}")
    mesh = x.device_mesh
    unmoved = x is args[0]
    moved_args[0] = x._local_tensor
    for i in spec[0][1:]:
        a = c.reduced(args[i], f"{c.op_name(func)}.partial")
        a = c.move(a, restrict(x._layout, a.shape, [False] * mesh.ndim), f"{c.op_name(func)}.align")
        unmoved = unmoved and a is args[i]
        moved_args[i] = a._local_tensor
    for i, a in enumerate(args):  # other ShardTensors (layer norm's weight): whole
        if i not in spec[0] and isinstance(a, c.ShardTensor):
            moved_args[i] = c.replicated(a, f"{c.op_name(func)}.align")
            unmoved = unmoved and moved_args[i] is a
    local_args, local_kwargs = c.locals_of((moved_args, kwargs))
    out = _wrap_like(func(*local_args, **local_kwargs), x, dims, mesh)
    st = c.ShardTensor
    if unmoved:  # the op on the blocks as they are: the decision can be kept for the
        # signature (shardlab.engine.decisions); a tuple of results carries it on its first
        keep = [None] * (len(args) + len(kwargs))
        if isinstance(out, st):
            decisions.decided(out, func, keep, mesh, out._layout)
        elif type(out) is tuple and out and all(isinstance(o, st) for o in out):
            decisions.decided(out[0], func, keep, mesh, tuple(o._layout for o in out))
    return out


def _wrap_like(out, x, dims, mesh):
    """Outputs keep x's cuts: same dims (softmax, sort, topk ...) or with the coupled
    dim dropped (median, mode, kthvalue without keepdim). Coupled dims are whole."""
    if isinstance(out, (tuple, list)):
        return c.rebuild(out, [_wrap_like(o, x, dims, mesh) for o in out])
    if not isinstance(out, torch.Tensor):
        return out
    lay = x._layout
    if out.ndim == x.ndim:
        where = {d: d for d in range(x.ndim)}
    elif out.ndim == x.ndim - len(dims):
        kept = [d for d in range(x.ndim) if d not in dims]
        where = {d: j for j, d in enumerate(kept)}
    else:
        raise NotImplementedError(f"shardlab: unexpected output rank {out.ndim} for {lay}")
    places, sizes, atoms, cuts = [], [], [None] * out.ndim, []
    gshape = list(out.shape)
    for m, p in enumerate(lay.placements):
        if isinstance(p, Shard):  # never a coupled dim here
            j = where[p.dim]
            places.append(Shard(j))
            sizes.append(lay.sizes[m])
            cuts.append(lay.cut_of(m))
            atoms[j] = lay.dim_atoms(p.dim)
            gshape[j] = lay.global_shape[p.dim]
        else:
            places.append(p)
            sizes.append(None)
            cuts.append(None)
    if all(a is None or len(a) == 1 for a in atoms):
        layout = ShardLayout(tuple(gshape), lay.mesh_shape, tuple(places), tuple(sizes))
    else:
        layout = ShardLayout(
            tuple(gshape),
            lay.mesh_shape,
            tuple(places),
            tuple(sizes),
            tuple(None if a is None or len(a) == 1 else a for a in atoms),
            tuple(cuts),
        )
    return c.wrap(out, mesh, layout)


def _scan_ok(x, dim) -> bool:
    """One mesh dim of more than one rank cuts the block dim (one rank: the move to a
    whole dim is free, no scan)."""
    cut = _cutting(x._layout, [dim])
    return x._layout.is_block(dim) and len(cut) == 1 and x.device_mesh.shape[cut[0]] > 1


def _cumsum(x, dim, dtype):
    """Scan of a cut block dim: local cumsum + the sum of every earlier block's total.

    1. local cumsum                                   (B, T_local, ...)
    2. all-gather each rank's total (the last row)    one slice per rank
    3. add the totals of the ranks before this one
    """
    (m,) = _cutting(x._layout, [dim])
    mesh = x.device_mesh
    local = torch.cumsum(x._local_tensor, dim, dtype=dtype)
    total = (
        local.narrow(dim, local.shape[dim] - 1, 1)
        if local.shape[dim]
        else torch.zeros_like(local.narrow(dim, 0, 0)).sum(dim, keepdim=True)
    )
    total = total.contiguous()
    group = mesh.get_group(m)
    gathered = [torch.empty_like(total) for _ in range(mesh.shape[m])]
    with label("cumsum.scan"):
        collectives.all_gather(gathered, total, group)
    mine = c.me(mesh)[m]
    if mine:
        local = local + torch.stack(gathered[:mine]).sum(0)
    return c.wrap(local, mesh, x._layout)


@register(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func, args, kwargs):
    """Layer norm's backward with the normalised dims whole: each rank's rows alone.

    grad_input is cut like the input; the weight's and bias's gradients are sums over
    every row, so each rank holds its rows' part: Partial(sum) on the mesh dims that cut
    the input, Replicate on the others (no message here; summed when read). The output
    gradient moves to the input's layout first (from Replicate: each rank's slice).
    Anything else (a cut normalised dim, Partial values): torch's decomposition."""
    grad, x, shape, mean, rstd, weight, bias = args[:7]
    st = c.ShardTensor
    k = len(shape)
    dims = list(range(x.ndim - k, x.ndim)) if isinstance(x, st) else []
    rows = (grad, x, mean, rstd)
    if (
        kwargs
        or not all(isinstance(t, st) for t in rows)
        or any(isinstance(p, Partial) for t in rows for p in t._layout.placements)
        or _cutting(x._layout, dims)
        or mean._layout != rstd._layout
        or mean._layout != _rows_layout(x, k)
        or any(
            isinstance(t, st) and any(not isinstance(p, Replicate) for p in t._layout.placements)
            for t in (weight, bias)
        )
    ):
        return NotImplemented
    mesh, lay = x.device_mesh, x._layout
    cause = "native_layer_norm_backward.align"
    moved = c.move(grad, lay, cause)  # cut like the input (from Replicate: a slice)
    local_args, _ = c.locals_of(([moved, *args[1:]], {}))
    dx, dw, db = func(*local_args)
    summed = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in lay.placements)
    outs = [c.wrap(dx, mesh, lay) if dx is not None else None]
    for g in (dw, db):
        outs.append(
            None
            if g is None
            else c.wrap(
                g, mesh, ShardLayout(tuple(g.shape), lay.mesh_shape, summed, (None,) * len(summed))
            )
        )
    if all(o is not None for o in outs):  # the kernel on the blocks: kept per signature
        layouts = tuple(o._layout for o in outs)
        c.keep_moves(func, args, kwargs, {0: moved}, outs[0], mesh, layouts, cause)
    return tuple(outs)


def _rows_layout(x, k):
    """The layout of layer norm's mean and rstd: x's, with its last k dims of size 1."""
    lay = x._layout
    return lay.replace(global_shape=tuple(lay.global_shape[: x.ndim - k]) + (1,) * k)
