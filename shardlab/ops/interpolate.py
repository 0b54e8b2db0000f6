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
``mode='area'`` is ``adaptive_avg_pool`` (see :mod:`.pool`).

``antialias=True`` (bilinear, bicubic; downsampling widens each output's window with the
scale): torch resamples one dim at a time, W then H; so does this, W then H: a whole dim by
torch's own kernel, a cut dim by the same steps 1-2 with torch's own weights (asked of
torch once per shape: its kernel run on an identity, row ``l`` of which gives every
output's weight for input row ``l``). uint8 images (torch rounds each pass in fixed point)
and half precision (torch's CPU kernel has none) raise NotImplementedError on a cut dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardlab.comm.halo import Halo, peers_along
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
from shardlab.ops.registry import register, rule

_LINEAR = ("linear", "bilinear", "trilinear")
_CUBIC_A = -0.75


@register("interpolate", at_function=True)
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
    if align_corners is None:
        align_corners = False  # as torch, for the interpolating modes
    if mode == "area":
        return rule(f"adaptive_avg_pool{n}d").handler(input, list(shape[2:]))
    if size is not None or recompute_scale_factor:
        scales = [None] * n
    else:
        sf = scale_factor if isinstance(scale_factor, (list, tuple)) else [scale_factor] * n
        scales = [float(s) for s in sf]
    if antialias:
        return _antialiased(input, mode, shape, align_corners, scales, sharded)
    x, new_sizes = input.to_local(), {}  # (N, C, *S_local)
    for dim, m in sorted(sharded.items()):
        i = dim - 2
        table = _table(mode, input.shape[dim], shape[dim], align_corners, scales[i], x, dim)
        x, new_sizes[m] = _along(x, input, dim, m, *table)
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


def _along(x, input, dim, m, anchor, idx, w, valid=None):
    """Steps 1-2 along the cut ``dim`` (mesh dim ``m``) for the table ``anchor`` (O,),
    ``idx`` (O, T), ``w`` (O, T) or None, ``valid`` (O, T) or None (every tap):
    the resampled block and the output's sizes along ``dim``."""
    in_sizes = input.sharding.sizes_along(dim)
    own = owners(anchor, in_sizes)
    out_sizes = [int((own == r).sum()) for r in range(len(in_sizes))]
    bounds = [sum(out_sizes[:r]) for r in range(len(in_sizes) + 1)]
    needed = [sorted(set(idx[bounds[r] : bounds[r + 1]].flatten().tolist())) for r in
              range(len(in_sizes))]  # fmt: skip
    plan = RowPlan(in_sizes, needed, out_sizes)
    peers, me = peers_along(input.device_mesh, m)
    # 1. fetch the rows this rank's outputs read
    x = Halo.apply(x, plan, dim, peers, me, my_offset(input, dim), 0.0, "interpolate.halo")
    lo, hi = bounds[me], bounds[me + 1]
    pos = torch.searchsorted(torch.tensor(needed[me], dtype=torch.long), idx[lo:hi])
    # 2. resample along dim                                   (N, C, ..., O_local, ...)
    cut = lambda t: None if t is None else t[lo:hi]  # noqa: E731
    return _resample(x, dim, pos, cut(w), cut(valid)), out_sizes


def _resample(x, dim, pos, w, valid=None):
    """Rows ``pos`` (O, T) of ``x`` along ``dim``, weighted by ``w`` (O, T) and summed
    over the taps (the table is planned on the CPU; it moves to ``x``'s device). A tap
    that is not ``valid`` (a window shorter than T) adds nothing (not ``0 * row``: an
    infinite row would make it nan)."""
    pos = pos.to(x.device)
    w = None if w is None else w.to(x.device)
    if w is None:
        return x.index_select(dim, pos[:, 0].contiguous())
    shape = [1] * x.ndim
    shape[dim] = pos.shape[0]
    out = None
    for t in range(pos.shape[1]):  # tap by tap, as torch sums them
        term = x.index_select(dim, pos[:, t].contiguous()) * w[:, t].view(shape)
        if valid is not None and not bool(valid[:, t].all()):
            term = torch.where(valid[:, t].to(x.device).view(shape), term, 0.0)
        out = term if out is None else out + term
    return out


def _antialiased(input, mode, shape, align_corners, scales, sharded):
    """``antialias=True``: W, then H, as torch's separable kernel resamples them; a whole
    dim by torch's kernel (the other dim's size kept: left as it is), a cut dim by its
    weight table (:func:`_aa_table`, asked of the same kernel on the same device: where
    a dim keeps its size the CPU kernel copies it, and so does the table)."""
    if input.dtype not in (torch.float32, torch.float64):
        raise NotImplementedError(
            "interpolate: antialias=True on an image cut along a spatial dim is supported "
            f"for float32 and float64; got {input.dtype} with sharded dims "
            f"{sorted(sharded)}: cast the image, or cut the batch"
        )
    kernel = getattr(torch._C._nn, f"_upsample_{mode}2d_aa")
    x, new_sizes = input.to_local(), {}  # (N, C, H_local, W_local)
    for dim in (3, 2):
        i = dim - 2
        if dim in sharded:
            table = _aa_table(mode, input.shape[dim], shape[dim], align_corners, scales[i],
                              x.dtype, str(x.device))  # fmt: skip
            x, new_sizes[sharded[dim]] = _along(x, input, dim, sharded[dim], *table)
            continue
        if input.shape[dim] == shape[dim] and x.device.type == "cpu":
            continue  # torch's CPU kernel copies it (and its backward would not: 2.13)
        sizes, per_dim = list(x.shape[2:]), [None, None]
        sizes[i], per_dim[i] = shape[dim], scales[i]
        if x.numel() == 0:
            x = empty_like_output(x, [*x.shape[:2], *sizes])
        elif dim == 2 and x.shape[3] == 1:  # a block 1 wide (see _aa_table): as 2 wide
            x = kernel(torch.cat([x, x], 3), [sizes[0], 2], align_corners, *per_dim)[..., :1]
        else:
            x = kernel(x, sizes, align_corners, *per_dim)
    return rewrap(x, input, new_sizes, shape)


@functools.lru_cache(maxsize=64)
def _aa_table(mode, length, out, align_corners, scale, dtype, device, chunk=256):
    """The antialiased table of one dim, on the CPU: anchor (O,), rows (O, T), weights
    (O, T) and which taps are real (O, T).

    The weights are torch's own: its kernel run on an identity (channel l holds input
    row l alone, ``chunk`` rows at a time) resamples H, W = 2 left as it is (torch 2.13
    resamples H wrongly when W comes out 1 wide: every output repeats the first one).
    Each output's window is the span of its nonzero weights; its anchor, the window's
    middle row, grows with the output (outputs stay in order across the ranks). Only the
    nonzero weights are kept (a window is ~4 x scale rows, not L); built with autograd
    and inference mode off (a table made under ``inference_mode`` is used in training)."""
    kernel = getattr(torch._C._nn, f"_upsample_{mode}2d_aa")
    rows, cols, vals = [], [], []
    with torch.inference_mode(False), torch.no_grad():
        for lo in range(0, length, chunk):
            n = min(chunk, length - lo)
            eye = torch.zeros(1, n, length, 2, dtype=dtype, device=device)  # (1, rows, L, 2)
            eye[0, torch.arange(n), torch.arange(lo, lo + n)] = 1
            w = kernel(eye, [out, 2], align_corners, scale, None)[0, :, :, 0].cpu()  # (rows, O)
            r, o = w.nonzero(as_tuple=True)
            rows.append(r + lo), cols.append(o), vals.append(w[r, o])
        r, o, v = torch.cat(rows), torch.cat(cols), torch.cat(vals)
        big = torch.full((out,), length, dtype=torch.long)
        first = big.scatter_reduce(0, o, r, "amin")
        last = torch.full((out,), -1, dtype=torch.long).scatter_reduce(0, o, r, "amax")
        has = last >= 0
        first, last = torch.where(has, first, 0), torch.where(has, last, 0)
        taps = int((last - first + 1)[has].max()) if bool(has.any()) else 1
        weights = torch.zeros(out, taps, dtype=dtype)
        weights[o, r - first[o]] = v
        span = first.view(-1, 1) + torch.arange(taps)
        valid = (span <= last.view(-1, 1)) & has.view(-1, 1)
        table_rows = torch.where(valid, span, first.view(-1, 1)).clamp_max(length - 1)
        mid = torch.where(has, (first + last) // 2, torch.full_like(first, -1))
        anchor = torch.cummax(mid, 0).values.clamp_min(0)
    return anchor, table_rows, weights, valid


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
