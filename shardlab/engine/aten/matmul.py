"""``mm`` / ``bmm`` on ShardTensors (``matmul``, ``linear``, ``einsum`` decompose into them).

The strategy (see :mod:`shardlab.layout.matmul`) is the one whose operand moves cost the
fewest elements; then the product runs on the local blocks. Typical cases, no message::

    x (B*T, C) rows cut  @  W (C, N) whole   ->  y rows cut          (a linear layer)
    dy^T (N, B*T) @ x (B*T, C), both cut alike on B*T  ->  dW Partial(sum)
                                             (summed once, when the gradient is read)
"""

from __future__ import annotations

import torch

from shardlab.engine import _common as c
from shardlab.engine.rule import Plan
from shardlab.layout.matmul import mm_strategies
from shardlab.layout.moves import move_cost

from .registry import register

aten = torch.ops.aten


@register(aten.mm.default, aten.bmm.default)
def _mm(func, args, kwargs):
    a, b = args[0], args[1]
    st = c.ShardTensor
    mesh = c.the_mesh(c.shards_in((a, b)))
    a = a if isinstance(a, st) else c.as_shard(a, mesh)
    b = b if isinstance(b, st) else c.as_shard(b, mesh)
    options = mm_strategies(a._layout, b._layout, func is aten.bmm.default)
    ta, tb, out = min(
        options, key=lambda o: move_cost(a._layout, o[0]) + move_cost(b._layout, o[1])
    )
    moves = [None if ta == a._layout else ta, None if tb == b._layout else tb]
    moves += [None] * (len(args) + len(kwargs) - 2)
    return Plan(mesh, out, moves, f"{c.op_name(func)}.align")  # the product of the blocks
