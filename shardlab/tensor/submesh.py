"""Tensors on a sub-mesh next to ShardTensors on the whole mesh (2-D: sequence x tensor).

torch's tensor parallelism (``parallelize_module(model, mesh["tp"], plan)``) puts the
weights on the 1-D sub-mesh ``mesh["tp"]``; the activations of a sequence-sharded model
are ShardTensors on the 2-D mesh::

    mesh ("seq", "tp") = [[0, 1],      x: Shard(1) on "seq", Replicate on "tp"
                          [2, 3]]      W: Shard(0) on mesh["tp"] (rows 0|1 on tp 0|1)

    read on the 2-D mesh, W is (Replicate on "seq", Shard(0) on "tp"): the same local
    block, nothing moves. Its gradient comes back on mesh["tp"] with W's placements:
    the "seq" ranks' contributions are summed first (one all-reduce over "seq").

A sub-mesh is recognised by its dim names (a subset of the whole mesh's) and by its
ranks (the whole mesh's ranks at my coordinate on the other dims).

torch's TP hooks then call ``redistribute(placements=[one placement])`` and
``to_local()`` on a ShardTensor of the 2-D mesh; :func:`hook_sub_mesh` tells which
sub-mesh they mean (the ``device_mesh`` the hook was called with) and the ShardTensor
keeps the other mesh dims as they are (see ``ShardTensor.redistribute``).
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor, Replicate

from shardlab.comm._once import first_order, passes_no_gradient
from shardlab.comm.recompute import fenced
from shardlab.layout import ShardLayout
from shardlab.layout.dtensor import layout_of_dtensor
from shardlab.tensor import api, functions

__all__ = ["embed", "embed_layout", "hook_sub_mesh", "sub_mesh_dims"]


def sub_mesh_dims(sub, mesh) -> tuple[int, ...] | None:
    """The dims of ``mesh`` that ``sub`` is made of, or None when it is not a sub-mesh
    of ``mesh`` holding this rank (same rank grid at my coordinate on the other dims)."""
    if sub is mesh or sub == mesh:
        return tuple(range(mesh.ndim))
    names, sub_names = mesh.mesh_dim_names, sub.mesh_dim_names
    if not names or not sub_names or not set(sub_names) <= set(names):
        return None
    dims = tuple(names.index(n) for n in sub_names)
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    grid = mesh.mesh
    index = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
    want = grid[index]
    if list(dims) != sorted(dims):
        want = want.permute(*[sorted(dims).index(d) for d in dims])
    return dims if torch.equal(want, sub.mesh) else None


def embed_layout(layout: ShardLayout, dims: tuple[int, ...], mesh) -> ShardLayout:
    """A layout on a sub-mesh (its mesh dims are ``dims`` of ``mesh``) read on ``mesh``:
    Replicate on every other mesh dim, the same blocks."""
    places = [Replicate()] * mesh.ndim
    sizes: list = [None] * mesh.ndim
    cuts: list = [None] * mesh.ndim
    for i, d in enumerate(dims):
        places[d] = layout.placements[i]
        sizes[d] = layout.sizes[i]
        if layout.cuts is not None:
            cuts[d] = layout.cuts[i]
    return ShardLayout(
        layout.global_shape,
        tuple(mesh.shape),
        tuple(places),
        tuple(sizes),
        layout.atoms,
        tuple(cuts) if layout.cuts is not None else None,
    )


def _sub_layout(a) -> ShardLayout:

    return a._layout if isinstance(a, api.ShardTensor) else layout_of_dtensor(a)


def embed(a, mesh):
    """``a`` (a DTensor or ShardTensor on a sub-mesh of ``mesh``) as a ShardTensor on
    ``mesh``, differentiably; anything else is returned as it is."""
    if not isinstance(a, DTensor) or a.device_mesh == mesh:
        return a
    dims = sub_mesh_dims(a.device_mesh, mesh)
    if dims is None:
        return a
    return _Embed.apply(a, mesh, embed_layout(_sub_layout(a), dims, mesh))


@fenced
@passes_no_gradient
class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, mesh, layout):

        ctx.sub, ctx.mesh, ctx.layout = a.device_mesh, mesh, layout
        ctx.placements, ctx.shape, ctx.stride = a.placements, a.shape, a.stride()
        ctx.shard = isinstance(a, api.ShardTensor)
        return api.ShardTensor._wrap(a._local_tensor, mesh, layout, stride=a.stride())

    @staticmethod
    @first_order("a sub-mesh DTensor")
    def backward(ctx, grad):

        if ctx.shard:
            target = functions.gradient_layout(
                ctx.layout
            )  # the other mesh dims: summed (all-reduce)
            local = functions.local_block(grad, target, ctx.mesh)
            dims = sub_mesh_dims(ctx.sub, ctx.mesh)
            sub = target.replace(
                mesh_shape=tuple(ctx.sub.shape),
                placements=tuple(target.placements[d] for d in dims),
                sizes=tuple(target.sizes[d] for d in dims),
                cuts=None if target.cuts is None else tuple(target.cuts[d] for d in dims),
            )
            return api.ShardTensor._wrap(local, ctx.sub, sub, stride=ctx.stride), None, None
        # a plain DTensor: the other mesh dims summed, its own keep a pending sum
        dims = sub_mesh_dims(ctx.sub, ctx.mesh)
        grad = functions.dtensor_grad(
            grad, ctx.mesh, ctx.layout, ctx.sub, ctx.placements, ctx.shape, ctx.stride, dims
        )
        return grad, None, None


def hook_sub_mesh(mesh, depth: int = 4):
    """The sub-mesh a torch TP hook works on: its ``device_mesh`` argument.

    torch's ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel`` hooks
    (torch 2.11-2.15, ``torch/distributed/tensor/parallel/style.py``) call
    ``outputs.redistribute(placements=output_layouts)`` with one placement per dim of
    *their* mesh, which they do not pass; it is the hook's ``device_mesh`` argument,
    read from the calling frame (pinned by the 2-D tests of ``tests/test_lm.py``)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        cand = frame.f_locals.get("device_mesh")
        if cand is not None and cand is not mesh and hasattr(cand, "mesh_dim_names"):
            if sub_mesh_dims(cand, mesh) is not None:
                return cand
        frame = frame.f_back
    return None
