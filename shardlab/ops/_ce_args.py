"""What each rank feeds the sharded cross-entropy (:mod:`shardlab.ops.cross_entropy`).

No communication here: torch's own argument errors (from global shapes, on 'meta'
tensors), which mesh dims shard the classes and which the rows, and each rank's block of
the target and its full class weight, with clear errors for the layouts not supported.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.layout import ShardLayout, format_sizes
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


def rows_layout(layout: ShardLayout, cd: int) -> ShardLayout:
    """The input's layout without the class dim (Replicate where the class dim was)."""
    places, sizes = [], []
    for p, s in zip(layout.placements, layout.sizes):
        cut = isinstance(p, Shard) and p.dim != cd
        places.append(Shard(p.dim - (p.dim > cd)) if cut else Replicate())
        sizes.append(s if cut else None)
    shape = layout.global_shape[:cd] + layout.global_shape[cd + 1 :]
    return ShardLayout(shape, layout.mesh_shape, tuple(places), tuple(sizes))


def build_sizes(sizes) -> list:
    """Canonical ``ShardLayout.sizes`` in the form ``from_local`` / ``build`` take."""
    return [
        None if e is None else list(e[0]) if len(e) == 1 else [list(s) for s in e] for e in sizes
    ]


def describe(layout: ShardLayout) -> str:
    return ", ".join(
        format_sizes(p, layout.sizes_along(p.dim) if isinstance(p, Shard) else None, m)
        for m, p in enumerate(layout.placements)
    )


def local_target(target, input, cd, probs, coord):
    """This rank's block of the target: a ShardTensor laid out like the input (class
    indices: like its non-class dims) or Replicate, or a plain full tensor. No comm."""
    from shardlab.tensor import ShardTensor, distribute

    want = input.sharding if probs else rows_layout(input.sharding, cd)
    box = tuple(slice(a, b) for a, b in want.local_box(coord))
    if not isinstance(target, ShardTensor):
        if probs and target.requires_grad:  # its gradient: all-gathered in backward
            return distribute(
                target, input.device_mesh, want.placements, build_sizes(want.sizes)
            ).to_local()
        return target[box]
    if target.sharding == want:
        return target.to_local()
    if all(isinstance(p, Replicate) for p in target.placements):
        if probs:
            return target.redistribute(
                input.device_mesh, want.placements, sizes=build_sizes(want.sizes)
            ).to_local()
        return target.to_local()[box]
    raise ValueError(
        f"cross_entropy: target is laid out as [{describe(target.sharding)}] but the input "
        f"needs it as [{describe(want)}] (or Replicate()): redistribute the target"
    )


def check_like_torch(input, target, weight, reduction, ignore_index, label_smoothing):
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
