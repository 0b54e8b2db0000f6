"""What each rank feeds the sharded cross-entropy (:mod:`shardlab.ops.cross_entropy`).

No communication here: torch's own argument errors (from global shapes, on 'meta'
tensors), which mesh dims shard the classes and which the rows, and each rank's block of
the target and its full class weight, with clear errors for the layouts not supported.
"""

from __future__ import annotations

import functools
import re

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import meta
from shardlab.layout import ShardLayout
from shardlab.layout._checks import placement_str


def mesh_roles(layout: ShardLayout, cd: int):
    """(mesh dim sharding the classes or None, mesh dims sharding the rows)."""
    class_dim, row_dims = None, []
    for m, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            raise NotImplementedError(
                f"cross_entropy: input is {placement_str(p)} on mesh dim {m}; the logits must "
                "be Shard or Replicate: redistribute the input (e.g. to Replicate()) first"
            )
        if isinstance(p, Shard) and p.dim == cd:
            if class_dim is not None:
                raise NotImplementedError(
                    f"cross_entropy: input shards the class dim {cd} on two mesh dims; shard it "
                    "on one mesh dim and the batch or spatial dims on the other"
                )
            class_dim = m
        elif isinstance(p, Shard):
            row_dims.append(m)
    return class_dim, row_dims


def full_weight(weight):
    """The whole class weight (C,) on this rank, detached (torch does not train it)."""
    from shardlab.tensor import ShardTensor

    if weight is None or not isinstance(weight, ShardTensor):
        return None if weight is None else weight.detach()
    if not all(isinstance(p, Replicate) for p in weight.placements):
        raise NotImplementedError(
            "cross_entropy: weight must be a plain tensor (C,) or a Replicate() ShardTensor, "
            f"got placements {[placement_str(p) for p in weight.placements]}"
        )
    return weight.to_local().detach()


@functools.lru_cache(maxsize=1024)
def rows_layout(layout: ShardLayout, cd: int) -> ShardLayout:
    """The input's layout without the class dim (Replicate where the class dim was; a
    strided row dim stays strided)."""
    from shardlab.layout import moves
    from shardlab.layout.views import select_dims_layout

    cut = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == cd]
    rows = moves.replicated(layout, cut)
    return select_dims_layout(rows, [d for d in range(len(layout.global_shape)) if d != cd])


def _block_of(t: torch.Tensor, layout: ShardLayout, coord) -> torch.Tensor:
    """The rows of the whole tensor ``t`` that ``layout`` gives the rank at ``coord``."""
    for d in range(t.ndim):
        if layout.is_block(d):
            start, n = layout._piece(d, tuple(coord))
            t = t.narrow(d, start, n)
        else:
            t = t.index_select(d, torch.as_tensor(layout.dim_indices(d, coord), device=t.device))
    return t


def local_target(target, input, cd, probs, coord):
    """This rank's block of the target, laid out like the input (class indices: like its
    non-class dims). A plain full tensor or a Replicate ShardTensor: sliced, no message;
    a ShardTensor laid out otherwise (a causal-LM label shift: each rank's first label
    belongs to the rank before): moved, exactly the entries that change owner."""
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.create import distribute
    from shardlab.tensor.functions import Redistribute

    want = input.sharding if probs else rows_layout(input.sharding, cd)
    if not isinstance(target, ShardTensor):
        if probs and target.requires_grad:  # its gradient: all-gathered in backward
            target = distribute(target, input.device_mesh, [Replicate()] * input.device_mesh.ndim)
        else:
            return _block_of(target, want, coord)
    if target.sharding == want:
        return target.to_local()
    if all(isinstance(p, Replicate) for p in target.placements) and not probs:
        return _block_of(target.to_local(), want, coord)
    from shardlab.trace import label

    with label("cross_entropy.target"):
        return Redistribute.apply(target, want).to_local()


def check_like_torch(input, target, weight, reduction, ignore_index, label_smoothing):
    """:func:`_check_like_torch`, once per signature (shapes, dtypes, arguments) in the
    engine's one meta cache: torch's decompositions on meta tensors cost a millisecond; a
    training step repeats its calls."""

    def sig(t):
        return (tuple(t.shape), t.dtype) if torch.is_tensor(t) else (type(t), t)

    with torch._C.DisableTorchFunctionSubclass():  # a ShardTensor's shape: no Python
        key = ("cross_entropy checks", sig(input), sig(target), sig(weight), sig(reduction),
               sig(ignore_index), sig(label_smoothing))  # fmt: skip
    args = (input, target, weight, reduction, ignore_index, label_smoothing)
    meta.cached(key, _check_like_torch, *args)


def _check_like_torch(input, target, weight, reduction, ignore_index, label_smoothing):
    """torch's own errors for bad arguments, from the global shapes (no data, no comm).

    torch's cross-entropy runs on 'meta' tensors of the global shapes; three checks the
    meta kernels skip or word differently come first, with torch's CPU errors: the
    class-index target dtype, the weight dtype, the 4-D target size.
    """

    def meta(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta") if torch.is_tensor(t) else t

    x, t, w = meta(input), meta(target), meta(weight)
    enum = torch.nn._reduction.get_enum(reduction)  # ValueError for a bad string
    indices = torch.is_tensor(t) and t.shape != x.shape  # else: class probabilities
    if indices and t.dtype not in (torch.long, torch.uint8):  # raises torch's error
        torch._C._nn.nll_loss(torch.zeros(1, 1), torch.zeros(1, dtype=t.dtype))
    if indices and torch.is_tensor(w) and w.dtype != x.dtype:  # raises torch's error
        one = torch.zeros(1, dtype=torch.long)
        torch._C._nn.nll_loss(torch.zeros(1, 1, dtype=x.dtype), one, torch.zeros(1, dtype=w.dtype))
    if indices and x.ndim == 4 and t.ndim == 3 and t.shape[0] == x.shape[0]:
        if t.shape != x.shape[:1] + x.shape[2:]:
            raise RuntimeError(
                f"size mismatch (got input: {list(x.shape)} , target: {list(t.shape)}"
            )
    try:
        torch._C._nn.cross_entropy_loss(x, t, w, enum, ignore_index, label_smoothing)
    except AssertionError as exc:  # meta kernels assert where CPU kernels raise RuntimeError
        raise RuntimeError(re.sub(r"torch\.Size\((\[[^\]]*\])\)", r"\1", str(exc))) from None
