"""DTensors shardlab did not make (``distribute_tensor``, ``parallelize_module``), as
ShardTensors of the same blocks: DTensor's ``torch.chunk`` sizes are one layout among others.

Nothing moves. The DTensor's gradient comes back as a DTensor with the original placements
(Partial read as Replicate), a sum over the ranks still pending where it is Replicate (a
parameter: ``Partial()``, as torch's backward leaves it), so torch's own ops keep working.
"""

from __future__ import annotations

import torch

from shardlab.comm._once import first_order, passes_no_gradient
from shardlab.comm.recompute import fenced
from shardlab.layout.dtensor import layout_of_dtensor
from shardlab.tensor import api, functions

__all__ = ["from_dtensor"]


@fenced
@passes_no_gradient
class _FromDTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, layout):
        ctx.mesh, ctx.layout, ctx.placements = dt.device_mesh, layout, dt.placements
        ctx.shape, ctx.stride = dt.shape, dt.stride()
        return api.ShardTensor._wrap(dt._local_tensor, dt.device_mesh, layout, stride=dt.stride())

    @staticmethod
    @first_order("a DTensor made a ShardTensor")
    def backward(ctx, grad):
        mesh, places = ctx.mesh, ctx.placements
        return functions.dtensor_grad(
            grad, mesh, ctx.layout, mesh, places, ctx.shape, ctx.stride
        ), None


def from_dtensor(dt):
    """A plain DTensor as a ShardTensor of the same blocks (DTensor's chunk sizes), nothing
    moved, differentiably: the DTensor's gradient comes back a DTensor (a parameter's with
    its sum over the ranks still pending, ``Partial()``, as torch leaves it)."""
    return _FromDTensor.apply(dt, layout_of_dtensor(dt))
