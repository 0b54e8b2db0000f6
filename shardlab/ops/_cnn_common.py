"""Shared pieces of the CNN op families (pool, interpolate, norm, dropout).

* :func:`check_input` / :func:`meta_call`: torch's own argument checks and output shape,
  run on a ``meta`` tensor of the global shape (same errors as torch, on every rank,
  before any message);
* :func:`spatial_mesh_dims`: which mesh dim cuts which spatial dim;
* :class:`RowPlan`: "rank r needs these global rows" -> exact point-to-point fetch,
  with the interface :class:`shardlab.comm.halo.Halo` reads (``blocks``/``recvs``/
  ``sends``/``local_index``), for windows a :class:`~shardlab.layout.ConvPlan` cannot
  describe (adaptive pooling, interpolation);
* :class:`AllReduceSum`: a differentiable all-reduce (backward: all-reduce of the grad);
* :func:`summed_grads`: replicated weights whose gradients are summed over the ranks
  holding different data (parameters: with all the others at the end of the backward,
  ``shardlab.tensor.grad_sum``; else one fused all-reduce in this op's backward);
* :func:`rewrap`: the local result back into a ShardTensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Shard

from shardlab.comm import collectives, traced
from shardlab.comm._once import first_order
from shardlab.comm.recompute import fenced
from shardlab.engine import meta
from shardlab.layout._windows import blocks_of
from shardlab.tensor import grad_sum
from shardlab.trace import label


def check_input(name: str, input):
    """Only the input is a ShardTensor; no Partial. Returns it :func:`cut_once`."""
    from shardlab.tensor import ShardTensor

    if not isinstance(input, ShardTensor):
        raise NotImplementedError(f"{name}: only the input may be a ShardTensor")
    check_no_partial(name, input)
    return cut_once(name, input)


def cut_once(name: str, input, dims=None):
    """``input`` with every dim cut by two mesh dims (flattened image tokens on a 2-D
    mesh) cut by the first of them only, gathered along the other (labelled
    ``auto-redistribute for <name>``): windows and statistics read one mesh dim's pieces.
    ``dims``: only these dims (the others keep both cuts)."""
    from shardlab.layout import moves
    from shardlab.tensor.functions import Redistribute

    seen, again = set(), []  # tensor dims seen cut; mesh dims cutting one again
    for m, p in enumerate(input.sharding.placements):
        if isinstance(p, Shard) and (dims is None or p.dim in dims):
            if p.dim in seen:
                again.append(m)
            seen.add(p.dim)
    if not again:
        return input
    whole = moves.replicated(input.sharding, again)
    return Redistribute.apply(input, whole, f"auto-redistribute for {name}")


def check_no_partial(name: str, input) -> None:
    for m, p in enumerate(input.sharding.placements):
        if isinstance(p, Partial):
            raise NotImplementedError(
                f"{name}: input Partial() on mesh dim {m} is not supported; redistribute it "
                "to Replicate() or Shard() first"
            )


def meta_call(fn, input, *args, **kwargs):
    """``fn`` on a meta tensor of ``input``'s global shape: torch's checks and shapes.
    Cached by the arguments' shapes, dtypes and values in the engine's one meta cache
    (torch's reference decompositions on meta tensors cost hundreds of microseconds; a
    training step repeats its calls); the result is only read (shapes), never written."""
    try:
        with torch._C.DisableTorchFunctionSubclass():  # a ShardTensor's shape: no Python
            key = (fn, tuple(input.shape), input.dtype, meta._key(args), meta._key(kwargs))
    except TypeError:
        return _meta_run(fn, input, args, kwargs)
    return meta.cached(key, _meta_run, fn, input, args, kwargs)


def meta_like(t):
    """A meta tensor of ``t``'s global shape and dtype (None stays None); one per shape
    and dtype, in the one meta cache (they are only read: :func:`meta_call`'s keys and
    checks)."""
    if t is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        key = ("like", tuple(t.shape), t.dtype)
    return meta.cached(key, _empty_meta, key[1], key[2])


def _empty_meta(shape, dtype):
    with traced.outside_modes():  # a meta tensor, also while torch.compile traces
        return torch.empty(shape, dtype=dtype, device="meta")


def _meta_run(fn, input, args, kwargs):
    with traced.outside_modes():  # meta tensors, also while torch.compile traces (kept)
        meta = torch.empty(tuple(input.shape), dtype=input.dtype, device="meta")
        return fn(meta, *args, **kwargs)


def spatial_mesh_dims(layout, first: int = 2) -> dict[int, int]:
    """``{tensor dim: mesh dim}`` for every sharded dim >= ``first``."""
    return {
        p.dim: m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim >= first
    }


def my_offset(input, dim: int) -> int:
    return input.sharding.local_offset(tuple(input.device_mesh.get_coordinate()))[dim]


def rewrap(y, input, new_sizes: dict[int, list[int]], shape):
    """``y`` (this rank's block) as a ShardTensor laid out like ``input``; mesh dim m
    gets ``new_sizes[m]`` if given, else the input's sizes (batch / channel dims)."""
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.create import from_layout

    layout = input._layout
    if not new_sizes and tuple(shape) == layout.global_shape:  # laid out as the input
        return from_layout(y, input.device_mesh, layout)
    sizes = [
        new_sizes.get(m, list(layout.sizes_along(p.dim))) if isinstance(p, Shard) else None
        for m, p in enumerate(layout.placements)
    ]
    return ShardTensor.from_local(
        y, input.device_mesh, layout.placements, sizes, shape=shape, validate=False
    )


def empty_like_output(x, shape):
    """An empty block still tied to ``x`` so backward runs the same exchanges everywhere."""
    return x.new_zeros(shape) + x.sum() * 0


class RowPlan:
    """Rank r's window is the sorted global rows ``needed[r]`` of one sharded dim.

    ``sizes``: the input shard sizes along the dim; ``needed``: one sorted list per rank.
    Received rows come from their owners, point to point; nothing else moves.
    """

    def __init__(self, sizes, needed, out_sizes):
        self.in_sizes = tuple(sizes)
        self.needed = [list(n) for n in needed]
        self.out_sizes = tuple(out_sizes)
        self._blocks = [blocks_of(r, tuple(n), self.in_sizes) for r, n in enumerate(needed)]

    def blocks(self, r):
        return self._blocks[r]

    def recvs(self, r):
        return tuple(b for b in self._blocks[r] if b.rank != r)

    def sends(self, r):
        from shardlab.layout import Rows

        return tuple(
            Rows(dst, b.start, b.stop)
            for dst in range(len(self.in_sizes))
            for b in self.recvs(dst)
            if b.rank == r
        )

    def local_index(self, r):
        return tuple(range(len(self.needed[r])))

    def rows_received(self, r) -> int:
        return sum(b.stop - b.start for b in self.recvs(r))


def owners(anchors: torch.Tensor, sizes) -> torch.Tensor:
    """The rank holding each global index in ``anchors`` (never an empty shard)."""
    starts = torch.tensor([sum(sizes[:r]) for r in range(len(sizes))], dtype=torch.long)
    return torch.searchsorted(starts, anchors, right=True) - 1


def groups_over(mesh, mesh_dims) -> list:
    """Process groups whose sequential all-reduces sum over ``mesh_dims``: one group (the
    mesh dim's, or the world when the mesh dims span it), else one per mesh dim. A mesh
    dim of one rank needs none (a sum over it is its one value)."""
    mesh_dims = sorted(m for m in set(mesh_dims) if mesh.shape[m] > 1)
    if not mesh_dims:
        return []
    if len(mesh_dims) == 1:
        return [mesh.get_group(mesh_dims[0])]
    if mesh.size() == dist.get_world_size():
        return [dist.group.WORLD]
    return [mesh.get_group(m) for m in mesh_dims]


def sharding_mesh_dims(layout, dims=None) -> list[int]:
    """Mesh dims that shard any tensor dim (or any of ``dims``)."""
    return [
        m
        for m, p in enumerate(layout.placements)
        if isinstance(p, Shard) and (dims is None or p.dim in dims)
    ]


def _all_reduce(t, groups, cause, phase):
    t = t.contiguous().clone()
    with label(cause, phase):
        for g in groups:
            collectives.all_reduce_(t, group=g)
    return t


@fenced
class AllReduceSum(torch.autograd.Function):
    """``AllReduceSum.apply(t, groups, cause)``: the sum over the ranks, differentiable.

    Rank q's loss depends on the sum S through its own outputs, so dL/dS is the sum over
    q of the incoming gradients: the backward is the same all-reduce.
    """

    @staticmethod
    def forward(ctx, t, groups, cause):
        ctx.groups, ctx.cause = groups, cause
        return _all_reduce(t, groups, cause, "forward")

    @staticmethod
    @first_order("a sharded reduction (pooling, norms)")
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.groups, ctx.cause, "backward"), None, None


