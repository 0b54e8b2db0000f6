"""Every rank holds the whole tensor: torch's own ``F.<name>`` on the blocks.

A ShardTensor is *whole* when no mesh dim of more than one rank cuts it and nothing is
Partial: on a 1-rank mesh, or ``Shard`` only on mesh dims of one rank and ``Replicate``
on the others (a strided dim, ``logits.view(-1, V)`` of a cut sequence, too)::

    mesh (2, 1), placements [Replicate(), Shard(2)]:   rank (0, 0): all of H
                                                       rank (1, 0): all of H (the same)

Then each rank's block *is* the global tensor, and torch's own op on the blocks is the
single-device call: torch's checks and errors (the same shapes on every rank, so the
same error everywhere), its autocast, its strides, its exact means; no message. The
windowed families (conv, pooling, padding, norms, interpolation), linear, attention and
cross-entropy take this path before their sharded handler: halos, plans and meta checks
cost tens of microseconds a call for nothing here (layer_norm's own whole-rows path, one
autograd Function, is cheaper than this one's two).

The result is laid out like the first ShardTensor argument (its ``Shard`` dims hold one
piece: the whole length), or Replicate on every mesh dim when its number of dims differs.
Backward runs through torch's autograd on the blocks (the input's block gradient is laid
out like the input: the same on every rank).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardlab.tensor.functions import records

__all__ = ["NAMES", "whole_call"]

NAMES = frozenset(
    {f"conv{n}d" for n in (1, 2, 3)}
    | {f"conv_transpose{n}d" for n in (1, 2, 3)}
    | {f"{kind}_pool{n}d" for kind in ("max", "avg") for n in (1, 2, 3)}
    | {f"adaptive_{kind}_pool{n}d" for kind in ("max", "avg") for n in (1, 2, 3)}
    | {"linear", "pad", "interpolate", "batch_norm", "group_norm", "instance_norm"}
    | {"scaled_dot_product_attention", "cross_entropy"}
)


def _no_dropout(args, kwargs) -> bool:
    """Attention's dropout follows shardlab's own mask definition (the same on any mesh,
    ``ops/_attn_dropout.py``), not torch's generator: only dropout-free calls qualify."""
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return p == 0


def _loss_rows(layout, shape):
    """cross_entropy's per-row losses (``reduction="none"``): the input's layout without
    the class dim, as the sharded handler gives them."""
    from shardlab.ops._ce_args import rows_layout

    if len(shape) != len(layout.global_shape) - 1:
        return None
    return rows_layout(layout, 1 if len(layout.global_shape) > 1 else 0)


_ONLY_IF = {"scaled_dot_product_attention": _no_dropout}
_RESULT = {"cross_entropy": _loss_rows}  # a result whose dims are not the input's
_OUT: dict = {}  # (input layout, output shape) -> the output's layout
_SIZE = 4096


def out_layout(layout, shape: tuple, name: str = ""):
    """The layout of a whole result of ``shape`` computed by ``F.<name>`` from a whole
    input in ``layout``."""
    from shardlab.layout import ShardLayout

    key = (layout, shape, name)
    hit = _OUT.get(key)
    if hit is None:
        rule = _RESULT.get(name)
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
    from shardlab.tensor.api import ShardTensor
    from shardlab.tensor.create import from_layout

    only_if = _ONLY_IF.get(name)
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
    from shardlab.tensor.functions import ToLocal

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
        from shardlab.tensor.api import ShardTensor
        from shardlab.tensor.create import from_layout

        if records(grads):  # a double backward is recorded (create_graph=True)
            return tuple(from_layout(g, m, lay) for g, (m, lay) in zip(grads, ctx.how))
        return tuple(ShardTensor._wrap(g, m, lay) for g, (m, lay) in zip(grads, ctx.how))
