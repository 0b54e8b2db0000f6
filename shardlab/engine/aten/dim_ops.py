"""Ops that couple the elements along some dims: softmax, cumsum, sort, topk, flip, roll,
layer norm ... Each rank computes locally when no mesh dim cuts a coupled dim::

    softmax(x, -1), x (B, T, C) cut on T   ->  local; the result cut like x

When one does:

* softmax / log_softmax / layer norm (and their backward) decompose (torch's own
  decomposition) into maxima and sums that the reductions compute exactly: two small
  all-reduces, no block ever leaves its rank;
* cumsum / cumprod along a cut block dim: local scan, plus the totals of the blocks
  before (one all-gather of one slice per rank);
* roll along a cut dim: two slices put back in the other order (``cat.align``); flip,
  and sort / median of a 1-D tensor cut along its only dim: :mod:`.ordering`;
* the rest (sort, median, topk, cummax ... of a tensor with other dims) first move the
  tensor to the cheapest layout that leaves the coupled dims whole (another dim cut
  instead: one all-to-all, the result left cut there; Replicate only where no dim is
  free, a gather, said), labelled ``auto-redistribute for <op>``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.aten import ordering
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout, moves
from shardlab.layout.elementwise import restrict
from shardlab.trace import label

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
    aten.nanmedian.dim: ((0,), lambda a, k, n: [a[1]], False),
    aten.mode.default: ((0,), lambda a, k, n: [_at(a, k, 1, "dim", -1)], False),
}


def _reordered(func, args, kwargs, x, dims):
    """``flip`` along cut dims, ``sort`` / ``median`` of a 1-D tensor cut along its only
    dim (:mod:`.ordering`); NotImplemented for the rest."""
    if func is aten.flip.default:
        return ordering.flip(x, dims)
    m = ordering.sortable(x)
    if m is None:
        return NotImplemented
    if func in (aten.sort.default, aten.sort.stable):
        descending = _at(args, kwargs, 2, "descending", False)
        if func is aten.sort.stable:
            descending = kwargs.get("descending", False)
        return ordering.sort_1d(x, m, descending)
    if func in (aten.median.dim, aten.nanmedian.dim):
        v, i = ordering.median_1d(x, m, func is aten.nanmedian.dim)
        if _at(args, kwargs, 2, "keepdim", False):
            v, i = aten.view.default(v, [1]), aten.view.default(i, [1])
        return v, i
    return NotImplemented


def _roll(x, shifts, dims):
    """``roll`` along cut dims: the two slices put back in the other order (``cat``), so
    each row goes to its new owner once, point to point (a shift by s sends about s rows
    across each boundary); along whole dims each block rolls (a plan, no message)."""
    y = x
    for s, d in zip(shifts, dims, strict=True):
        n = y.shape[d]
        s = s % n if n else 0
        if s == 0:
            continue
        if _cutting(y._layout, [d]):
            y = torch.cat([y.narrow(d, n - s, s), y.narrow(d, 0, n - s)], d)
        else:
            y = aten.roll.default(y, [s], [d])
    return aten.clone.default(y) if y is x else y


def _cutting(layout, dims) -> list[int]:
    return [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim in dims]


def _whole_on(layout: ShardLayout, dims, cut_first: bool = False) -> ShardLayout:
    """Cheapest layout where no mesh dim cuts ``dims`` (a cut moves to another dim, or
    that mesh dim becomes Replicate; ``cut_first``: a moved cut wins a tie)."""
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
    if cut_first:
        candidates = candidates[1:] + candidates[:1]
    return moves.cheapest(layout, candidates)


@register(*_SPEC)
def _along_dims(func, args, kwargs):
    """The op on each block once no mesh dim cuts a coupled dim (``x`` moved to the
    cheapest layout that leaves them whole, the other arguments aligned with it)."""
    spec, name, x = _SPEC[func], c.op_name(func), args[0]
    dims = _norm_dims(spec[1](args, kwargs, x.ndim), x.ndim)
    lay = c.without_partial(x._layout)
    if _cutting(lay, dims):
        if spec[2]:
            return NotImplemented  # torch's decomposition: exact sums and maxima
        scans = (aten.cumsum.default, aten.cumprod.default)
        if func in scans and _scan_ok(lay, x.device_mesh, dims[0]):
            x = c.reduced(x, f"{name}.partial")
            dtype = kwargs.get("dtype", _at(args, kwargs, 2, "dtype"))
            return _cumsum(x, dims[0], dtype, func is aten.cumprod.default)
        out = _reordered(func, args, kwargs, x, dims)
        if out is not NotImplemented:
            return out
        if func is aten.roll.default and _at(args, kwargs, 2, "dims", []):
            shifts = list(_at(args, kwargs, 1, "shifts", []))
            along = [d % x.ndim for d in _at(args, kwargs, 2, "dims", [])]  # (in order)
            if len(shifts) == len(along):
                return _roll(c.reduced(x, f"{name}.partial"), shifts, along)
    meta = meta_call(func, args, kwargs)
    metas = meta if isinstance(meta, tuple) else (meta,)
    if not all(isinstance(m, torch.Tensor) for m in metas):
        return NotImplemented
    mesh, nm, st = x.device_mesh, x.device_mesh.ndim, c.ShardTensor
    moves = [_steps(x._layout, lay, f"{name}.partial")]
    if _cutting(lay, dims):  # 1. the coupled dims made whole
        lay = _whole_on(lay, dims)
        moves[0] = (*(moves[0] or ()), (lay, f"auto-redistribute for {name}"))
    for i, a in enumerate(args[1:], 1):  # 2. the other tensors aligned with it
        if i in spec[0][1:]:
            part = c.without_partial(a._layout)
            steps = _steps(a._layout, part, f"{name}.partial") or ()
            want = restrict(lay, a.shape, [False] * nm)
            moves.append(_steps(part, want, f"{name}.align", steps))
        elif isinstance(a, st):  # (layer norm's weight): whole
            want = c.replicate_layout(a.shape, mesh)
            moves.append(_steps(a._layout, want, f"{name}.align"))
        else:
            moves.append(None)
    moves += [None] * len(kwargs)
    layouts = tuple(_layout_like(tuple(m.shape), lay, dims) for m in metas)
    return Plan(mesh, layouts if isinstance(meta, tuple) else layouts[0], moves)  # 3. the op


def _steps(layout, target, cause, before=()):
    """A plan's move from ``layout`` to ``target`` after the steps ``before``: the steps
    (None if there are none)."""
    steps = (*before, (target, cause)) if target != layout else before
    return steps or None


def _layout_like(shape, lay, dims):
    """A result of global ``shape`` keeps the cuts of ``lay``: on the same dims (softmax,
    sort, topk ...) or with the coupled dims dropped (median, mode, kthvalue without
    keepdim). The coupled dims are whole."""
    n = len(lay.global_shape)
    if len(shape) == n:
        where = {d: d for d in range(n)}
    elif len(shape) == n - len(dims):
        kept = [d for d in range(n) if d not in dims]
        where = {d: j for j, d in enumerate(kept)}
    else:
        raise NotImplementedError(f"shardlab: unexpected output rank {len(shape)} for {lay}")
    places, sizes, atoms, cuts = [], [], [None] * len(shape), []
    gshape = list(shape)
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
        return ShardLayout(tuple(gshape), lay.mesh_shape, tuple(places), tuple(sizes))
    return ShardLayout(
        tuple(gshape),
        lay.mesh_shape,
        tuple(places),
        tuple(sizes),
        tuple(None if a is None or len(a) == 1 else a for a in atoms),
        tuple(cuts),
    )


def _scan_ok(layout, mesh, dim) -> bool:
    """One mesh dim of more than one rank cuts the block dim (one rank: the move to a
    whole dim is free, no scan)."""
    cut = _cutting(layout, [dim])
    return layout.is_block(dim) and len(cut) == 1 and mesh.shape[cut[0]] > 1


def _cumsum(x, dim, dtype, prod=False):
    """Scan of a cut block dim: local cumsum + the sum of every earlier block's total
    (``cumprod``: times the product of every earlier block's total).

    1. local cumsum                                   (B, T_local, ...)
    2. all-gather each rank's total (the last row)    one slice per rank
    3. add the totals of the ranks before this one (multiply, for cumprod)
    """
    (m,) = _cutting(x._layout, [dim])
    mesh = x.device_mesh
    local = (torch.cumprod if prod else torch.cumsum)(x._local_tensor, dim, dtype=dtype)
    empty = local.narrow(dim, 0, 0)
    total = (
        local.narrow(dim, local.shape[dim] - 1, 1)
        if local.shape[dim]
        else (empty.prod(dim, keepdim=True) if prod else empty.sum(dim, keepdim=True))
    )
    total = total.contiguous()
    group = mesh.get_group(m)
    gathered = [torch.empty_like(total) for _ in range(mesh.shape[m])]
    with label(f"{'cumprod' if prod else 'cumsum'}.scan"):
        collectives.all_gather(gathered, total, group)
    mine = c.me(mesh)[m]
    if mine:
        before = torch.stack(gathered[:mine])
        local = local * before.prod(0) if prod else local + before.sum(0)
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
    mask = args[7] if len(args) > 7 else [True] * 3
    summed = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in lay.placements)
    if all(mask) and weight is not None and bias is not None:  # 1. the kernel on the blocks
        grads = (
            ShardLayout(tuple(t.shape), lay.mesh_shape, summed, (None,) * len(summed))
            for t in (weight, bias)
        )
        moves = [None if grad._layout == lay else lay] + [None] * (len(args) - 1)
        return Plan(mesh, (lay, *grads), moves, cause)
    moved = c.move(grad, lay, cause)  # cut like the input (from Replicate: a slice)
    local_args, _ = c.locals_of(([moved, *args[1:]], {}))
    dx, dw, db = func(*local_args)
    outs = [c.wrap(dx, mesh, lay) if dx is not None else None]
    for g in (dw, db):
        outs.append(
            None
            if g is None
            else c.wrap(
                g, mesh, ShardLayout(tuple(g.shape), lay.mesh_shape, summed, (None,) * len(summed))
            )
        )
    return tuple(outs)


def _rows_layout(x, k):
    """The layout of layer norm's mean and rstd: x's, with its last k dims of size 1."""
    lay = x._layout
    return lay.replace(global_shape=tuple(lay.global_shape[: x.ndim - k]) + (1,) * k)
