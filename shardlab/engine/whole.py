"""Every rank holds every argument whole: torch's own op on the blocks, no message.

A ShardTensor is *whole* (:meth:`ShardLayout.is_whole`) when no mesh dim of more than one
rank cuts it and nothing is Partial: on a 1-rank mesh, or ``Shard`` only on mesh dims of
one rank and ``Replicate`` on the others (a strided dim, ``logits.view(-1, V)`` of a cut
sequence, too)::

    mesh (2, 1), placements [Replicate(), Shard(2)]:   rank (0, 0): all of H
                                                       rank (1, 0): all of H (the same)

Then each rank's block *is* the global tensor, and torch's own op on the blocks is the
single-device call: torch's checks and errors (the same shapes on every rank, so the same
error everywhere), its strides, its exact means; at both levels an op is reached:

- **aten** (an op with no rule, :func:`on_blocks`; the scan :func:`whole_arguments`
  takes lists of ShardTensors, cat's, and plain tensors as they are): the plan "the op
  on the blocks", kept per signature like a rule's. Without it, an op with no rule took
  torch's decomposition (``native_batch_norm`` into ``var_mean``, ``broadcast_in_dim``, …
  each planned in turn) or the whole-tensor fallback, every call: ~700 µs for
  ``torch.batch_norm`` on one rank, where the kernel takes ~10. A result keeps the
  placements of an argument with as many dims, preferring one that is ``Shard``
  somewhere, else it is ``Replicate``. Not for: ops that write an argument, random ops
  (their rules define the draws), views (their global strides are the dispatcher's, not
  the block's), ops whose results are not all tensors.
- **F level** (:func:`whole_call`, before a family's handler: conv, pooling, padding,
  norms, interpolation, linear, attention, cross-entropy): torch's ``F.<name>`` on the
  blocks under autograd, one node (halos, plans and meta checks cost tens of microseconds
  a call for nothing here). The result is laid out like the first ShardTensor argument
  (its ``Shard`` dims hold one piece: the whole length), or Replicate on every mesh dim
  when its number of dims differs; the families add their own cases (:data:`RESULT`,
  :data:`ONLY_IF`). Backward runs through torch's autograd on the blocks. Its scan
  looks at distributed arguments only (under ``torch.compile`` the plain ones are
  dynamo's fake tensors) and refuses lists of tensors.

Neither applies to arguments of other kinds of distributed tensor.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.rule import BLOCKS, Plan
from shardlab.layout import ShardLayout
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.create import from_layout
from shardlab.tensor.functions import ToLocal, records

__all__ = ["NAMES", "on_blocks", "whole_arguments", "whole_call"]

_SIZE = 4096


# -- aten: the plan for an op with no rule ---------------------------------------------
_LAYOUTS: dict = {}  # (layout, shape) -> the result's layout
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def on_blocks(func, args, kwargs, meta):
    """The plan "``func`` on the blocks, its results whole"; None when it does not apply."""
    if meta is None or not _eligible(func):
        return None
    metas = meta if isinstance(meta, (list, tuple)) else (meta,)
    if not metas or not all(
        isinstance(m, torch.Tensor) and m.layout == torch.strided for m in metas
    ):
        return None
    scanned = whole_arguments(args, kwargs)
    if scanned is None:
        return None
    moves, first, whole = scanned
    layouts = tuple(_layout(whole, tuple(m.shape)) for m in metas)
    return Plan(
        first.device_mesh, layouts if isinstance(meta, (list, tuple)) else layouts[0], moves
    )


def whole_arguments(args, kwargs):
    """``(moves, first, layouts)`` when every ShardTensor argument (alone or in a list of
    them, cat's) is whole and all are on one mesh: a move per argument (None, or
    :data:`~shardlab.engine.rule.BLOCKS` for a list), the first ShardTensor, their
    layouts; else None (also for another tensor subclass, or a list mixing ShardTensors
    with other things). Plain tensors, alone or in lists, are taken as they are."""
    st = c.ShardTensor
    first, moves, whole = None, [], []
    for a in (*args, *kwargs.values()):
        if type(a) in (list, tuple) and any(isinstance(t, torch.Tensor) for t in a):
            if type(a) is list and all(type(t) is st for t in a):
                sts, move = a, BLOCKS  # cat's
            elif any(type(t) is st or isinstance(t, DTensor) for t in a):
                return None  # ShardTensors mixed with other things (index's [None, idx])
            else:
                sts, move = (), None  # plain tensors (index's plain indices): as they are
        elif isinstance(a, torch.Tensor):
            if type(a) is not st and type(a) not in _PLAIN:
                return None  # another subclass (a plain DTensor is adopted before)
            sts, move = ((a,) if type(a) is st else ()), None
        else:
            sts, move = (), None
        for t in sts:
            if not t._layout.is_whole():
                return None
            if first is not None and t.device_mesh is not first.device_mesh:
                if t.device_mesh != first.device_mesh:  # an equal mesh (a lifted parameter's)
                    return None
            if first is None:
                first = t
            whole.append(t._layout)
        moves.append(move)
    if first is None:
        return None
    return moves, first, whole


def _layout(whole: list, shape: tuple) -> ShardLayout:
    """A whole result of ``shape`` made from whole arguments laid out as ``whole``: the
    layout of one whose cut (or view-merged) dims the result has alike (``addmm``'s rows),
    else the placements of one with as many dims, sizes made whole; else ``Replicate``.
    Those with a ``Shard`` come first."""
    key = (*whole, shape)
    hit = _LAYOUTS.get(key)
    if hit is None:
        hit = _make_layout(whole, shape)
        if len(_LAYOUTS) >= _SIZE:
            _LAYOUTS.clear()
        _LAYOUTS[key] = hit
    return hit


def _make_layout(whole: list, shape: tuple) -> ShardLayout:
    def first(layouts):
        cut = [lay for lay in layouts if any(p.is_shard() for p in lay.placements)]
        return (cut or layouts or [None])[0]

    same = [lay for lay in whole if len(lay.global_shape) == len(shape)]
    like = first([lay for lay in same if _fits(lay, shape)])
    if like is not None:  # the same dims cut (and merged by views), other dims resized
        return dataclasses.replace(like, global_shape=shape)
    like = first(same)
    if like is not None:
        places = like.placements
        sizes = [[shape[p.dim]] if p.is_shard() else None for p in places]
        return ShardLayout.build(shape, like.mesh_shape, places, sizes)
    mesh_shape = whole[0].mesh_shape
    return ShardLayout.build(shape, mesh_shape, [Replicate()] * len(mesh_shape))


def _fits(layout: ShardLayout, shape: tuple) -> bool:
    """Does ``shape`` keep every dim ``layout`` cuts or describes in atoms?"""
    kept = {p.dim for p in layout.placements if p.is_shard()}
    if layout.atoms is not None:
        kept |= {d for d, a in enumerate(layout.atoms) if a is not None}
    return all(shape[d] == layout.global_shape[d] for d in kept)


_ELIGIBLE: dict = {}


def _eligible(func) -> bool:
    hit = _ELIGIBLE.get(func)
    if hit is None:
        schema = func._schema
        hit = _ELIGIBLE[func] = not (
            c.written_args(func)
            or torch.Tag.nondeterministic_seeded in func.tags
            or any(r.alias_info is not None for r in schema.returns)  # a view
            or not schema.returns
        )
    return hit


# -- F level: torch's F.<name> on the blocks, under autograd ----------------------------
NAMES = frozenset(
    {f"conv{n}d" for n in (1, 2, 3)}
    | {f"conv_transpose{n}d" for n in (1, 2, 3)}
    | {f"{kind}_pool{n}d" for kind in ("max", "avg") for n in (1, 2, 3)}
    | {f"adaptive_{kind}_pool{n}d" for kind in ("max", "avg") for n in (1, 2, 3)}
    | {"linear", "pad", "interpolate", "batch_norm", "group_norm", "instance_norm"}
    | {"scaled_dot_product_attention", "cross_entropy"}
)


# filled by the families (shardlab.ops), which know their own calls:
ONLY_IF: dict = {}  # name -> (args, kwargs) -> may this call take the whole path?
RESULT: dict = {}  # name -> (layout, shape) -> a result whose dims are not the input's
_OUT: dict = {}  # (input layout, output shape) -> the output's layout


def out_layout(layout, shape: tuple, name: str = ""):
    """The layout of a whole result of ``shape`` computed by ``F.<name>`` from a whole
    input in ``layout``."""
    key = (layout, shape, name)
    hit = _OUT.get(key)
    if hit is None:
        rule = RESULT.get(name)
        hit = rule(layout, shape) if rule is not None else None
        if hit is None and len(shape) == len(layout.global_shape):  # the input's dims
            places = layout.placements
            sizes = [[shape[p.dim]] if isinstance(p, Shard) else None for p in places]
            hit = ShardLayout.build(shape, layout.mesh_shape, places, sizes)
        elif hit is None:
            places = [Replicate()] * len(layout.mesh_shape)
            hit = ShardLayout.build(shape, layout.mesh_shape, places)
        if len(_OUT) >= _SIZE:
            _OUT.clear()
        _OUT[key] = hit
    return hit


def whole_call(name, original, args, kwargs):
    """``original(*args, **kwargs)`` (torch's ``F.<name>``) on the blocks when every
    ShardTensor argument is whole (one mesh, no other distributed argument, no list of
    tensors), its tensor results wrapped; else NotImplemented (the sharded handler)."""
    layout = getattr(args[0], "_layout", None) if args else None
    if layout is not None and not layout.is_whole():
        return NotImplemented  # the common sharded call: one cached answer
    only_if = ONLY_IF.get(name)
    if only_if is not None and not only_if(args, kwargs):
        return NotImplemented
    first = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            if (
                type(a) is not ShardTensor
                or not a._layout.is_whole()
                or (first is not None and a.device_mesh is not first.device_mesh)
                or getattr(a, "_whole_to_local", False)
            ):
                return NotImplemented
            if first is None:
                first = a
        elif type(a) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in a):
            return NotImplemented
    if first is None:
        return NotImplemented

    mesh, layout = first.device_mesh, first._layout
    if records((*args, *kwargs.values())):
        args, kwargs = _blocks(args, kwargs, first, ShardTensor)
        make = from_layout
    else:  # nothing for autograd to record: the blocks as they are, no Function
        args = [a._local_tensor if type(a) is ShardTensor else a for a in args]
        kwargs = {k: v._local_tensor if type(v) is ShardTensor else v for k, v in kwargs.items()}
        make = ShardTensor._wrap
    out = original(*args, **kwargs)

    def wrap(y):
        if not isinstance(y, torch.Tensor):
            return y
        return make(y, mesh, out_layout(layout, tuple(y.shape), name), stride=y.stride())

    return tuple(wrap(y) for y in out) if type(out) is tuple else wrap(out)


def _blocks(args, kwargs, first, st):
    """``(args, kwargs)`` with each ShardTensor's block, differentiably: one autograd
    Function for all of them (attention's q, k, v: one node, not three)."""
    kw = list(kwargs)
    flat = [*args, *kwargs.values()]
    at = [i for i, a in enumerate(flat) if type(a) is st]
    if len(at) == 1:
        flat[at[0]] = ToLocal.apply(first, first._layout)
    else:
        for i, block in zip(at, _Blocks.apply(*[flat[i] for i in at])):
            flat[i] = block
    n = len(args)
    return flat[:n], dict(zip(kw, flat[n:]))


class _Blocks(torch.autograd.Function):
    """Each ShardTensor's block (a view); backward: each block's gradient laid out like
    its ShardTensor (whole, the same on every rank)."""

    @staticmethod
    def forward(ctx, *sts):
        ctx.how = [(t.device_mesh, t._layout) for t in sts]
        return tuple(t._local_tensor.view_as(t._local_tensor) for t in sts)

    @staticmethod
    def backward(ctx, *grads):
        if records(grads):  # a double backward is recorded (create_graph=True)
            return tuple(from_layout(g, m, lay) for g, (m, lay) in zip(grads, ctx.how))
        return tuple(ShardTensor._wrap(g, m, lay) for g, (m, lay) in zip(grads, ctx.how))
