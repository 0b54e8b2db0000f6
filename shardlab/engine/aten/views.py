"""Views of ShardTensors: every rank views its own block; layouts from :mod:`shardlab.layout.views`.

``view`` / ``reshape`` / ``flatten`` / ``unflatten`` / ``squeeze`` / ``unsqueeze`` /
``expand`` / ``permute`` / ``transpose`` / ``slice`` / ``select`` / ``split`` / ``unbind``:
no communication, whatever the sizes, as long as a block or strided layout describes
the result. When none does (a split whose pieces are not multiples of the inner extent,
a size-1 dim held by one rank that must grow or vanish), the tensor first moves to the
cheapest layout that works, labelled ``auto-redistribute for <op>`` in the tracer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import Partial, Shard

from shardlab.engine import _common as c
from shardlab.engine.aten.dim_ops import _whole_on
from shardlab.engine.plans import LocalExpand, LocalReshape, LocalSlice, LocalView
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout, moves
from shardlab.layout.views import (
    Blocked,
    expand_layout,
    permute_layout,
    select_dims_layout,
    slice_layout,
    view_layout,
)

aten = torch.ops.aten


def _resolve(shape, numel: int) -> list[int]:
    shape = [int(n) for n in shape]
    if -1 in shape:
        known = 1
        for n in shape:
            if n != -1:
                known *= n
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def _unblocked(x, rule, what: str, tries: int = 4):
    """``(x, rule(x.sharding))``, moving ``x`` to the cheapest layout that lifts a block."""
    for _ in range(tries):
        try:
            return x, rule(x._layout)
        except Blocked as b:
            target = moves.cheapest(x._layout, moves.unblock(x._layout, b))
            x = c.move(x, target, f"auto-redistribute for {what}")
    return x, rule(x._layout)


def _recut_where_it_lies(x, mesh_dims):
    """``x`` as it is on every rank, its layout told another way, or None: a mesh dim of
    ``mesh_dims`` whose cut leaves all of a dim at one coordinate cuts instead the first
    dim no mesh dim cuts, all of it at that coordinate. No message: that rank's block is
    the same, the others' are empty either way::

        x[:, 0:1] (2, 1, 16) Shard(1) sizes [1, 0, 0]  ->  Shard(0) sizes [2, 0, 0]

    so that the size-1 dim may vanish (``x[:, 0]``, a view) where it lies."""
    lay = x._layout
    if not lay.is_block() or any(isinstance(p, Partial) for p in lay.placements):
        return None
    cut = [p.dim if isinstance(p, Shard) else None for p in lay.placements]
    for m in mesh_dims:
        d = cut[m]
        if d is None or cut.count(d) != 1:
            continue
        held = [q for q, n in enumerate(lay.shard_sizes(m)) if n]
        free = [f for f in range(x.ndim) if f != d and f not in cut]
        if len(held) != 1 or not free:
            continue
        places = list(lay.placements)
        places[m] = Shard(free[0])
        sizes = [lay.sizes_arg(k) for k in range(len(places))]
        sizes[m] = [x.shape[free[0]] if q == held[0] else 0 for q in range(lay.mesh_shape[m])]
        new = ShardLayout.build(tuple(x.shape), lay.mesh_shape, places, sizes)
        coord = c.me(x.device_mesh)
        local = x._local_tensor  # the owner's block; the others' empty: any shape views it
        if coord[m] != held[0]:
            local = local.view(new.local_shape(coord))
        return c.wrap(local, x.device_mesh, new)
    return None


def view_to(x, shape, what: str = "view", copy: bool = False):
    """``x`` viewed as ``shape`` (a ShardTensor), moving it first only if it must. If it
    had to (or the block was not viewable), the result writes back into ``x``."""
    shape = _resolve(shape, x.numel())
    base = x
    out = _whole_view(x._layout, shape, x.device_mesh)
    if out is None:
        try:
            out = view_layout(x._layout, shape)
        except Blocked as b:  # a dim one rank holds, to vanish: told where it lies
            told = _recut_where_it_lies(x, b.mesh_dims)
            if told is not None:
                with contextlib.suppress(Blocked):
                    out = view_layout(told._layout, shape)
                    x = base = told  # (its blocks are x's)
    if out is None:
        x, out = _unblocked(x, lambda lay: view_layout(lay, shape), what)
    local_shape = out.local_shape(c.me(x.device_mesh))
    local = x._local_tensor
    try:
        y = c.wrap(
            local.view(local_shape) if not copy else local.reshape(local_shape), x.device_mesh, out
        )
        viewed = not copy
    except (RuntimeError, ValueError):  # a non-viewable block (strided): copy (a fake
        # block under torch.compile says so with a ValueError)
        y, viewed = c.wrap(local.reshape(local_shape), x.device_mesh, out), False
        if x is base:
            return c.copied_local(y, base)
    if x is not base and not copy:
        return c.moved_view(y, base, x) if viewed else y
    return y


def _whole_view(layout, shape, mesh):
    """The view's layout when every rank holds all of it (any whole layout is its view),
    else None."""
    if not layout.is_whole():
        return None
    try:
        return view_layout(layout, shape)
    except Blocked:  # a cut of one rank in the way: no move, Replicate says the same
        return c.replicate_layout(shape, mesh)


def view_plan(func, x, shape, copy: bool = False):
    """The plan of ``x`` viewed (``copy``: reshaped) as ``shape`` when no move is needed:
    each rank views its own block as its extent of the result. None when ``x`` must
    move first (:func:`view_to` then)."""
    shape = _resolve(shape, x.numel())
    out = _whole_view(x._layout, shape, x.device_mesh)
    if out is None:
        try:
            out = view_layout(x._layout, shape)
        except Blocked:
            return None
    local_shape = out.local_shape(c.me(x.device_mesh))
    if copy:
        return Plan(x.device_mesh, out, local=LocalReshape(local_shape))
    # a block whose strides allow no view: a copy that writes back (not kept)
    return Plan(x.device_mesh, out, local=LocalView(local_shape), otherwise=_Copied(shape))


class _Copied:
    """A view of a block that cannot be viewed: :func:`view_to`'s copy."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape

    def __call__(self, func, args, kwargs):
        return view_to(args[0], self.shape, c.op_name(func))


