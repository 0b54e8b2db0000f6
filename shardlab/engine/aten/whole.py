"""An op with no rule, on tensors every rank holds whole: torch's op on the blocks.

When every ShardTensor argument is whole (:meth:`ShardLayout.is_whole`: a 1-rank mesh, or
no mesh dim of more than one rank cuts it, nothing Partial), each rank's block *is* the
global tensor, so torch's own op on the blocks is the one-device op::

    rank r:  block (whole)  --func-->  result (whole)       no message, every rank alike

Without this, an op with no rule took torch's decomposition (``native_batch_norm`` into
``var_mean``, ``broadcast_in_dim``, … each decided in turn) or the whole-tensor fallback,
every call: ~700 µs for ``torch.batch_norm`` on one rank, where the kernel takes ~10.

A result keeps the placements of an argument with as many dims, preferring one that is
``Shard`` somewhere (``Shard`` on a mesh dim of one rank stays ``Shard``), else it is
``Replicate``. It is a
plan like a rule's (:class:`~shardlab.engine.rule.Plan`), kept per signature.

Not for: ops that write an argument, random ops (their rules define the draws), views
(their global strides are the dispatcher's, not the block's), ops whose results are not
all tensors, and arguments of other kinds of distributed tensor.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Replicate

from shardlab.engine import _common as c
from shardlab.engine.rule import BLOCKS, Plan
from shardlab.layout import ShardLayout

__all__ = ["on_blocks", "whole_arguments"]

_LAYOUTS: dict = {}  # (layout, shape) -> the result's layout
_SIZE = 4096
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
