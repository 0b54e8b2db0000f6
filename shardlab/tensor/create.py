"""Making a ShardTensor from a tensor that is whole somewhere: ``distribute`` (every rank
holds it: each keeps its block, no message) and ``scatter_tensor`` (one rank holds it:
one message per receiving rank). Both are differentiable."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import p2p, traced
from shardlab.comm._once import first_order, passes_no_gradient
from shardlab.comm.recompute import fenced
from shardlab.layout import ShardLayout
from shardlab.tensor import api, functions
from shardlab.tensor._checks import _check_device, _mesh, _placements
from shardlab.tensor.functions import local_of
from shardlab.trace import label

__all__ = ["distribute", "scatter_tensor"]


@traced.eager
def scatter_tensor(tensor, src: int, device_mesh, placements, sizes=None) -> api.ShardTensor:
    """Split ``tensor``, which lives on global rank ``src`` only, over the mesh.

    Every other rank passes anything (``None``) and receives only its own block:
    one broadcast of the shape and dtype, then one message per receiving rank.
    Differentiable: the gradient is gathered back to ``src``.

    Args:
        tensor: the global tensor on rank ``src``; ignored elsewhere.
        src: the global rank that holds it.
        device_mesh, placements, sizes: as in :func:`shardlab.distribute`.

    Example::

        me = shardlab.this_rank()
        x = torch.arange(54.0).reshape(18, 3) if me.rank == 0 else None
        st = shardlab.scatter_tensor(x, 0, me.mesh, [Shard(0)], sizes=[[6, 4, 4, 4]])
        # rank 0 sent 3 messages; rank 1 received 4 x 3 x 4 = 48 bytes
    """
    mesh = _mesh(device_mesh)
    placements = _placements(placements, mesh)
    me = dist.get_rank()
    if me == src:
        _check_device(tensor, mesh, "tensor")
        meta = [tuple(tensor.shape), tensor.dtype, tensor.requires_grad]
    else:
        meta = [None, None, None]
    with label("scatter_tensor.meta"):
        _broadcast_in_mesh(meta, src, mesh)
    shape, dtype, requires_grad = meta
    layout = ShardLayout.build(shape, tuple(mesh.shape), placements, sizes)
    if me != src:
        tensor = torch.empty(0, dtype=dtype, device=mesh.device_type, requires_grad=requires_grad)
    return _Scatter.apply(tensor, src, mesh, layout)


def _broadcast_in_mesh(objects: list, src: int, mesh) -> None:
    """``broadcast_object_list`` from global rank ``src`` to the ranks of ``mesh`` only, along
    its groups: last mesh dim first (src's row), then each earlier dim (every column)::

        step dim 1: (r0, c0) -> (r0, *)        step dim 0: (r0, c) -> (*, c) for every c
    """
    grid = mesh.mesh
    if src not in grid.flatten().tolist():
        raise ValueError(f"src={src} is not a rank of the mesh {grid.tolist()}")
    at = tuple(int(i) for i in (grid == src).nonzero()[0])  # src's coordinate
    me = p2p.my_coord(mesh)
    for m in reversed(range(mesh.ndim)):
        if me[:m] != at[:m]:
            continue  # not on this step's lines through src: gets it at an earlier dim
        root = p2p.rank_at(mesh, at[: m + 1] + tuple(me[m + 1 :]))
        dist.broadcast_object_list(objects, src=root, group=mesh.get_group(m))


@fenced
@passes_no_gradient
class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, src, mesh, layout):
        ctx.src, ctx.mesh, ctx.sharding = src, mesh, layout
        ctx.shape, ctx.is_src = tensor.shape, dist.get_rank() == src
        with label("scatter_tensor"):
            local = _scatter_blocks(tensor, src, mesh, layout)
        return api.ShardTensor._wrap(local, mesh, layout)

    @staticmethod
    @first_order("scatter_tensor")
    def backward(ctx, grad):
        local = local_of(grad, functions.gradient_layout(ctx.sharding), ctx.mesh)
        with label("scatter_tensor backward"):
            full = _gather_blocks(local, ctx.src, ctx.mesh, ctx.sharding)
        return (
            (
                full
                if ctx.is_src
                else torch.zeros(ctx.shape, dtype=local.dtype, device=local.device)
            ),
            None,
            None,
            None,
        )


def _scatter_blocks(tensor, src, mesh, layout):
    me = dist.get_rank()
    ops, mine = [], None
    for coord in layout.coords():
        r = p2p.rank_at(mesh, coord)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        if me == src and r == me:
            mine = tensor.detach()[box].clone()
        elif me == src and layout.numel(coord):
            ops.append(dist.P2POp(dist.isend, tensor.detach()[box].contiguous(), r))
        elif r == me:
            mine = torch.empty(layout.local_shape(coord), dtype=tensor.dtype, device=tensor.device)
            if layout.numel(coord):
                ops.append(dist.P2POp(dist.irecv, mine, src))
    p2p.run_p2p(ops)
    return mine


def _gather_blocks(local, src, mesh, layout):
    """Inverse of _scatter_blocks: every block to ``src`` (replicas: coordinate 0 sends)."""
    me = dist.get_rank()
    full = (
        torch.zeros(layout.global_shape, dtype=local.dtype, device=local.device)
        if me == src
        else None
    )
    ops, bufs = [], []
    for coord in layout.coords():
        if any(c and not isinstance(p, Shard) for c, p in zip(coord, layout.placements)):
            continue  # one copy of each block is enough
        r = p2p.rank_at(mesh, coord)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        if r == src and me == src:
            full[box] = local
        elif me == src and layout.numel(coord):
            buf = local.new_empty(layout.local_shape(coord))
            ops.append(dist.P2POp(dist.irecv, buf, r))
            bufs.append((box, buf))
        elif r == me and layout.numel(coord):
            ops.append(dist.P2POp(dist.isend, local.contiguous(), src))
    p2p.run_p2p(ops)
    for box, buf in bufs:
        full[box] = buf
    return full


@traced.eager
def distribute(tensor: torch.Tensor, device_mesh, placements, sizes=None) -> api.ShardTensor:
    """Every rank holds the same global ``tensor``: keep each rank's block (no communication).

    Differentiable: the gradient of ``tensor`` is the full gradient on every rank
    (one redistribute to Replicate in backward).

    Args:
        tensor: the global tensor, the same on every rank.
        device_mesh: the DeviceMesh (1-D or 2-D).
        placements: one ``Shard(d)`` / ``Replicate()`` / ``Partial()`` per mesh dim.
        sizes: per mesh dim, the size of every piece (``[[5, 5, 4, 4]]``), or None for
            ``torch.chunk``'s sizes (see ``ShardLayout.build``).

    Example::

        st = shardlab.distribute(img, mesh, [Shard(2)], sizes=[[30, 34, 32, 32]])
    """
    mesh = _mesh(device_mesh)
    placements = _placements(placements, mesh)
    _check_device(tensor, mesh, "tensor")
    layout = ShardLayout.build(tuple(tensor.shape), tuple(mesh.shape), placements, sizes)
    return _Distribute.apply(tensor, mesh, layout)


@fenced
@passes_no_gradient
class _Distribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, mesh, layout):
        ctx.mesh, ctx.sharding = mesh, layout
        coord = p2p.my_coord(mesh)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        local = tensor[box].clone()
        for m, p in enumerate(layout.placements):
            if isinstance(p, Partial) and coord[m] != 0:
                local.zero_()
        return api.ShardTensor._wrap(local, mesh, layout)

    @staticmethod
    def backward(ctx, grad):
        replicate = ShardLayout.build(
            ctx.sharding.global_shape,
            ctx.sharding.mesh_shape,
            [Replicate()] * len(ctx.sharding.mesh_shape),
        )
        return local_of(grad, replicate, ctx.mesh), None, None


def from_layout(local: torch.Tensor, mesh, layout: ShardLayout, stride=None) -> api.ShardTensor:
    """This rank's block ``local`` as a ShardTensor of any ``layout`` (strided dims too),
    differentiably: the sharded ops build their results with it."""
    if layout.mesh_shape in _ONE_RANK:  # the block is the tensor; nothing to fence
        if tuple(local.shape) == layout.global_shape:
            return functions.FromLocalAlone.apply(local, mesh, layout, stride)
    want = layout.local_shape(p2p.my_coord(mesh))
    if tuple(local.shape) != want:
        raise RuntimeError(
            f"shardlab internal error: a local block of shape {tuple(local.shape)} does not fit "
            f"{layout} (this rank needs {want}); please report it"
        )
    return functions.FromLocal.apply(local, mesh, layout, stride)


def replicate_layout(shape, mesh) -> ShardLayout:
    return ShardLayout.build(tuple(shape), tuple(mesh.shape), [Replicate()] * mesh.ndim)


def as_shard(t: torch.Tensor, mesh):
    """A plain tensor next to ShardTensors: the same on every rank (Replicate)."""
    return api.ShardTensor._wrap(t, mesh, replicate_layout(t.shape, mesh))


_ONE_RANK = {(1,), (1, 1)}  # mesh shapes of one rank (shardlab's meshes have 1 or 2 dims)
