"""Normalisation over sharded dims: ``F.batch_norm``, ``group_norm``, ``instance_norm``,
``layer_norm`` with exact statistics for any shard sizes (empty shards included).

Who owns what. (N, C, H, W) sharded over H on 3 ranks, sizes [3, 0, 2]; batch_norm
reduces over (N, H, W) per channel::

    rank 0  rows 0-2   n_r = N*3*W, local mean m_r, M2_r = sum((x - m_r)^2)      (3, C)
    rank 1  (empty)    zeros                                                   (3, C)
    rank 2  rows 3-4   n_r = N*2*W, ...                                        (3, C)
            --- one all_reduce(SUM) of [n_r m_r, M2_r, n_r m_r^2], float64: "batch_norm.stats" ---
    every rank: mean = sum(n_r m_r)/n, var = (sum M2_r + sum n_r m_r^2)/n - mean^2, n = N*H*W

Per call, forward::

    1. the local block's mean and centred sum of squares per statistic, stacked with the
       counts as above (float64; the centring makes any mean exact, e.g. float32 pixels
       around 1000, and nothing depends on the running buffers)
    2. one all-reduce of the stack over the mesh dims that shard the reduced dims
       (none: the original torch op runs on the local block, no communication)
    3. y = (x - mean) * rsqrt(var + eps) * weight + bias on the local block
    4. batch_norm / instance_norm training: running stats updated in place, identically
       on every rank, as torch (unbiased var n/(n-1), momentum)

Steps 1-3 are :class:`~shardlab.ops._cnn_norm.SyncNorm` (saves only x, mean, rstd, like
torch's kernels). Its backward is ONE all-reduce of [sum g, sum g xhat] (the statistics'
gradient), fused with the weight and bias gradient sums when the statistics span every
sharded mesh dim (batch_norm always; group/instance norm unless the batch is sharded,
then one more all-reduce sums the parameter gradients). instance_norm with running stats
and layer_norm's elementwise weight (gathered back by redistribute) are the exceptions:
autograd through primitives / redistribute. Eval mode, ``use_input_stats=False`` and
layer_norm over unsharded dims: no forward communication (backward: the parameter
gradients' all-reduce). Half precision: statistics in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardlab.ops._cnn_common import (
    AllReduceSum,
    check_input,
    check_no_partial,
    groups_over,
    meta_call,
    meta_like,
    rewrap,
    sharding_mesh_dims,
    summed_grads,
)
from shardlab.ops._cnn_norm import NormSpec, RowsNorm, SyncNorm
from shardlab.ops.registry import register
from shardlab.tensor.functions import records


def _no_channel_shard(name, input):
    if any(isinstance(p, Shard) and p.dim == 1 for p in input.sharding.placements):
        raise NotImplementedError(
            f"{name}: a sharded channel dim is not supported; shard the batch or spatial dims"
        )


def _params(weight, bias, input, fused, cause):
    """Weight and bias as local tensors. ``fused``: SyncNorm's backward all-reduce sums
    their gradients already; else :func:`summed_grads` does (one more all-reduce)."""
    from shardlab.tensor import ShardTensor

    if not fused:
        return summed_grads([weight, bias], input, cause)
    return [t.to_local() if isinstance(t, ShardTensor) else t for t in (weight, bias)]


def _sync_norm(x, w, b, input, view, dims, count, stat_dims, name, eps, pview):
    """Steps 1-3 by :class:`SyncNorm`; ``stat_dims``: tensor dims the statistics span."""
    layout = input.sharding
    stat_mesh = sharding_mesh_dims(layout, stat_dims)
    fused = set(stat_mesh) == set(sharding_mesh_dims(layout)) and pview is not None
    if pview is not None:
        w, b = _params(w, b, input, fused, f"{name}.params")
    spec = NormSpec(
        tuple(view), tuple(dims), count, groups_over(input.device_mesh, stat_mesh),
        f"{name}.stats", eps, pview, fused,
    )  # fmt: skip
    return SyncNorm.apply(x, w, b, spec)


def _local(fn, x, w, b, *args):
    """The original op on the local block; an empty block still ties the weights in, so
    every rank runs the same collectives in backward."""
    if x.numel() == 0:
        return x.new_zeros(x.shape) + sum(t.sum() * 0 for t in (x, w, b) if t is not None)
    return fn(x, *args)


def _affine(y, weight, bias, shape):
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


@register("batch_norm")
def batch_norm(
    input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
    eps=1e-5,
):  # fmt: skip
    input = check_input("batch_norm", input)
    _no_channel_shard("batch_norm", input)
    meta_call(
        F.batch_norm, input, meta_like(running_mean), meta_like(running_var), meta_like(weight),
        meta_like(bias), training, momentum, eps,
    )  # fmt: skip
    x = input.to_local()  # (N, C, *S_local)
    if training and not groups_over(input.device_mesh, sharding_mesh_dims(input._layout)):
        # no mesh dim of more than one rank cuts it: every rank holds all of it, so
        # torch's own op on the block (its running statistics updated alike everywhere)
        w, b = summed_grads([weight, bias], input, "batch_norm.params")  # (no groups)
        y = F.batch_norm(x, running_mean, running_var, w, b, True, momentum, eps)
        return rewrap(y, input, {}, input.shape)
    if not training:  # running statistics: local, no communication
        w, b = summed_grads([weight, bias], input, "batch_norm.params")
        y = _local(F.batch_norm, x, w, b, running_mean, running_var, w, b, False, momentum, eps)
        return rewrap(y, input, {}, input.shape)
    dims = [0, *range(2, input.ndim)]
    n = math.prod(input.shape[d] for d in dims)
    cshape = (1, -1) + (1,) * (input.ndim - 2)
    y, mean, var = _sync_norm(
        x, weight, bias, input, x.shape, dims, n, dims, "batch_norm", eps, cshape
    )
    if running_mean is not None or running_var is not None:  # step 4
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.reshape(-1) * momentum)
            if running_var is not None:
                unbiased = var.reshape(-1) * (n / (n - 1))
                running_var.mul_(1 - momentum).add_(unbiased * momentum)
    return rewrap(y, input, {}, input.shape)


@register("group_norm", at_function=True)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    input = check_input("group_norm", input)
    _no_channel_shard("group_norm", input)
    meta_call(F.group_norm, input, num_groups, meta_like(weight), meta_like(bias), eps)
    x, layout = input.to_local(), input.sharding  # (N, C, *S_local)
    spatial = list(range(2, input.ndim))
    if not sharding_mesh_dims(layout, spatial):  # per-sample statistics, whole samples
        w, b = summed_grads([weight, bias], input, "group_norm.params")
        y = _local(F.group_norm, x, w, b, num_groups, w, b, eps)
        return rewrap(y, input, {}, input.shape)
    y = _grouped(x, weight, bias, input, num_groups, "group_norm", eps)
    return rewrap(y, input, {}, input.shape)


def _grouped(x, weight, bias, input, groups, name, eps):
    """group_norm / instance_norm over sharded spatial dims."""
    c, spatial = input.shape[1], list(range(2, input.ndim))
    view = (x.shape[0], groups, c // groups, *x.shape[2:])  # (N, G, C/G, *S_local)
    n = c // groups * math.prod(input.shape[d] for d in spatial)
    pview = (1, -1) + (1,) * len(spatial)
    dims = range(2, len(view))
    return _sync_norm(x, weight, bias, input, view, dims, n, spatial, name, eps, pview)[0]


@register("instance_norm", at_function=True)
def instance_norm(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
    momentum=0.1, eps=1e-5,
):  # fmt: skip
    input = check_input("instance_norm", input)
    _no_channel_shard("instance_norm", input)
    meta_call(
        F.instance_norm, input, meta_like(running_mean), meta_like(running_var), meta_like(weight),
        meta_like(bias), use_input_stats, momentum, eps,
    )  # fmt: skip
    x, layout, mesh = input.to_local(), input.sharding, input.device_mesh  # (N, C, *S_local)
    spatial = list(range(2, input.ndim))
    track = running_mean is not None or running_var is not None
    reduce_dims = spatial + ([0] if track else [])  # running stats average over the batch
    groups = groups_over(mesh, sharding_mesh_dims(layout, reduce_dims))
    if use_input_stats and groups and not track:  # group_norm with one channel per group
        y = _grouped(x, weight, bias, input, input.shape[1], "instance_norm", eps)
        return rewrap(y, input, {}, input.shape)
    w, b = summed_grads([weight, bias], input, "instance_norm.params")
    if not use_input_stats or not groups:
        args = (running_mean, running_var, w, b, use_input_stats, momentum, eps)
        y = _local(F.instance_norm, x, w, b, *args)
        return rewrap(y, input, {}, input.shape)
    # running statistics (autograd through primitives): statistics per (n, c) in rows of
    # the *global* batch (zeros for other ranks' samples), so that the same all-reduce
    # also sums over batch shards for the running means
    start = layout.local_offset(tuple(mesh.get_coordinate()))[0]
    count = math.prod(input.shape[d] for d in spatial)
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    local = torch.stack([work.sum(spatial), (work * work).sum(spatial)])  # (2, N_local, C)
    local = F.pad(local, (0, 0, start, input.shape[0] - start - x.shape[0]))  # (2, N, C)
    stats = AllReduceSum.apply(local, groups, "instance_norm.stats")
    mine = stats[:, start : start + x.shape[0]]
    mean, var = mine[0] / count, (mine[1] / count - (mine[0] / count) ** 2).clamp_min(0)
    view = list(x.shape[:2]) + [1] * len(spatial)
    xhat = ((work - mean.view(view)) * torch.rsqrt(var.view(view) + eps)).to(x.dtype)
    y = _affine(xhat, w, b, [1, -1] + [1] * len(spatial))
    with torch.no_grad():
        all_mean = stats[0] / count
        all_var = (stats[1] / count - all_mean**2).clamp_min(0) * (count / (count - 1))
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(all_mean.mean(0) * momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(all_var.mean(0) * momentum)
    return rewrap(y, input, {}, input.shape)


@register("layer_norm", row_wise=True)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    from shardlab.tensor.create import from_layout

    k = len(tuple(normalized_shape)) if not isinstance(normalized_shape, int) else 1
    gshape = input._layout.global_shape  # (read here, not through __torch_function__)
    if not _fits(normalized_shape, gshape, weight, bias):  # torch's error, every rank
        meta_call(F.layer_norm, input, normalized_shape, meta_like(weight), meta_like(bias), eps)
    dims = list(range(len(gshape) - k, len(gshape)))
    if not sharding_mesh_dims(input._layout, dims):
        # whole rows on every rank, whatever cuts the other dims (strided, or one dim cut
        # by two mesh dims: flattened image tokens): the original op, no communication
        check_no_partial("layer_norm", input)
        if not any(isinstance(t, DTensor) for t in (weight, bias)):
            trained = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (weight, bias)
            )
            mesh = input.device_mesh
            if not trained and not records((input,)):  # nothing for autograd: no Function
                shape = gshape[len(gshape) - k :]
                y = torch.native_layer_norm(input._local_tensor, shape, weight, bias, eps)[0]
                return input._wrap(y, mesh, input._layout)  # (as RowsNorm's forward)
            groups = groups_over(mesh, sharding_mesh_dims(input._layout)) if trained else []
            return RowsNorm.apply(input, weight, bias, gshape[len(gshape) - k :], eps, groups)
        w, b = summed_grads([weight, bias], input, "layer_norm.params")
        x = input.to_local()
        y = _local(F.layer_norm, x, w, b, x.shape[input.ndim - k :], w, b, eps)
        return from_layout(y, input.device_mesh, input.sharding)
    meta_call(F.layer_norm, input, normalized_shape, meta_like(weight), meta_like(bias), eps)
    input = _consecutive(input, dims, "layer_norm")
    input = check_input("layer_norm", input)
    x, layout, mesh = input.to_local(), input.sharding, input.device_mesh
    groups = groups_over(mesh, sharding_mesh_dims(layout, dims))
    w, b = (_weight_block(t, input, k) for t in (weight, bias))
    n = math.prod(input.shape[d] for d in dims)
    spec = NormSpec(tuple(x.shape), tuple(dims), n, groups, "layer_norm.stats", eps, None, False)
    y = SyncNorm.apply(x, w, b, spec)[0]
    return rewrap(y, input, {}, input.shape)


def _fits(normalized_shape, gshape, weight, bias) -> bool:
    """The shapes torch checks agree (the trailing dims, the weight's and bias's): no
    meta run needed for its errors (a wrong dtype or device fails alike in the kernel)."""
    if type(normalized_shape) not in (tuple, list, torch.Size):
        return False
    shape = tuple(normalized_shape)
    if not shape or len(shape) > len(gshape) or shape != tuple(gshape[len(gshape) - len(shape) :]):
        return False
    return all(t is None or tuple(t.shape) == shape for t in (weight, bias))


def _consecutive(input, dims, name):
    """``input`` with the strided ones of ``dims`` cut into consecutive pieces (the
    statistics read blocks of them; labelled ``auto-redistribute for <name>``)."""
    from shardlab.layout import moves
    from shardlab.tensor.functions import Redistribute

    layout = input.sharding
    for d in dims:
        if not layout.is_block(d):
            layout = moves.as_block(layout, d)
    if layout == input.sharding:
        return input
    return Redistribute.apply(input, layout, f"auto-redistribute for {name}")


def _weight_block(t, input, k):
    """This rank's block of an elementwise weight over the last k dims; its gradient
    is summed over batch-like shards and gathered over the normalised-dim shards."""
    if t is None:
        return None
    from shardlab.tensor import ShardTensor, distribute

    if isinstance(t, ShardTensor):
        t = t.full_tensor()
    layout, lead = input.sharding, input.ndim - k
    places, grads, sizes = [], [], []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim >= lead:
            places.append(Shard(p.dim - lead))
            grads.append(Shard(p.dim - lead))
            sizes.append(list(layout.sizes_along(p.dim)))
        else:
            places.append(Replicate())
            grads.append(Partial() if isinstance(p, Shard) else Replicate())
            sizes.append(None)
    st = distribute(t, input.device_mesh, places, sizes=sizes)
    return st.to_local(grad_placements=grads) if t.requires_grad else st.to_local()
