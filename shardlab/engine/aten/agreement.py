"""Whether two tensors agree: ``allclose`` and ``equal``, one flag per rank, never the tensors.

``torch.allclose(x, y, rtol, atol, equal_nan)`` and ``torch.equal(x, y)`` answer a Python
bool. With ``x`` and ``y`` cut alike, each rank compares its own blocks, and the answer
is the AND of the ranks' answers::

    x, y (9, 5) rows cut [4, 3, 2]:
      rank 0: rows 0-3 of x and y  ->  True      (an empty block: True)
      rank 1: rows 4-6             ->  False
      rank 2: rows 7-8             ->  True      all-reduce MIN  ->  False on every rank

1. both laid out as the first ShardTensor among them, Partial values summed first
   (``y`` already cut like ``x``: no message; a plain tensor: a slice of it; a
   ShardTensor cut otherwise: moved, said as ``allclose.align``); an operand that
   broadcasts (``allclose`` only) is laid out as its part of the other's layout
2. the op on this rank's blocks: a bool                                      (one flag)
3. one all-reduce (MIN) of that flag, a uint8, over each mesh dim that cuts the
   tensors; the Replicate mesh dims hold the same flag already

``equal``: shapes that differ are False on every rank (torch's answer) before any
message; dtypes that differ raise torch's error (its meta check). Messages: one
all-reduce of one byte per cutting mesh dim (plus the alignment, when the two are cut
differently). Not differentiable (a bool).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout.elementwise import restrict
from shardlab.trace import label

aten = torch.ops.aten


@register(aten.allclose.default, aten.equal.default)
def agreement(func, args, kwargs):
    x, y = args[0], args[1]
    name = c.op_name(func)
    shards = [a for a in (x, y) if isinstance(a, c.ShardTensor)]
    if func is aten.equal.default and tuple(x.shape) != tuple(y.shape):
        return False  # 0. torch's answer, from the global shapes alone
    shape = c.broadcast_shapes([tuple(x.shape), tuple(y.shape)])
    first = shards[0]
    if tuple(first.shape) != tuple(shape):  # (the cut operand broadcasts: the other's)
        return NotImplemented
    mesh = first.device_mesh
    lay = c.without_partial(first._layout)
    # 1. both laid out as the first ShardTensor (its part of it, for a broadcast operand)
    blocks = []
    for a in (x, y):
        want = restrict(lay, tuple(a.shape), [False] * mesh.ndim)
        a = a if isinstance(a, c.ShardTensor) else c.as_shard(a, mesh)
        blocks.append(c.move(c.reduced(a, f"{name}.partial"), want, f"{name}.align")._local_tensor)
    flag = func(*blocks, *args[2:], **kwargs)  # 2. this rank's answer
    cut = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and mesh.shape[m] > 1]
    if not cut:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.uint8, device=blocks[0].device)
    with label(f"{name}.reduce"):  # 3. the AND of the ranks' answers
        for m in cut:
            collectives.all_reduce_(t, dist.ReduceOp.MIN, mesh.get_group(m))
    return bool(t.item())
