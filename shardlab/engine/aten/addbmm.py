"""``addbmm``: ``beta * input + alpha * sum_b batch1[b] @ batch2[b]`` on the blocks.

``batch1 (B, N, M)``, ``batch2 (B, M, P)``, ``input`` broadcasting to ``(N, P)``. The
product's layout is ``bmm``'s (:func:`shardlab.layout.matmul.mm_strategies`, the
strategy whose operand moves cost the fewest elements), with the batch dim summed away::

    per mesh dim     batch1 / batch2             bmm (B, N, P)   addbmm (N, P)
    B                both cut alike on B         Shard(0)        Partial(sum)
    M                cut alike on M              Partial(sum)    Partial(sum)
    N                batch1 cut on N, b2 whole   Shard(1)        Shard(0)   (input's rows)
    P                batch1 whole, b2 cut on P   Shard(2)        Shard(1)   (input's cols)

1. ``batch1`` and ``batch2`` moved to the cheapest strategy (none when already cut so,
   or plain: a slice), ``input`` laid out as its part of the result (its rows / cols
   where the result is cut, whole where it is Partial; a Partial input summed first)
2. ``addbmm`` of this rank's blocks. Where the result is Partial(sum), the ranks'
   results are summed later, so ``beta * input`` must be in one of them only: the rank
   at coordinate 0 of every Partial mesh dim adds it, the others run with ``beta = 0``
   (torch's meaning: ``input`` ignored, nan and inf included)

     x (5, 10) rows cut [1, 3, 1], batch1 (5, 5, 5), batch2 (5, 5, 10) plain:
       rank r: addbmm(x rows, batch1[:, rows], batch2)  ->  rows of the result

Messages: none when the operands are cut to fit (the N / P cuts, the B / M cuts with
the partial sum left for its reader); else the cheapest moves of the operands, said as
``addbmm.align``. Backward is autograd's formula (``mm``, ``sum``, ``mul``: rules).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout
from shardlab.layout.elementwise import reduce_layout, restrict
from shardlab.layout.matmul import mm_strategies
from shardlab.layout.moves import move_cost

aten = torch.ops.aten


@register(aten.addbmm.default)
def addbmm(func, args, kwargs):
    inp, b1, b2 = args[0], args[1], args[2]
    mesh = c.the_mesh(c.shards_in((inp, b1, b2)))
    if b1.ndim != 3 or b2.ndim != 3 or len(args) > 3 or inp.ndim > 2:
        return NotImplemented  # (torch's meta check refused these already; beta as kw)
    st = c.ShardTensor
    b1 = b1 if isinstance(b1, st) else c.as_shard(b1, mesh)
    b2 = b2 if isinstance(b2, st) else c.as_shard(b2, mesh)
    # 1. bmm's cheapest strategy, its batch dim summed away
    options = list(mm_strategies(b1._layout, b2._layout, True))
    if isinstance(inp, st):  # (and those the input's own cut suggests: its rows / cols)
        options += _suggested(inp, b1, b2)
    t1, t2, prod = min(options, key=lambda o: move_cost(b1._layout, o[0])
                       + move_cost(b2._layout, o[1])
                       + _input_cost(inp, reduce_layout(o[2], [0], False)))  # fmt: skip
    out = reduce_layout(prod, [0], False)
    want = restrict(out, tuple(inp.shape), [False] * mesh.ndim)
    if isinstance(inp, st):
        moved = None if inp._layout == want else want
    else:
        moved = None if want == c.replicate_layout(tuple(inp.shape), mesh) else want
    moves = [moved, None if t1 == b1._layout else t1, None if t2 == b2._layout else t2]
    moves += [None] * len(kwargs)
    partial = [m for m, p in enumerate(out.placements) if isinstance(p, Partial)]
    local = _Once(mesh, partial) if partial else None
    return Plan(mesh, out, moves, "addbmm.align", local=local)


def _suggested(inp, b1, b2) -> list:
    """bmm's strategies for operands cut on N / P as the input is on its rows / cols (a
    2-D input cut in blocks); none for any other input."""
    lay = inp._layout
    if inp.ndim != 2 or tuple(inp.shape) != (b1.shape[1], b2.shape[2]) or not lay.is_block():
        return []
    p1, p2, s1, s2 = [], [], [], []
    for m, p in enumerate(lay.placements):
        cut = isinstance(p, Shard)
        p1.append(Shard(1) if cut and p.dim == 0 else Replicate())
        p2.append(Shard(2) if cut and p.dim == 1 else Replicate())
        s1.append(lay.sizes_arg(m) if cut and p.dim == 0 else None)
        s2.append(lay.sizes_arg(m) if cut and p.dim == 1 else None)
    mesh_shape = lay.mesh_shape
    try:
        a = ShardLayout.build(tuple(b1.shape), mesh_shape, p1, s1)
        b = ShardLayout.build(tuple(b2.shape), mesh_shape, p2, s2)
    except ValueError:
        return []
    return list(mm_strategies(a, b, True))


def _input_cost(inp, out) -> int:
    """Elements the input moves to be laid out as its part of ``out``."""
    if not isinstance(inp, c.ShardTensor):
        return 0
    return move_cost(inp._layout, restrict(out, tuple(inp.shape), [False] * len(out.mesh_shape)))


class _Once:
    """Step 2 on a Partial result: ``beta * input`` on the rank at coordinate 0 of every
    Partial mesh dim only (the coordinate read when it runs: the plan is every rank's)."""

    __slots__ = ("mesh", "partial")

    def __init__(self, mesh, partial):
        self.mesh, self.partial = mesh, partial

    def __call__(self, args, kwargs):
        coord = c.me(self.mesh)
        if any(coord[m] != 0 for m in self.partial):
            kwargs = {**kwargs, "beta": 0}
        return aten.addbmm.default(*args, **kwargs)
