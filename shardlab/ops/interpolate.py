"""Domain-parallel ``F.interpolate``: nearest, nearest-exact, (bi/tri)linear, bicubic, area.

Each output row o along a dim reads a few input rows around its source coordinate
(torch's formulas, per mode). The rank owning o's *anchor* row computes it: nearest
modes, the row read (no message ever); linear / cubic, the input pixel holding the
output pixel's centre, ``(2o + 1) L // 2O`` (align_corners: the nearest sample). So x2
upsampling exactly doubles every shard, like ``conv_transpose(k=2, s=2)``, and a U-Net's
skip connections line up with the upsampled path. Linear x2, sizes [3, 2]::

    input    [ r0: 0 1 2 | r1: 3 4 ]
    output   o = 0..9, source (o + 0.5) / 2 - 0.5 reads floor and floor + 1
    rank 0   outputs 0-5 (anchors 0 0 1 1 2 2) read rows 0..3: row 3 from rank 1
    rank 1   outputs 6-9 (anchors 3 3 4 4) read rows 2..4: row 2 from rank 0

Per call::

    1. for each sharded spatial dim: which input rows each rank's outputs read (exact
       table from torch's coordinate formulas), fetched point to point
       (:class:`RowPlan` + :class:`Halo`, label ``interpolate.halo``)
    2. along that dim: out = sum_t w[o, t] * window[row(o, t)] (nearest: a gather)
       -> (N, C, ..., O_local, ...)
    3. the unsharded spatial dims: torch's own kernel on the local block with the
       explicit output size and the same per-dim scale (the sharded dims keep their
       size: an exact copy there)

Backward: autograd through the gathers and the kernel; the halo rows' gradients go back
to their owners (the same messages, reversed). No collective.

Index tables: nearest modes ask torch itself (a probe holding ``arange``: exact, so the
same rows as one device); linear and cubic replay torch's formulas in its compute dtype
(float64 for double inputs, else float32), so the weights match torch to rounding.
``antialias=True`` on a sharded dim raises NotImplementedError (a wider, scale-dependent
window); ``mode='area'`` is ``adaptive_avg_pool`` (see :mod:`.pool`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlab.ops._cnn_common import (
    RowPlan,
    check_input,
    empty_like_output,
    meta_call,
    my_offset,
    owners,
    rewrap,
    spatial_mesh_dims,
)
from shardlab.ops.halo import Halo, peers_along
from shardlab.ops.registry import HANDLERS, register

_LINEAR = ("linear", "bilinear", "trilinear")
_CUBIC_A = -0.75


@register("interpolate")
def interpolate(
    input, size=None, scale_factor=None, mode="nearest", align_corners=None,
    recompute_scale_factor=None, antialias=False,
):  # fmt: skip
    input = check_input("interpolate", input)
    args = (size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    shape = tuple(meta_call(F.interpolate, input, *args).shape)  # torch's checks and sizes
    n, layout = input.ndim - 2, input.sharding
    sharded = spatial_mesh_dims(layout)
    if not sharded:  # batch / channel shards: whole images on every rank
        x = input.to_local()
        local = list(x.shape[:2]) + list(shape[2:])
        y = empty_like_output(x, local) if x.numel() == 0 else F.interpolate(x, *args)
        return rewrap(y, input, {}, shape)
    if antialias:
        raise NotImplementedError(
            "interpolate: antialias=True on a sharded spatial dim is not supported (its "
            f"window grows with the scale); sharded dims {sorted(sharded)}"
        )
    if align_corners is None:
        align_corners = False  # as torch, for the interpolating modes
    if mode == "area":
        return HANDLERS[f"adaptive_avg_pool{n}d"](input, list(shape[2:]))
    if size is not None or recompute_scale_factor:
        scales = [None] * n
    else:
        sf = scale_factor if isinstance(scale_factor, (list, tuple)) else [scale_factor] * n
        scales = [float(s) for s in sf]
    x, mesh, new_sizes = input.to_local(), input.device_mesh, {}  # (N, C, *S_local)
    for dim, m in sorted(sharded.items()):
        i = dim - 2
        anchor, idx, w = _table(
            mode, input.shape[dim], shape[dim], align_corners, scales[i], x, dim
        )
        in_sizes = layout.sizes_along(dim)
        own = owners(anchor, in_sizes)
        out_sizes = [int((own == r).sum()) for r in range(len(in_sizes))]
        bounds = [sum(out_sizes[:r]) for r in range(len(in_sizes) + 1)]
        needed = [sorted(set(idx[bounds[r] : bounds[r + 1]].flatten().tolist())) for r in
                  range(len(in_sizes))]  # fmt: skip
        plan = RowPlan(in_sizes, needed, out_sizes)
        peers, me = peers_along(mesh, m)
        # 1. fetch the rows this rank's outputs read
        x = Halo.apply(x, plan, dim, peers, me, my_offset(input, dim), 0.0, "interpolate.halo")
        lo, hi = bounds[me], bounds[me + 1]
        pos = torch.searchsorted(torch.tensor(needed[me], dtype=torch.long), idx[lo:hi])
        # 2. resample along dim                                   (N, C, ..., O_local, ...)
        x = _resample(x, dim, pos, None if w is None else w[lo:hi])
        new_sizes[m] = out_sizes
    # 3. torch's kernel on the unsharded spatial dims
    local = list(x.shape[:2]) + [x.shape[d] if d in sharded else shape[d] for d in
                                 range(2, input.ndim)]  # fmt: skip
    if len(sharded) < n:
        if x.numel() == 0:
            x = empty_like_output(x, local)
        else:
            x = _torch_kernel(x, mode, local[2:], align_corners, [
                None if 2 + i in sharded else scales[i] for i in range(n)
            ])  # fmt: skip
    return rewrap(x, input, new_sizes, shape)


def _resample(x, dim, pos, w):
    """Rows ``pos`` (O, T) of ``x`` along ``dim``, weighted by ``w`` (O, T) and summed
    over the taps (the table is planned on the CPU; it moves to ``x``'s device)."""
    pos = pos.to(x.device)
    w = None if w is None else w.to(x.device)
    if w is None:
        return x.index_select(dim, pos[:, 0].contiguous())
    shape = [1] * x.ndim
    shape[dim] = pos.shape[0]
    out = None
    for t in range(pos.shape[1]):  # tap by tap, as torch sums them
        term = x.index_select(dim, pos[:, t].contiguous()) * w[:, t].view(shape)
        out = term if out is None else out + term
    return out


def _torch_kernel(x, mode, sizes, align_corners, scales):
    n = len(sizes)
    nn = torch._C._nn
    if mode == "nearest":
        return getattr(nn, f"upsample_nearest{n}d")(x, sizes, *scales)
    if mode == "nearest-exact":
        return getattr(nn, f"_upsample_nearest_exact{n}d")(x, sizes, *scales)
    if mode in _LINEAR:
        fn = {1: nn.upsample_linear1d, 2: nn.upsample_bilinear2d, 3: nn.upsample_trilinear3d}[n]
        return fn(x, sizes, align_corners, *scales)
    return nn.upsample_bicubic2d(x, sizes, align_corners, *scales)


def _table(mode, length, out, align_corners, scale, x, dim):
    """Per global output row: anchor (O,), input rows (O, T), weights (O, T) or None."""
    if mode in ("nearest", "nearest-exact"):  # ask torch: a probe holding row numbers,
        # through the same n-d kernel at the same dim (nearest2d alone copies when O == L)
        n, i = x.ndim - 2, dim - 2
        shape, sizes, scales = [1] * n, [1] * n, [None] * n
        shape[i], sizes[i], scales[i] = length, out, scale
        probe_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        probe = torch.arange(length, dtype=probe_dtype).view(1, 1, *shape)
        rows = _torch_kernel(probe, mode, sizes, None, scales).reshape(out).long()
        return rows, rows.view(out, 1), None
    op = torch.float64 if x.dtype == torch.float64 else torch.float32  # torch's opmath
    o = torch.arange(out, dtype=op)
    if mode in _LINEAR and out == length:  # torch copies
        rows = torch.arange(out)
        w = torch.stack([torch.ones(out, dtype=op), torch.zeros(out, dtype=op)], 1)
        return rows, torch.stack([rows, rows], 1), w.to(x.dtype)
    if align_corners:
        zero = torch.tensor(0.0, dtype=op)
        ratio = torch.tensor(length - 1, dtype=op) / (out - 1) if out > 1 else zero
        src = ratio * o
    else:
        if scale is not None and scale > 0:
            ratio = torch.tensor(1.0 / scale, dtype=op)
        else:
            ratio = torch.tensor(length, dtype=op) / out
        src = ratio * (o + 0.5) - 0.5
        if mode in _LINEAR:
            src = src.clamp_min(0)
    base = torch.floor(src.float()).long().clamp_max(length - 1)  # torch's floorf
    lam = (src - base.to(op)).clamp(0, 1)
    if align_corners:  # the nearest sample
        anchor = (2 * torch.arange(out) * (length - 1) + out - 1) // max(2 * (out - 1), 1)
    else:  # the input pixel holding the output pixel's centre
        anchor = ((2 * torch.arange(out) + 1) * length // (2 * out)).clamp_max(length - 1)
    if mode in _LINEAR:
        rows = torch.stack([base, base + (base < length - 1).long()], 1)
        return anchor, rows, torch.stack([1 - lam, lam], 1).to(x.dtype)
    a = _CUBIC_A  # bicubic: 4 taps around base, clamped to the input
    c1 = lambda t: ((a + 2) * t - (a + 3)) * t * t + 1  # noqa: E731
    c2 = lambda t: ((a * t - 5 * a) * t + 8 * a) * t - 4 * a  # noqa: E731
    w = torch.stack([c2(lam + 1), c1(lam), c1(1 - lam), c2(2 - lam)], 1)
    rows = (base.view(-1, 1) + torch.arange(-1, 3)).clamp(0, length - 1)
    return anchor, rows, w.to(x.dtype)