def _viewed(func, x, shape, copy=False):
    """The plan of the view, or the view itself when ``x`` must move first."""
    plan = view_plan(func, x, shape, copy)
    return plan if plan is not None else view_to(x, shape, c.op_name(func), copy)


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten._reshape_alias.default,
    aten.view_copy.default,
)
def _view(func, args, kwargs):
    if func is aten.view_copy.default:  # a new tensor, never an alias of the input's block
        y = view_to(args[0], args[1], c.op_name(func), copy=True)
        return c.wrap(y._local_tensor.clone(), y.device_mesh, y._layout)
    return _viewed(func, args[0], args[1], copy=func is aten.reshape.default)


@register(aten.unsqueeze.default)
def _unsqueeze(func, args, kwargs):
    x, dim = args[0], args[1] % (args[0].ndim + 1)
    shape = list(x.shape)
    shape.insert(dim, 1)
    return _viewed(func, x, shape)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(func, args, kwargs):
    x = args[0]
    if func is aten.squeeze.default:
        dims = range(x.ndim)
    else:
        dims = args[1] if len(args) > 1 else kwargs["dim"]
        dims = [dims] if isinstance(dims, int) else dims
    drop = {d % max(x.ndim, 1) for d in dims if x.ndim and x.shape[d % x.ndim] == 1}
    shape = [n for d, n in enumerate(x.shape) if d not in drop]
    return _viewed(func, x, shape)


@register(aten.expand.default, aten.expand_copy.default)
def _expand(func, args, kwargs):
    x, shape = args[0], list(args[1])
    if func is aten.expand.default:
        try:  # each block expanded as it is
            out = expand_layout(x._layout, shape)
        except Blocked:
            pass
        else:
            local = LocalExpand(out.local_shape(c.me(x.device_mesh)))
            return Plan(x.device_mesh, out, local=local)
    x, out = _unblocked(x, lambda lay: expand_layout(lay, shape), "expand")
    y = LocalExpand(out.local_shape(c.me(x.device_mesh)))((x._local_tensor,), {})
    if func is aten.expand_copy.default:
        y = y.clone()
    return c.wrap(y, x.device_mesh, out)


@register(aten.expand_as.default)
def _expand_as(func, args, kwargs):
    return aten.expand.default(args[0], list(args[1].shape))


