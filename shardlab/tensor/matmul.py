"""``x @ W`` and ``F.linear`` on a ShardTensor with batch dims, without reshaping.

torch decomposes a 3-D ``matmul`` into ``view(B*T, C) @ W``: that view merges a
sharded dim with another one, which no even-or-uneven block layout can express.
Here the product runs on the local block directly::

    x  (B, T_local, C)   sharded on any dim but the last
    W  (C, N)            replicated
    y  (B, T_local, N)   sharded like x                        (no communication)

    backward:  dx = dy @ W^T                      sharded like x
               dW = sum over local rows of x^T dy  Partial(sum) on the mesh dims
                    that shard x (one all-reduce when it is read)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardlab.comm._once import first_order
from shardlab.comm.recompute import fenced, kept
from shardlab.layout import ShardLayout


def wants_local_matmul(x, w) -> bool:
    from shardlab.tensor.api import ShardTensor

    if not isinstance(x, ShardTensor) or x.ndim < 3 or w.ndim != 2:
        return False
    if any(isinstance(p, Partial) for p in x.placements):
        return False
    if any(isinstance(p, Shard) and p.dim == x.ndim - 1 for p in x.placements):
        return False
    if isinstance(w, ShardTensor):
        return all(isinstance(p, Replicate) for p in w.placements)
    return not isinstance(w, DTensor)


def local_matmul(x, w):
    from shardlab.tensor.api import ShardTensor, distribute

    if not isinstance(w, ShardTensor):
        w = distribute(w, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return _LocalMatmul.apply(x, w)


@fenced
class _LocalMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        from shardlab.tensor.api import ShardTensor

        ctx.save_for_backward(x, w)
        y = x._local_tensor @ w._local_tensor  # (..., N) on this rank's rows
        lay = x._layout
        layout = ShardLayout(
            lay.global_shape[:-1] + (w.shape[1],), lay.mesh_shape, lay.placements, lay.sizes
        )
        return ShardTensor._wrap(y, x.device_mesh, layout)

    @staticmethod
    @first_order("matmul")
    def backward(ctx, dy):
        from shardlab.tensor.api import ShardTensor, _local_of

        x, w = kept(ctx)
        lay = x._layout
        dy_layout = ShardLayout(
            lay.global_shape[:-1] + (w.shape[1],), lay.mesh_shape, lay.placements, lay.sizes
        )
        dy_local = _local_of(dy, dy_layout, x.device_mesh)
        dx = ShardTensor._wrap(dy_local @ w._local_tensor.t(), x.device_mesh, lay)
        rows = x._local_tensor.reshape(-1, x.shape[-1])  # (rows_local, C)
        dw_local = rows.t() @ dy_local.reshape(-1, dy_local.shape[-1])  # (C, N) partial
        places = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in lay.placements)
        dw_layout = ShardLayout(tuple(w.shape), lay.mesh_shape, places, (None,) * len(places))
        return dx, ShardTensor._wrap(dw_local, x.device_mesh, dw_layout)