@fenced
class _SumGrads(torch.autograd.Function):
    """Identity on (weight, bias, ...); backward sums their gradients over the ranks in
    one all-reduce of the concatenated gradients."""

    @staticmethod
    def forward(ctx, groups, cause, *tensors):
        ctx.groups, ctx.cause = groups, cause
        ctx.shapes = [t.shape for t in tensors]
        ctx.dtype, ctx.device = tensors[0].dtype, tensors[0].device
        ctx.deferrable = [grad_sum.deferrable_input(t) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @first_order("a sharded reduction (pooling, norms)")
    def backward(ctx, *grads):
        grads = [
            g if g is not None else torch.zeros(s, dtype=ctx.dtype, device=ctx.device)
            for g, s in zip(grads, ctx.shapes)
        ]
        out = [None] * len(grads)  # parameters' sums wait for the end of the backward
        now = [
            i
            for i, g in enumerate(grads)
            if not (ctx.deferrable[i] and grad_sum.keep(ctx, i, g, ctx.groups))
        ]
        if now:
            for i, g in zip(now, summed_together([grads[i] for i in now], ctx.groups, ctx.cause)):
                out[i] = g
        return (None, None, *out)


def summed_together(tensors, groups, cause) -> list:
    """``tensors`` summed over the ranks of ``groups`` in ONE all-reduce of their
    concatenation ("<cause> backward"); new tensors of the same shapes."""
    flat = _all_reduce(torch.cat([t.reshape(-1) for t in tensors]), groups, cause, "backward")
    return [s.view_as(t) for s, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def summed_grads(tensors, input, cause):
    """Replicated weights used on this rank's block: their gradients are summed over the
    mesh dims sharding the input (plain tensors: parameters with all the others at the end
    of the backward, ``shardlab.tensor.grad_sum``; the rest by one fused all-reduce
    in this op's backward)."""
    from shardlab.ops.conv import replicated_param
    from shardlab.tensor import ShardTensor

    mesh, layout = input.device_mesh, input.sharding
    out = [
        replicated_param(t, mesh, layout.placements) if isinstance(t, ShardTensor) else t
        for t in tensors
    ]
    # a ShardTensor weight's block carries its pending sum itself (``to_local``'s Partial
    # gradient, reduced by whatever made the ShardTensor, or kept pending for a DTensor
    # parameter, as torch does): summing it here too counted it once per rank
    trained = [
        i
        for i, (t, o) in enumerate(zip(tensors, out))
        if o is not None and o.requires_grad and not isinstance(t, ShardTensor)
    ]
    if not trained or not torch.is_grad_enabled():
        return out
    groups = groups_over(mesh, sharding_mesh_dims(layout))
    if groups:
        summed = _SumGrads.apply(groups, cause, *[out[i] for i in trained])
        for i, t in zip(trained, summed):
            out[i] = t
    return out
