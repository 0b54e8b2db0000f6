"""Plain tensors next to ShardTensors: a parameter (a plain tensor that requires grad)
used with a ShardTensor becomes a Replicate ShardTensor *differentiably*, so its ``.grad``
stays a plain tensor holding the full gradient, as on one device::

    W (plain, every rank)  --lift-->  W as Replicate()  --op with x (Shard)-->  y
    W.grad (plain)         <--------  grad summed over the ranks (one all-reduce, with the
                                      other parameters' at the end of the backward:
                                      ``shardlab.tensor.grad_sum``)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from shardlab._tree import tree_leaves as simple_leaves
from shardlab._tree import tree_map as simple_map
from shardlab.comm._once import passes_no_gradient
from shardlab.comm.recompute import fenced
from shardlab.layout import ShardLayout
from shardlab.tensor import grad_sum, submesh
from shardlab.tensor._checks import _check_device
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.dtensors import from_dtensor
from shardlab.tensor.entry import SCALAR_TYPES as _SCALARS
from shardlab.tensor.functions import local_of

__all__ = ["lift_trainable"]


def _lift_trainable(args, kwargs):
    """Plain tensors that require grad (parameters) next to a ShardTensor become
    replicated ShardTensors *differentiably*, so their ``.grad`` is a plain tensor
    holding the full gradient (summed over ranks), as on one device. DTensors on a
    sub-mesh (torch TP weights on ``mesh["tp"]``) are read on the whole mesh, and their
    gradients go back to the sub-mesh (:mod:`shardlab.tensor.submesh`)."""
    mesh, trained = None, []
    for i, a in enumerate(args):  # the common case, flat: ShardTensors of one mesh,
        t = type(a)  # scalars, plain tensors (the trainable ones lifted): one pass
        if t is ShardTensor and a._layout is not None:
            if mesh is None:
                mesh = a._spec.mesh
            elif a._spec.mesh is not mesh:
                break
        elif t is torch.Tensor or t is torch.nn.Parameter:
            if a.requires_grad:
                trained.append(i)
        elif t not in _SCALARS:
            break
    else:
        if not kwargs and mesh is not None:
            if not trained:
                return args, kwargs
            args = list(args)
            for i in trained:
                args[i] = _replicated(args[i], mesh)
            return tuple(args), kwargs
    from torch.utils._pytree import SUPPORTED_NODES, tree_leaves, tree_map

    leaves = simple_leaves((args, kwargs))  # lists, tuples, dicts: the common case, fast
    mapped = simple_map
    if any(type(a) in SUPPORTED_NODES for a in leaves):
        leaves = tree_leaves((args, kwargs))  # other containers pytree opens (ModelOutput …)
        mapped = tree_map
    shards = [a for a in leaves if isinstance(a, ShardTensor)]
    if not shards:  # the ShardTensor sits in a container pytree does not open
        return args, kwargs
    mesh = max((a.device_mesh for a in shards), key=lambda m: m.ndim)
    plain = any(
        isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.requires_grad
        for a in leaves
    )
    sub = any(isinstance(a, DTensor) and a.device_mesh != mesh for a in leaves)
    adopted = any(
        isinstance(a, DTensor) and type(a) is not ShardTensor and a.requires_grad for a in leaves
    )
    if not plain and not sub and not adopted:
        return args, kwargs

    def lift(a):
        if isinstance(a, DTensor):
            if sub and a.device_mesh != mesh:
                return submesh.embed(a, mesh)
            if type(a) is not ShardTensor and a.requires_grad and a.device_mesh == mesh:
                # a DTensor parameter (distribute_module's Replicate, FSDP's Shard):
                # adopted above autograd, so its gradient comes back a DTensor, its
                # sum over the ranks pending as torch leaves it
                return from_dtensor(a)
            return a
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return _replicated(a, mesh)
        return a

    return mapped(lift, args), mapped(lift, kwargs)


_REPLICATED: dict = {}  # (mesh id, shape) -> (mesh, the Replicate layout)


def _replicated(tensor: torch.Tensor, mesh) -> ShardTensor:
    """A plain tensor every rank holds alike (a parameter) as a Replicate ShardTensor, a
    view of it (nothing copied), differentiably: its ``.grad`` is the full gradient,
    summed over the ranks (:func:`distribute`'s, without its checks or its copy)."""
    _check_device(tensor, mesh, "tensor")
    key = (id(mesh), tuple(tensor.shape))
    hit = _REPLICATED.get(key)
    if hit is None or hit[0] is not mesh:
        layout = ShardLayout.build(
            key[1], tuple(mesh.shape), [Replicate()] * mesh.ndim
        )  # fmt: skip
        if len(_REPLICATED) >= 512:
            del _REPLICATED[next(iter(_REPLICATED))]
        _REPLICATED[key] = hit = (mesh, layout)
    return _Lift.apply(tensor, mesh, hit[1])


@fenced
@passes_no_gradient
class _Lift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, mesh, layout):
        ctx.mesh, ctx.sharding = mesh, layout
        ctx.deferrable = grad_sum.deferrable_input(tensor)
        return ShardTensor._wrap(tensor.view_as(tensor), mesh, layout, stride=tensor.stride())

    @staticmethod
    def backward(ctx, grad):
        if ctx.deferrable and grad_sum.take(ctx, grad, ctx.mesh):
            return None, None, None  # summed with the others at the end of the backward
        return local_of(grad, ctx.sharding, ctx.mesh), None, None


lift_trainable = _lift_trainable
