"""Ops that reorder the elements along a cut dim: ``flip``, and ``sort`` / ``median`` of
a 1-D tensor cut along its only dim (``argsort``, ``msort``, ``nanmedian`` and
``masked.median`` reach these). ``dim_ops`` routes them here; along a whole dim, or with
another dim to move the cut to, each rank's block computes (``dim_ops._along_dims``:
one all-to-all moves the cut to the longest other dim, the op runs on whole lines, the
result stays cut there, as the FFT's pencils do).

``flip`` along a cut dim (:func:`flip`): each block flips itself (its rows are then the
mirror piece of the result), then the pieces are put back in reverse rank order
(``cat``): each row goes to the owner of its mirror position once, point to point
(``cat.align``), and the result is cut like the input, the same sizes.

``sort`` of a 1-D tensor cut along its only dim (:func:`sort_1d`), a sample sort::

    1. each rank sorts its block (stable: equal values in index order)
    2. p - 1 regular samples per rank and their indices, all-gathered ``sort.samples``
    3. p - 1 splitters (every rank picks the same); each element's bucket
    4. one all-gather of the p x p bucket counts              ``sort.counts``
    5. each element to its bucket's rank once, point to point ``sort.exchange``
    6. each rank orders what it got: its slice of the sorted tensor
    7. moved to the input's sizes (each element at most once) ``sort.rebalance``

The order is torch's stable one: ascending, NaN last, equal values (``-0.0`` and ``0.0``
too) in index order; descending, NaN first. torch's own CPU sort with ``stable=False``
may order equal values otherwise (it does not say how): there the values equal torch's
and the indices may differ on ties (``median``'s index on ties too). ``median`` /
``nanmedian``: steps 1-6, one all-reduce of the count of non-NaN values
(``median.count``), then one all-gather of one value and one index per rank
(``median.value``) gives every rank the one at sorted position ``(n - 1) // 2`` (of the
non-NaN ones for ``nanmedian``; ``median`` of values with a NaN: the first NaN),
Replicate. Not yet: the backward of ``sort`` (a ``scatter`` of the gradient by the
indices along the cut dim) gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardlab.comm import collectives, p2p
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten


def _cut_once(layout, dims) -> dict | None:
    """dim -> the one mesh dim (of more than one rank) cutting it in blocks; None when
    a dim is cut twice or strided."""
    out = {}
    for d in dims:
        cut = layout.cut_by(d)
        if len(cut) > 1 or (cut and not layout.is_block(d)):
            return None
        if cut:
            out[d] = cut[0]
    return out


def flip(x, dims):
    """``flip(x, dims)`` along cut dims; NotImplemented where a dim is cut twice."""
    lay = c.without_partial(x._layout)
    mesh = x.device_mesh
    cut = _cut_once(lay, dims)
    if cut is None:
        return NotImplemented
    x = c.reduced(x, "flip.partial")
    y = c.wrap(torch.flip(x._local_tensor, dims), mesh, x._layout)  # 1. each block
    for d, m in cut.items():  # 2. the pieces in reverse rank order: rows to their owners
        sizes = lay.shard_sizes(m)
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        pieces = [aten.slice.Tensor(y, d, starts[k], starts[k] + sizes[k])
                  for k in reversed(range(len(sizes)))]  # fmt: skip
        y = aten.cat.default(pieces, d)
    return y


def sortable(x) -> int | None:
    """The mesh dim cutting a 1-D ``x`` (the others Replicate or Partial), else None."""
    lay = c.without_partial(x._layout)
    if x.ndim != 1 or not lay.is_block():
        return None
    cut = lay.cut_by(0)
    if len(cut) != 1 or any(isinstance(p, Shard) and p.dim == 0 and m != cut[0]
                            for m, p in enumerate(lay.placements)):  # fmt: skip
        return None
    return cut[0]


def _before(av, ai, bv, bi, descending):
    """Does (av, ai) come before (bv, bi) in torch's stable order? (broadcast)"""
    an, bn = torch.isnan(av), torch.isnan(bv)
    if descending:
        lt = (an & ~bn) | (av > bv)
    else:
        lt = (~an & bn) | (av < bv)
    eq = (an & bn) | (av == bv)
    return lt | (eq & (ai < bi))


def _ordered(v, i, descending):
    """``v`` (with global indices ``i``) in torch's stable order."""
    by_index = torch.sort(i, stable=True).indices
    v, i = v[by_index], i[by_index]
    order = torch.sort(v, stable=True, descending=descending).indices
    return v[order], i[order]


