"""Fourier transforms along dims no mesh dim cuts: each rank transforms its own block.

``torch.fft.*`` reaches aten as ``_fft_r2c`` / ``_fft_c2r`` / ``_fft_c2c`` over a list of
dims. When no mesh dim of more than one rank cuts one of them, every rank holds whole
lines along each transformed dim, and the transform of its block is its block of the
transform::

    x (B, C, H, W) cut along H, torch.fft.rfft(x, dim=-1):
        rank r: rfft(x[:, :, H_r, :]) = rfft(x)[:, :, H_r, :]     (B, C, H_r, W // 2 + 1)

1. a Partial input summed first (one all-reduce);
2. the op on each block: the plan, no message. The result keeps ``x``'s cuts; only the
   transformed dims change size (``rfft``'s last one halves, ``irfft``'s grows).

Along a cut dim (an FFT over H of an image cut along H) this rule declines: the next
stage computes it on the whole tensor, and says so (:class:`shardlab.GatherWarning`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.engine import _common as c
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import moves

aten = torch.ops.aten


@register(aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default)
def _fft(func, args, kwargs):
    x = args[0]
    dims = {d % max(x.ndim, 1) for d in args[1]}
    lay = c.without_partial(x._layout)
    mesh = x.device_mesh
    if any(isinstance(p, Shard) and p.dim in dims and mesh.shape[m] > 1
           for m, p in enumerate(lay.placements)):  # fmt: skip
        return NotImplemented  # a transformed dim cut across ranks
    if lay.atoms is not None and any(lay.atoms[d] is not None for d in dims):
        return NotImplemented  # (a transformed dim that views merged: not here)
    meta = meta_call(func, args, kwargs)
    if not isinstance(meta, torch.Tensor):
        return NotImplemented
    one_rank = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim in dims]
    if one_rank:  # cut by mesh dims of one rank (whole): Replicate says the same, no message
        lay = moves.replicated(lay, one_rank)
    out = lay.replace(global_shape=tuple(meta.shape))
    first = None if lay == x._layout else (lay,) + (None,) * (len(args) + len(kwargs) - 1)
    local = _OnBlock(func, out.local_shape(c.me(mesh)), meta.dtype)
    return Plan(mesh, out, first, f"{c.op_name(func)}.partial", local)


class _OnBlock:
    """The transform of this rank's block; an empty block (which the FFT libraries
    refuse) gives its empty result directly."""

    __slots__ = ("func", "shape", "dtype")

    def __init__(self, func, shape, dtype):
        self.func, self.shape, self.dtype = func, tuple(shape), dtype

    def __call__(self, args, kwargs):
        if args[0].numel() == 0:
            return args[0].new_empty(self.shape, dtype=self.dtype)
        return self.func(*args, **kwargs)