@register(
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute_copy.default,
    aten.transpose_copy.int,
)
def _permute(func, args, kwargs):
    x = args[0]
    n = x.ndim
    if func.overloadpacket in (aten.permute, aten.permute_copy):
        perm = [d % n for d in args[1]]
    else:
        d0, d1 = (0, 1) if func is aten.t.default else (args[1], args[2])
        perm = list(range(n))
        if n >= 2 or func is not aten.t.default:
            d0, d1 = d0 % max(n, 1), d1 % max(n, 1)
            perm[d0], perm[d1] = perm[d1], perm[d0]
    # the local op with the same arguments permutes the block the same way
    return Plan(x.device_mesh, permute_layout(x._layout, perm))


def _bounds(n: int, start, end, step) -> tuple[int, int, int]:
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start, end = min(max(start, 0), n), min(max(end, 0), n)
    return start, max(end, start), step


def slice_of(x, dim: int, start, end, step: int = 1, plan: bool = False):
    """``x[..., start:end:step, ...]`` along ``dim``: each rank slices its own block.
    ``plan``: the plan of it instead when ``x`` need not move first."""
    dim %= x.ndim
    start, end, step = _bounds(x.shape[dim], start, end, step)

    def rule(lay):
        if not lay.is_block(dim):
            cut = tuple(m for m, p in enumerate(lay.placements) if getattr(p, "dim", -1) == dim)
            raise Blocked(cut, 0, f"slicing strided dim {dim}")
        return slice_layout(lay, dim, start, end, step)

    base = x
    try:
        out = rule(x._layout)
    except Blocked:
        x = c.move(x, moves.as_block(x._layout, dim), "auto-redistribute for slice")
        out = rule(x._layout)
    if x._layout.is_block(dim):
        coord = c.me(x.device_mesh)
        o, n = x._layout._piece(dim, coord)
        lo = max(start, o)
        first = start + -(-(lo - start) // step) * step
        local = LocalSlice(dim, first - o, min(end, o + n) - o, step)
    else:
        local = LocalSlice(dim, start, end, step)
    if plan and x is base:  # this rank's slice of its block as it is
        return Plan(x.device_mesh, out, local=local)
    y = c.wrap(local((x._local_tensor,), {}), x.device_mesh, out)
    return c.moved_view(y, base, x) if x is not base else y


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if func is aten.slice.Tensor:
        return slice_of(x, dim, start, end, step, plan=True)
    y = slice_of(x, dim, start, end, step)
    return c.wrap(y._local_tensor.clone(), y.device_mesh, y._layout)


def select_of(x, dim: int, index: int):
    dim %= x.ndim
    n = x.shape[dim]
    index = index + n if index < 0 else index
    if not any(getattr(p, "dim", None) == dim for p in x._layout.placements):
        keep = [d for d in range(x.ndim) if d != dim]
        return c.wrap(
            x._local_tensor.select(dim, index), x.device_mesh, select_dims_layout(x._layout, keep)
        )
    row = slice_of(x, dim, index, index + 1)  # held by one rank
    shape = [m for d, m in enumerate(x.shape) if d != dim]
    return view_to(row, shape, "select")


@register(aten.select.int, aten.select_copy.int)
def _select(func, args, kwargs):
    y = select_of(args[0], args[1], args[2])
    return (
        y if func is aten.select.int else c.wrap(y._local_tensor.clone(), y.device_mesh, y._layout)
    )


@register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.split_copy.Tensor,
    aten.split_with_sizes_copy.default,
)
def _split(func, args, kwargs):
    x, size = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    n = x.shape[dim]
    if isinstance(size, int):
        sizes = [min(size, n - i) for i in range(0, n, size)] if size else [n]
        sizes = sizes or [0]
    else:
        sizes = list(size)
    out, at = [], 0
    for s in sizes:
        out.append(slice_of(x, dim, at, at + s))
        at += s
    return out


@register(aten.unbind.int, aten.unbind_copy.int)
def _unbind(func, args, kwargs):
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    cut = tuple(m for m, p in enumerate(x._layout.placements) if getattr(p, "dim", -1) == dim)
    if len(cut) == 1:
        got = _unbind_where_they_lie(x, dim, cut[0], func is aten.unbind_copy.int)
        if got is not None:
            return got
    if cut:  # (a dim cut twice, or slices with no free dim): gathered once
        x = c.move(x, moves.replicated(x._layout, cut), "auto-redistribute for unbind")
    return [select_of(x, dim, i) for i in range(x.shape[dim])]


