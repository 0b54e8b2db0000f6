"""``torch.quantile`` / ``torch.nanquantile`` of a ShardTensor: torch's call on the whole
tensor.

torch's quantile sorts, then writes its result into an output it resizes in place, which a
ShardTensor cannot be (it raised "an op resized a ShardTensor in place" on every rank). A
quantile needs the global order of the values anyway, so every rank takes all of them::

    x  Shard(0) [5, 2]   rank 0: rows 0-4   rank 1: rows 5-6
          |  1. all-gather x (its full_tensor: one collective per cut mesh dim)
    every rank: torch.quantile(whole x, q, ...)        (torch's checks and errors too)
          |  2. the result, Replicate on every mesh dim (no message)

Backward: the result's gradient is the same on every rank; the input's is torch's on the
whole tensor, then each rank keeps its block (a slice, no message). ``out=`` is left to
the usual path (it refuses a ShardTensor result).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from shardlab.engine.registry import register
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.create import distribute

__all__ = ["QUANTILES", "quantile"]

QUANTILES = frozenset(
    [torch.quantile, torch.nanquantile, torch.Tensor.quantile, torch.Tensor.nanquantile]
)


def quantile(func, args, kwargs):
    """``func(*args, **kwargs)`` on whole tensors, as a Replicate ShardTensor; NotImplemented
    with ``out=`` or ShardTensors of several meshes."""
    if kwargs.get("out") is not None:
        return NotImplemented
    shards = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardTensor)]
    mesh = shards[0].device_mesh
    if any(s.device_mesh is not mesh for s in shards):
        return NotImplemented

    def whole(a):
        return a.full_tensor() if isinstance(a, ShardTensor) else a  # 1.

    out = func(*[whole(a) for a in args], **{k: whole(v) for k, v in kwargs.items()})
    return distribute(out, mesh, [Replicate()] * mesh.ndim)  # 2.


register(*QUANTILES, at_function=True)(quantile)  # a sort of the whole tensor