def _exchanged(x, m, descending):
    """Steps 1-6: (this rank's run of the sorted values, their global indices, the runs'
    sizes in rank order)."""
    mesh, me = x.device_mesh, c.me(x.device_mesh)
    group, p, r = mesh.get_group(m), mesh.shape[m], me[m]
    block = x._local_tensor
    start = x._layout.local_offset(me)[0]
    v, i = _ordered(block, torch.arange(start, start + block.shape[0]), descending)  # 1.
    n = v.shape[0]
    pick = torch.tensor([(j * n) // p for j in range(1, p)], dtype=torch.int64)  # < n
    none = torch.full((p - 1,), -1, dtype=torch.int64)  # an empty block: index -1, no sample
    mine = (v[pick], i[pick]) if n else (v.new_zeros(p - 1), none)
    got = [[torch.empty_like(t) for _ in range(p)] for t in mine]
    with label("sort.samples"):  # 2. values and their indices
        for out, t in zip(got, mine):
            collectives.all_gather(out, t.contiguous(), group)
    sv, si = (torch.cat(g) for g in got)
    ok = si >= 0
    sv, si = _ordered(sv[ok], si[ok], descending)  # 3. every rank alike
    k = sv.shape[0]
    at = torch.tensor([(j * k) // p for j in range(1, p)], dtype=torch.int64)
    spv, spi = (sv[at], si[at]) if k else (v.new_zeros(0), si[:0])
    if spv.numel():
        after = _before(spv[None, :], spi[None, :], v[:, None], i[:, None], descending)
        bucket = (after | (spi[None, :] == i[:, None])).sum(1)
    else:
        bucket = torch.zeros(n, dtype=torch.int64)
    counts = torch.bincount(bucket, minlength=p).to(torch.int64)
    every = [torch.empty_like(counts) for _ in range(p)]
    with label("sort.counts"):  # 4.
        collectives.all_gather(every, counts, group)
    table = torch.stack(every).tolist()  # [sender][receiver]
    ops, recv = [], []
    sends = list(zip(torch.split(v, counts.tolist()), torch.split(i, counts.tolist())))
    for q in range(p):  # 5. each element to its bucket's rank
        peer = p2p.rank_at(mesh, tuple(q if a == m else b for a, b in enumerate(me)))
        bufs = (v.new_empty(table[q][r]), i.new_empty(table[q][r]))
        recv.append(bufs if q != r else sends[r])
        if q == r:
            continue
        for t, b in zip(sends[q], bufs):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), peer))
            if b.numel():
                ops.append(dist.P2POp(dist.irecv, b, peer))
    with label("sort.exchange"):
        p2p.run_p2p(ops)
    v, i = _ordered(
        torch.cat([b[0] for b in recv]), torch.cat([b[1] for b in recv]), descending
    )  # fmt: skip  (6.)
    return v, i, [sum(table[s][q] for s in range(p)) for q in range(p)]


def _run_layout(x, m, sizes) -> ShardLayout:
    lay = c.without_partial(x._layout)
    entry = [sizes if k == m else lay.sizes_arg(k) for k in range(len(lay.placements))]
    return ShardLayout.build(lay.global_shape, lay.mesh_shape, lay.placements, entry)


def sort_1d(x, m, descending):
    """(values, indices) of ``sort(x, 0, descending)`` in ``x``'s layout (stable order)."""
    x = c.reduced(x, "sort.partial")
    v, i, sizes = _exchanged(x, m, descending)
    mesh, lay = x.device_mesh, x._layout
    run = _run_layout(x, m, sizes)
    with label("sort.rebalance"):  # 7.
        values = c.move(c.wrap(v, mesh, run), lay, "sort.rebalance")
        indices = c.move(c.wrap(i, mesh, run), lay, "sort.rebalance")
    return values, indices


def median_1d(x, m, nan_skip):
    """(value, index) of ``median(x, 0)`` (``nanmedian``), each Replicate, 0-d: torch's
    lower median; ``median`` of values with a NaN: the first NaN."""
    x = c.reduced(x, "median.partial")
    mesh, me = x.device_mesh, c.me(x.device_mesh)
    group, n = mesh.get_group(m), x.shape[0]
    v, i, sizes = _exchanged(x, m, False)
    real = torch.tensor([int((~torch.isnan(x._local_tensor)).sum())], dtype=torch.int64)
    with label("median.count"):  # the NaN sort last: how many come before them
        collectives.all_reduce_(real, group=group)
    real = int(real)
    if nan_skip:
        k = (real - 1) // 2 if real else 0
    else:
        k = real if real < n else (n - 1) // 2
    owner = next(q for q in range(len(sizes)) if sum(sizes[: q + 1]) > k)
    at = k - sum(sizes[:owner])
    mine = (v[at : at + 1], i[at : at + 1]) if me[m] == owner else (v[:1], i[:1])
    out = []
    with label("median.value"):  # the owner's value and index, to every rank
        for t in mine:
            t = t.contiguous() if t.numel() else t.new_zeros(1)
            got = [torch.empty_like(t) for _ in range(mesh.shape[m])]
            collectives.all_gather(got, t, group)
            out.append(got[owner].reshape(()))
    whole = ShardLayout.build((), x._layout.mesh_shape, [Replicate()] * mesh.ndim)
    return c.wrap(out[0], mesh, whole), c.wrap(out[1], mesh, whole)


@register(aten.median.default, aten.nanmedian.default)
def _median(func, args, kwargs):
    """``median(x)`` of a 1-D ``x`` cut along its only dim (:func:`median_1d`'s value)."""
    x = args[0]
    m = sortable(x) if type(x) is c.ShardTensor and not kwargs else None
    if m is None:
        return NotImplemented
    return median_1d(x, m, func is aten.nanmedian.default)[0]
