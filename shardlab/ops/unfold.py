"""Sliding windows along sharded dims: ``F.unfold`` (im2col) and ``Tensor.unfold``.

Both are convolutions without the weights: each rank fetches exactly the rows its own
windows read from its neighbours (a halo, point to point, as :mod:`shardlab.ops.conv`),
then runs torch's op on the window. The window starting at row r belongs to the owner
of row r. Rows H cut [5, 3], ``F.unfold`` k=3, padding 1, stride 1::

    rank 0  rows 0-4 + row 5 (from rank 1)       -> windows 0-4   (N, C*9, 5 * W)
    rank 1  row 4 (from rank 0) + rows 5-7       -> windows 5-7   (N, C*9, 3 * W)

``F.unfold``'s last dim flattens (H_out, W_out): cut H makes it a block dim (sizes times
W_out), cut W a strided one (see :mod:`shardlab.layout._atoms`); nothing moves for it.
Backward: the halo gradients go back to their owners (the same messages reversed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardlab.comm.halo import Halo, peers_along
from shardlab.engine.registry import register as _register
from shardlab.layout import ShardLayout, conv_plan
from shardlab.ops._cnn_common import cut_once
from shardlab.ops.conv import _tuple
from shardlab.ops.registry import register
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.create import from_layout


def _halo(x, input, dim, k, s, d, pads, cause):
    """The rows of ``dim`` this rank's windows read; returns (window, output sizes)."""
    layout, mesh = input.sharding, input.device_mesh
    (m,) = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]
    plan = conv_plan(layout.sizes_along(dim), k, s, d, pads)
    peers, me = peers_along(mesh, m)
    offset = layout.local_offset(tuple(mesh.get_coordinate()))[dim]
    return Halo.apply(x, plan, dim, peers, me, offset, 0.0, cause), m, list(plan.out_sizes)


def _cut_dims(layout, dims):
    cut = {}
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and p.dim in dims:
            if p.dim in cut:
                raise NotImplementedError(f"unfold: dim {p.dim} is cut by two mesh dims")
            cut[p.dim] = m
    return cut


@register("unfold", at_function=True)
def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """``F.unfold`` of (N, C, H, W) or (C, H, W) with any of N, C, H, W cut."""
    meta = F.unfold(
        torch.empty(input.shape, device="meta"), kernel_size, dilation, padding, stride
    )  # torch's own checks and shapes, alike on every rank
    lead = input.ndim - 2
    input = cut_once("unfold", input, (lead, lead + 1))  # a spatial dim cut twice: by one
    k, d = _tuple("kernel_size", kernel_size, 2), _tuple("dilation", dilation, 2)
    p, s = _tuple("padding", padding, 2), _tuple("stride", stride, 2)
    layout, mesh = input.sharding, input.device_mesh
    cut = _cut_dims(layout, (lead, lead + 1))  # (batch and channels: cut as they are)
    x, local_pad, out_hw, sizes = input.to_local(), list(p), [], {}
    for i in range(2):
        dim = lead + i
        n_out = (input.shape[dim] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1
        out_hw.append(n_out)
        if dim in cut:
            x, m, sizes[m] = _halo(x, input, dim, k[i], s[i], d[i], (p[i], p[i]), "unfold.halo")
            local_pad[i] = 0
    # the output's layout: N as the input's; C*k*k cut like C (times k*k); H_out*W_out
    # as two atoms, each cut like its spatial dim
    kk = k[0] * k[1]
    places, entries, cuts = [], [], []
    atoms: list = [None] * meta.ndim
    atoms[-1] = tuple(out_hw)
    for m, pl in enumerate(layout.placements):
        if not isinstance(pl, Shard):
            places.append(pl)
            entries.append(None)
            cuts.append(None)
        elif pl.dim >= lead:  # a spatial dim: atom 0 (H) or 1 (W) of the last dim
            places.append(Shard(meta.ndim - 1))
            entries.append((tuple(sizes[m]),))
            cuts.append(pl.dim - lead)
        else:  # batch or channels
            places.append(Shard(pl.dim))
            scale = kk if pl.dim == lead - 1 else 1
            entries.append(tuple(tuple(v * scale for v in part) for part in layout.sizes[m]))
            cuts.append(0)
    out = ShardLayout(
        tuple(meta.shape),
        layout.mesh_shape,
        tuple(places),
        tuple(entries),
        tuple(atoms),
        tuple(cuts),
    )
    if any(n == 0 for n in out.local_shape(tuple(mesh.get_coordinate()))):
        # no window here (torch refuses an empty input): an empty block, still tied to x
        y = x.new_zeros(out.local_shape(tuple(mesh.get_coordinate()))) + x.sum() * 0
    else:
        y = F.unfold(x, k, d, local_pad, s)  # (N, C_l*k*k, H_out_l * W_out_l)
    return from_layout(y, mesh, out)


def tensor_unfold(x, dimension: int, size: int, step: int):
    """``Tensor.unfold(dimension, size, step)`` of a ShardTensor cut along ``dimension``."""
    meta = torch.empty(x.shape, device="meta").unfold(dimension, size, step)  # torch's checks
    dim = dimension % max(x.ndim, 1)
    x = cut_once("unfold", x, (dim,))  # cut by two mesh dims: by the first one only
    layout = x.sharding
    cut = _cut_dims(layout, [dim])
    if not cut or not layout.is_block(dim):
        return NotImplemented  # the aten rule: a local unfold (or the whole tensor)
    local, m, out_sizes = _halo(x.to_local(), x, dim, size, step, 1, (0, 0), "unfold.halo")
    if local.shape[dim] < size:  # no window here: an empty block of the right shape
        shape = list(local.shape)
        shape[dim] = 0
        y = local.new_zeros([*shape, size]) + local.sum() * 0
    else:
        y = local.unfold(dim, size, step)
    entries = list(layout.sizes)
    entries[m] = (tuple(out_sizes),)
    atoms = None if layout.atoms is None else layout.atoms + (None,)
    out = ShardLayout(
        tuple(meta.shape), layout.mesh_shape, layout.placements, tuple(entries), atoms, layout.cuts
    )
    return from_layout(y, x.device_mesh, out)


def _unfold_call(func, args, kwargs):
    """At ``__torch_function__``: ``x.unfold(...)`` of a ShardTensor with halos."""
    if not isinstance(args[0], ShardTensor):
        return NotImplemented
    return tensor_unfold(*args, **kwargs)


_register(torch.Tensor.unfold, at_function=True)(_unfold_call)