def _unbind_where_they_lie(x, dim: int, m: int, copy: bool):
    """``unbind`` along ``dim``, cut by mesh dim ``m``: each slice stays on the rank that
    holds it, no message. On mesh dim ``m`` a slice is cut along its first dim no other
    mesh dim cuts, all of it at its owner's coordinate (sizes ``[0, .., n, .., 0]``)::

        x (5, 4) Shard(0) sizes [2, 0, 3]  ->  x[0], x[1]: (4,) Shard(0) sizes [4, 0, 0]
                                               x[2..4]:    (4,) Shard(0) sizes [0, 0, 4]

    Where no such dim exists (a 1-D x: its slices are numbers), each slice is Partial(sum)
    on mesh dim ``m``: its value at its owner, zeros at the others (still no message).
    None for a Partial x (a slice written there would be summed twice)."""
    lay = x._layout
    if not lay.is_block():
        return None
    keep = [d for d in range(x.ndim) if d != dim]
    places = [Shard(keep.index(p.dim)) if isinstance(p, Shard) and k != m else p
              for k, p in enumerate(lay.placements)]  # fmt: skip
    taken = {p.dim for k, p in enumerate(places) if isinstance(p, Shard) and k != m}
    free = [e for e in range(len(keep)) if e not in taken]
    shape = [x.shape[d] for d in keep]
    coord, sizes = c.me(x.device_mesh), lay.shard_sizes(m)
    entry = [lay.sizes_arg(k) for k in range(len(places))]
    if not free:  # (numbers, or every dim cut otherwise): Partial(sum), zeros elsewhere
        if x.dtype == torch.bool or any(isinstance(p, Partial) for p in places):
            return None
        places[m], entry[m] = Partial(), None
    else:
        places[m] = Shard(free[0])
    out = []
    for q, s in enumerate(sizes):
        if free:
            entry[m] = [shape[free[0]] if r == q else 0 for r in range(len(sizes))]
        y_lay = ShardLayout.build(tuple(shape), lay.mesh_shape, places, entry)
        for i in range(s):
            if coord[m] == q:
                y = x._local_tensor.select(dim, i)
                y = y.clone() if copy else y
            elif free:
                y = x._local_tensor.new_empty(y_lay.local_shape(coord))
            else:
                y = x._local_tensor.new_zeros(y_lay.local_shape(coord))
            out.append(c.wrap(y, x.device_mesh, y_lay))
    return out


@register(aten.view_as_real.default, aten.view_as_complex.default)
def _view_as(func, args, kwargs):
    x = args[0]
    if func is aten.view_as_complex.default and any(
        getattr(p, "dim", None) == x.ndim - 1 for p in x._layout.placements
    ):  # the pairs cut apart: the cut moves to another dim (one all-to-all), or, for a
        # 1-D x (a 0-d result), that mesh dim becomes Replicate (said)
        x = c.move(
            x,
            _whole_on(x._layout, [x.ndim - 1], cut_first=True),
            "auto-redistribute for view_as_complex",
        )
    y = func(x._local_tensor)
    lay = x._layout
    if func is aten.view_as_real.default:
        atoms = None if lay.atoms is None else lay.atoms + (None,)
        out = lay.replace(global_shape=tuple(x.shape) + (2,), atoms=atoms)
    else:
        atoms = None if lay.atoms is None else lay.atoms[:-1]
        out = lay.replace(global_shape=tuple(x.shape[:-1]), atoms=atoms)
    return c.wrap(y, x.device_mesh, out)


@register(aten.unfold.default)
def _unfold(func, args, kwargs):
    """``Tensor.unfold`` along a dim no mesh dim cuts: every rank unfolds its block (a cut
    dim takes halos: :func:`shardlab.ops.unfold.tensor_unfold`, from ``__torch_function__``)."""
    x, dim, size, step = args
    dim %= max(x.ndim, 1)
    if any(getattr(p, "dim", None) == dim for p in x._layout.placements):
        return NotImplemented
    y = func(x._local_tensor, dim, size, step)
    lay = x._layout
    shape = list(x.shape)
    shape[dim] = y.shape[dim]
    atoms = None if lay.atoms is None else lay.atoms + (None,)
    return c.wrap(y, x.device_mesh, lay.replace(global_shape=(*shape, size), atoms=atoms))
