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

Along a cut dim (an FFT over H of an image cut along H), the transposition scheme of the
distributed FFT libraries (:func:`_transposed`): the cut moves to a dim the transform does
not touch, each element sent once, and the result stays cut there::

    x (B, H, W) cut along H, torch.fft.fft2(x) (dims H, W):
      1. fft over W on each block (W is whole)          (B, H_r, W)
      2. the cut moves from H to W (an all-to-all)      (B, H, W_r)
      3. fft over H on each block                       (B, H, W_r)   cut along W

Transforms over several dims are separable, so they run in stages: ``rfftn`` is an
``rfft`` over the last dim, then a complex FFT over the others; ``irfftn`` the reverse.
Each stage's normalisation is the same mode (its product is the whole one's). A 1-D
signal cut along its only dim has nowhere to move the cut: this rule declines, and the
next stage computes it on the whole tensor, and says so (:class:`shardlab.GatherWarning`).
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
        return _transposed(func, args, kwargs)  # a transformed dim cut across ranks
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


def _stages(func, args) -> list:
    """The separable stages of one transform: ``[(func, args), ...]``, each over some of
    the dims, run in order; the normalisation mode repeats (its product is the whole)."""
    dims, norm, last = list(args[1]), args[2], args[3]
    if len(dims) == 1:
        return [(func, args)]
    head, tail, c2c = dims[:-1], dims[-1:], aten._fft_c2c.default
    if func is aten._fft_r2c.default:  # real -> half spectrum along the last, then the rest
        return [(func, (None, tail, norm, last)), (c2c, (None, head, norm, True))]
    if func is aten._fft_c2r.default:  # the rest first, then half spectrum -> real
        return [(c2c, (None, head, norm, False)), (func, (None, tail, norm, last))]
    return [(func, (None, dims, norm, last))]


def _targets(places, shape, mesh, dims, later, earlier) -> dict | None:
    """Mesh dim -> the tensor dim its cut moves to, for the mesh dims (of more than one
    rank) that cut one of ``dims``; None if one has nowhere to go. A target is a dim the
    stage does not transform and nothing else cuts: first one no later stage transforms,
    then one an earlier stage did (the pencils of the FFT libraries: an ``rfft2`` over
    (H, W) cut along H leaves its result cut along W, and ``irfft2`` moves it back), then
    the longest (from placements and the global shape: every rank picks the same)."""
    moving = [m for m, p in enumerate(places)
              if isinstance(p, Shard) and p.dim in dims and mesh.shape[m] > 1]  # fmt: skip
    staying = {p.dim for m, p in enumerate(places) if isinstance(p, Shard) and m not in moving}
    free = [d for d in range(len(shape)) if d not in dims and d not in staying]
    free.sort(key=lambda d: (d in later, d not in earlier, -shape[d], d))
    out, by_source = {}, {}
    for m in moving:  # mesh dims nested on one source dim stay nested on one target
        src = places[m].dim
        if src not in by_source:
            if not free:
                return None
            by_source[src] = free.pop(0)
        out[m] = by_source[src]
    return out


def _transposed(func, args, kwargs):
    """An FFT along a cut dim: per stage, the cuts on its dims move away (an all-to-all),
    then the stage runs on each block; the result stays cut where the last move put it.

    Messages: per stage that moves, each element of the tensor sent once (point to point,
    ``<op>.transpose``); a Partial input summed first (one all-reduce)."""
    x = args[0]
    if kwargs or x._layout.atoms is not None:
        return NotImplemented  # (a view's merged dims: not here)
    mesh, name = x.device_mesh, c.op_name(func)
    # 0. every stage and move decided first (placements and global shape only): decline
    #    before sending anything. A complex stage over cut and whole dims splits: the
    #    whole ones first, on each block, then the cut ones, whose cuts may move there
    #    (one dim at a time where the cuts outnumber the dims they can go to).
    todo, stages, places = _stages(func, args), [], c.without_partial(x._layout).placements
    while todo:
        f, a = todo.pop(0)
        dims = [d % x.ndim for d in a[1]]
        cut = {p.dim for m, p in enumerate(places)
               if isinstance(p, Shard) and mesh.shape[m] > 1} & set(dims)  # fmt: skip
        if f is aten._fft_c2c.default and cut and len(cut) < len(dims):
            whole = [d for d in dims if d not in cut]
            todo[:0] = [(f, (None, whole, *a[2:])), (f, (None, sorted(cut), *a[2:]))]
            continue
        later = {d % x.ndim for _, b in todo for d in b[1]}
        earlier = {d % x.ndim for _, b, _ in stages for d in b[1]}
        to = _targets(places, x.shape, mesh, set(dims), later, earlier)
        if to is None and f is aten._fft_c2c.default and len(dims) > 1:
            todo[:0] = [(f, (None, [d], *a[2:])) for d in dims]  # one dim at a time
            continue
        if to is None:
            return NotImplemented  # nowhere to move a cut: the whole-tensor path says so
        places = tuple(Shard(to[m]) if m in to else p for m, p in enumerate(places))
        stages.append((f, a, to))
    y = c.reduced(x, f"{name}.partial")
    for f, a, to in stages:
        if to:  # 1. this stage's dims made whole: each element sent once
            lay = y._layout
            new = [Shard(to[m]) if m in to else p for m, p in enumerate(lay.placements)]
            sizes = [_even(lay.global_shape[to[m]], mesh.shape[m]) if m in to
                     and list(to.values()).count(to[m]) == 1 else
                     None if m in to else lay.sizes_arg(m) for m in range(len(new))]  # fmt: skip
            y = c.move(y, lay.with_placements(new, sizes), f"{name}.transpose")
        y = f(y, *a[1:])  # 2. the stage on each block (the plan above, no message)
    return y


def _even(length: int, parts: int) -> list[int]:
    """``length`` in ``parts`` pieces that differ by at most one (7 in 3: [3, 2, 2])."""
    return [length // parts + (i < length % parts) for i in range(parts)]
