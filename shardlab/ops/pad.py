"""``F.pad`` on a ShardTensor: local on unsharded dims; on a sharded dim only the
edge ranks grow, and reflect / replicate / circular read from wherever the rows
live (circular wraps between the last and the first rank)::

    sizes [3, 2, 3], pad (2, 1), circular:
    rank 0 [ g h | a b c ]      <- g h from rank 2
    rank 1 [ d e ]
    rank 2 [ f g h | a ]        <- a from rank 0          sizes [5, 2, 4]

Messages: exactly the rows the padding copies from other ranks, point to point
(the pad is a window op with kernel 1 run by :class:`shardlab.ops.halo.Halo`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.layout import conv_plan
from shardlab.ops.halo import Halo, peers_along
from shardlab.ops.registry import register

_MODES = {
    "constant": "zeros",
    "reflect": "reflect",
    "replicate": "replicate",
    "circular": "circular",
}


@register("pad")
def pad(input, pad, mode="constant", value=None):
    from shardlab.tensor import ShardTensor

    if mode not in _MODES:
        raise NotImplementedError(
            f"pad: mode {mode!r} is not supported on a ShardTensor; supported: {list(_MODES)}"
        )
    if len(pad) % 2 or len(pad) // 2 > input.ndim:
        raise ValueError(
            f"pad: padding length must be even and at most 2 x {input.ndim}, got {len(pad)}"
        )
    mesh, layout = input.device_mesh, input.sharding
    x = input.to_local()
    local_pad = [0] * len(pad)
    sizes = [
        list(layout.sizes_along(p.dim)) if isinstance(p, Shard) else None for p in layout.placements
    ]
    shape = list(input.shape)
    for j in range(len(pad) // 2):
        dim = input.ndim - 1 - j
        left, right = pad[2 * j], pad[2 * j + 1]
        shape[dim] += left + right
        mesh_dims = [
            m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim
        ]
        if not mesh_dims or (left == 0 and right == 0):
            local_pad[2 * j], local_pad[2 * j + 1] = left, right
            continue
        if min(left, right) < 0:
            raise NotImplementedError("pad: negative padding (cropping) of a sharded dim")
        m = mesh_dims[0]
        plan = conv_plan(layout.sizes_along(dim), 1, 1, 1, (left, right), padding_mode=_MODES[mode])
        peers, me = peers_along(mesh, m)
        offset = layout.local_offset(tuple(mesh.get_coordinate()))[dim]
        fill = 0.0 if value is None else float(value)
        x = Halo.apply(x, plan, dim, peers, me, offset, fill, "pad.halo")
        sizes[m] = list(plan.out_sizes)
    if any(local_pad) and x.numel() == 0 and mode != "constant":
        # an empty block (size-0 shard): torch refuses to reflect nothing; the padded
        # block is empty too, only its unsharded dims grow
        shape_local = list(x.shape)
        for j in range(len(local_pad) // 2):
            shape_local[x.ndim - 1 - j] += local_pad[2 * j] + local_pad[2 * j + 1]
        x = x.new_zeros(shape_local) + x.sum() * 0
    elif any(local_pad):
        x = torch.nn.functional.pad(
            x, local_pad, mode=mode, **({"value": value} if value is not None else {})
        )
    return ShardTensor.from_local(x, mesh, layout.placements, sizes, shape=shape, validate=False)
