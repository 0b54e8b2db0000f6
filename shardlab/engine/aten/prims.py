"""torch's primitives, as the aten ops they are.

torch's reference decompositions (``native_layer_norm``, ``native_group_norm`` … over a
cut dim) emit ``prims.var``, ``prims.sum`` and ``prims.broadcast_in_dim``. Each is one
aten op (or two) whose rule exists, so it runs as that, on the shards::

    prims.sum(x, dims)                      = aten.sum(x, dims)
    prims.var(x, dims, correction)          = aten.var(x, dims, correction=correction)
    prims.broadcast_in_dim(x, shape, bdims) = x.view(shape with 1s where x has no dim)
                                               .expand(shape)

Messages: those of the aten ops (a Partial sum; the moments' one all-gather).
"""

from __future__ import annotations

import torch

from shardlab.engine.registry import register

aten = torch.ops.aten
prims = torch.ops.prims


@register(prims.sum.default)
def _sum(func, args, kwargs):
    x, dims = args[0], list(args[1])
    dtype = args[2] if len(args) > 2 else kwargs.get("output_dtype")
    return aten.sum.dim_IntList(x, dims, False, dtype=dtype)


@register(prims.var.default)
def _var(func, args, kwargs):
    x, dims = args[0], list(args[1])
    correction = args[2] if len(args) > 2 else kwargs.get("correction", 1)
    if kwargs.get("output_dtype") is not None or len(args) > 3:
        return NotImplemented
    return aten.var.correction(x, dims, correction=correction, keepdim=False)


@register(prims.broadcast_in_dim.default)
def _broadcast_in_dim(func, args, kwargs):
    x, shape, kept = args[0], list(args[1]), list(args[2])
    view = [1] * len(shape)
    for j, d in enumerate(kept):
        view[d] = x.shape[j]
    return aten.expand.default(aten.view.default(x, view), shape)
