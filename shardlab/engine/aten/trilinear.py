"""``_trilinear`` (``nn.Bilinear``'s and ``F.bilinear``'s product) with its inputs cut alike.

``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` unsqueezes each input at its
``expand`` dims to a common rank, multiplies the three and sums over ``sumdim``::

    F.bilinear(x1, x2, W):  x1 (N, I) -> (N, 1, I, 1)    W (O, I, J) -> (1, O, I, J)
                            x2 (N, J) -> (N, 1, 1, J)    summed over I and J: (N, O)

Each mesh dim that cuts an input cuts one common dim D. Every input that has D (not
expanded there, size > 1) is cut there alike (its own blocks as they are; a whole one
sliced to this rank's range, no message); then each rank runs ``_trilinear`` on its
blocks:

- D summed: the result is Partial(sum) on that mesh dim (``x1`` cut along I: each rank
  its part of the contraction);
- D kept: the result is cut along D's output dim in the same sizes (a batch cut).

No message. Else (inputs cut differently along D, a Partial input, a cut dim
broadcast): ``NotImplemented`` (the fallback, which says so). The backward is three
``_trilinear`` calls with the gradient: the same rule.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _positions(ndim: int, expand, total: int) -> list[int]:
    """Each of an input's dims' position among the ``total`` common dims."""
    kept = [d for d in range(total) if d not in set(expand)]
    return kept[:ndim]


def _cut_dims(t) -> dict[int, list[int]]:
    """A ShardTensor's cut dims: dim -> the mesh dims (of more than one rank) cutting it."""
    out: dict[int, list[int]] = {}
    if type(t) is c.ShardTensor:
        for k, p in enumerate(t._layout.placements):
            if isinstance(p, Shard) and t._layout.mesh_shape[k] > 1:
                out.setdefault(p.dim, []).append(k)
    return out


@register(aten._trilinear.default)
def trilinear(func, args, kwargs):
    if kwargs or len(args) < 7:
        return NotImplemented
    ins, expands, sumdim = list(args[:3]), args[3:6], set(args[6])
    shards = [t for t in ins if type(t) is c.ShardTensor]
    if not shards:
        return NotImplemented
    mesh = shards[0].device_mesh
    total = ins[0].ndim + len(expands[0])
    pos = [_positions(t.ndim, e, total) for t, e in zip(ins, expands)]
    full = [1] * total
    for t, ps in zip(ins, pos):
        for d, dd in enumerate(ps):
            full[dd] = max(full[dd], t.shape[d])
    cuts: dict[int, tuple] = {}  # mesh dim -> (common dim D, its sizes entry)
    by_dim: dict[int, list[int]] = {}  # D -> the mesh dims cutting it
    common: dict[int, tuple[int, int]] = {}  # D -> this rank's (start, stop)
    coord = c.me(mesh)
    for t, ps in zip(ins, pos):
        if type(t) is not c.ShardTensor:
            continue
        lay = t._layout
        if t.device_mesh != mesh or not lay.is_block():
            return NotImplemented
        if any(isinstance(p, Partial) for p in lay.placements):
            return NotImplemented
        box = lay.local_box(coord)
        for d, ks in _cut_dims(t).items():
            dd = ps[d]
            if t.shape[d] != full[dd] or by_dim.setdefault(dd, ks) != ks:
                return NotImplemented  # (a broadcast dim cut; cut by other mesh dims)
            for k in ks:
                if cuts.setdefault(k, (dd, lay.sizes_arg(k))) != (dd, lay.sizes_arg(k)):
                    return NotImplemented  # (cut differently along one dim)
            common[dd] = box[d]
    blocks = []
    for t, ps in zip(ins, pos):  # each input's block along every common cut dim
        block, mine = c.local(t), _cut_dims(t)
        if type(t) is c.ShardTensor and not mine and not t._layout.is_whole():
            return NotImplemented
        for dd, (lo, hi) in common.items():
            if dd not in ps or ps.index(dd) in mine or t.shape[ps.index(dd)] == 1:
                continue  # (absent, already its block, or broadcast along D)
            block = block.narrow(ps.index(dd), lo, hi - lo)
        blocks.append(block)
    y = func(*blocks, *args[3:])
    out_dims = [d for d in range(total) if d not in sumdim]
    places, sizes = [Replicate()] * mesh.ndim, [None] * mesh.ndim
    for k, (dd, entry) in cuts.items():
        if dd in sumdim:
            places[k] = Partial()
        else:
            places[k], sizes[k] = Shard(out_dims.index(dd)), entry
    shape = tuple(full[d] for d in out_dims)
    return c.wrap(y, mesh, ShardLayout.build(shape, tuple(mesh.shape), places, sizes))
