"""``F.pad`` on a ShardTensor: local on unsharded dims; on a sharded dim only the
edge ranks grow, and reflect / replicate / circular read from wherever the rows
live (circular wraps between the last and the first rank)::

    sizes [3, 2, 3], pad (2, 1), circular:
    rank 0 [ g h | a b c ]      <- g h from rank 2
    rank 1 [ d e ]
    rank 2 [ f g h | a ]        <- a from rank 0          sizes [5, 2, 4]

Messages: exactly the rows the padding copies from other ranks, point to point
(the pad is a window op with kernel 1 run by :class:`shardlab.comm.halo.Halo`).

Constant padding sends nothing (the engine's ``constant_pad_nd``): only the first and
the last piece grow. Negative padding crops, as in torch: the rows cropped off a sharded
dim are dropped where they live (a slice: no message), then the rest pads the cropped
tensor (torch's order too: a circular pad wraps the cropped tensor's other end).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.comm.halo import Halo, peers_along
from shardlab.layout import conv_plan
from shardlab.ops._cnn_common import cut_once, meta_call
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

    expected = _check(input, pad, mode, value)  # torch's error for bad arguments, every rank
    if mode not in _MODES:  # (a mode torch adds later)
        raise NotImplementedError(
            f"pad: mode {mode!r} is not supported on a ShardTensor; supported: {list(_MODES)}"
        )
    # (Partial values arrive reduced: registry.call prepares the arguments)
    if mode == "constant" and all(p >= 0 for p in pad):
        return _constant(input, pad, value)
    padded = {input.ndim - 1 - j for j in range(len(pad) // 2) if pad[2 * j] or pad[2 * j + 1]}
    input = cut_once("pad", input, padded)  # a padded dim cut twice: by the first mesh dim
    if any(p < 0 for p in pad):
        return _cropped(input, pad, mode, value, expected)
    mesh, layout = input.device_mesh, input.sharding
    x = input.to_local()
    local_pad = [0] * len(pad)
    sizes = [layout.sizes_arg(m) for m in range(len(layout.placements))]  # (build's form)
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
        m = mesh_dims[0]
        if input.shape[dim] == 0:  # nothing to read (all cropped): the fill, on the first
            first = mesh.get_coordinate()[m] == 0
            grow = [0, 0] * (x.ndim - 1 - dim) + [left + right if first else 0, 0]
            x = torch.nn.functional.pad(x, grow, value=0.0 if value is None else value)
            sizes[m] = [left + right] + [0] * (mesh.shape[m] - 1)
            continue
        plan = conv_plan(
            layout.sizes_along(dim), 1, 1, 1, (left, right), padding_mode=_MODES[mode], shift=left
        )
        peers, me = peers_along(mesh, m)
        offset = layout.local_offset(tuple(mesh.get_coordinate()))[dim]
        fill = 0.0 if value is None else float(value)  # (torch takes a float too)
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


def _constant(input, pad, value):
    """Constant padding: the engine's ``constant_pad_nd`` (no message; along a cut dim
    only the first and the last piece grow). torch's F.pad reads the fill as a float."""
    return torch.constant_pad_nd(input, pad, 0.0 if value is None else float(value))


def _cropped(input, pads, mode, value, expected):
    """``F.pad`` with negative pads (crops), in torch's order: reflect and replicate pad
    from the whole tensor, then crop (their rows may come from the cropped part);
    constant and circular crop, then pad (a circular pad wraps the cropped tensor). A
    crop is a slice of the global tensor (no message). ``expected``: torch's shape."""
    grow = [max(p, 0) for p in pads]
    if mode in ("reflect", "replicate"):
        out = _narrowed(pad(input, grow, mode, value), pads)
    else:
        out = _narrowed(input, pads)
        out = pad(out, grow, mode, value) if any(grow) else out
    if tuple(out.shape) != tuple(expected):  # never, by torch's definition of negative pads
        raise NotImplementedError(f"pad: {tuple(pads)} of a sharded dim in mode {mode!r}")
    return out


def _narrowed(x, pads):
    """``x`` without the rows the negative pads crop (the last dim first, as in ``pad``)."""
    for j in range(len(pads) // 2):
        dim = x.ndim - 1 - j
        start, stop = max(-pads[2 * j], 0), x.shape[dim] - max(-pads[2 * j + 1], 0)
        if start or stop != x.shape[dim]:
            if stop < start:  # (torch's circular mode: uninitialised memory here)
                raise NotImplementedError(
                    f"pad: cropping {start} and {x.shape[dim] - stop} rows off dim {dim} of "
                    f"{x.shape[dim]}"
                )
            x = x.narrow(dim, start, stop - start)
    return x


def _check(input, pad, mode, value) -> torch.Size:
    """torch's pad on a meta tensor of the global shape (kept per arguments): its error on
    every rank, else the shape of the result."""
    return meta_call(torch._C._nn.pad, input, tuple(pad), mode, value).shape
