"""Broadcasting, reduction and matmul layouts against a simulated mesh (no processes)."""

from __future__ import annotations

import random

import torch
from torch.distributed.tensor import Partial, Shard

from shardlab.layout import ShardLayout
from shardlab.layout.elementwise import reduce_layout, restrict, target_from
from shardlab.layout.matmul import mm_strategies
from shardlab.layout.views import Blocked, view_layout

from ._simulate import block, random_block_layout, summed, whole


def _maybe_strided(rng, lay):
    """Half the time, the layout of (d0 * d1, ...) viewed from a merged first pair."""
    if rng.random() < 0.5 and len(lay.global_shape) >= 2:
        shape = (lay.global_shape[0] * lay.global_shape[1], *lay.global_shape[2:])
        try:
            return view_layout(lay, shape)
        except Blocked:
            pass
    return lay


def test_broadcast_targets_give_each_rank_its_output_block():
    rng = random.Random(0)
    for _ in range(500):
        lay = _maybe_strided(rng, random_block_layout(rng))
        out_shape = list(lay.global_shape)
        in_shape = list(out_shape)
        for d in range(len(in_shape)):  # some dims broadcast, maybe a leading one dropped
            if rng.random() < 0.3:
                in_shape[d] = 1
        if rng.random() < 0.3 and len(in_shape) > 1:
            in_shape = in_shape[1:]
        target = target_from(lay, out_shape, [False] * len(lay.mesh_shape))
        needs = restrict(target, in_shape, [False] * len(lay.mesh_shape))
        x, y = torch.randn(in_shape), torch.randn(out_shape)
        ref = x + y
        for c in target.coords():
            got = block(needs, c, x) + block(target, c, y)
            assert torch.equal(got, block(target, c, ref)), (lay, in_shape, c)


def test_reductions_partial_over_cut_dims():
    rng = random.Random(1)
    for _ in range(400):
        lay = _maybe_strided(rng, random_block_layout(rng))
        g = torch.randn(lay.global_shape)
        dims = sorted(rng.sample(range(g.ndim), rng.randint(1, g.ndim)))
        keep = rng.random() < 0.5
        out = reduce_layout(lay, dims, keep, "sum")
        parts = {c: block(lay, c, g).sum(dims, keepdim=keep) for c in lay.coords()}
        total = summed(out, parts)
        ref = g.sum(dims, keepdim=keep)
        for c in out.coords():
            assert torch.allclose(total[c], block(whole(out), c, ref)), (lay, dims, keep)
        cut = {p.dim for p in lay.placements if isinstance(p, Shard)}
        assert any(isinstance(p, Partial) for p in out.placements) == bool(cut & set(dims))


def test_every_mm_strategy_computes_the_product():
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        batched = rng.random() < 0.4
        mesh = rng.choice([(2,), (3,), (2, 2), (1, 3)])
        b_, m_, k_, n_ = (rng.randint(1, 4) for _ in range(4))
        sa = ((b_,) if batched else ()) + (m_, k_)
        sb = ((b_,) if batched else ()) + (k_, n_)
        la = _random_cut(rng, sa, mesh)
        lb = _random_cut(rng, sb, mesh)
        a, b = torch.randn(sa), torch.randn(sb)
        ref = a @ b
        for ta, tb, to in mm_strategies(la, lb, batched):
            parts = {c: block(ta, c, a) @ block(tb, c, b) for c in to.coords()}
            total = summed(to, parts)
            for c in to.coords():
                assert torch.allclose(total[c], block(whole(to), c, ref)), (ta, tb, to)
            checked += 1
    assert checked > 500


def _random_cut(rng, shape, mesh):
    places, sizes = [], []
    used = set()
    for n in mesh:
        d = rng.randrange(len(shape) + 1)
        if d < len(shape) and d not in used:
            used.add(d)
            places.append(Shard(d))
            cuts = sorted(rng.randint(0, shape[d]) for _ in range(n - 1))
            sizes.append([b - a for a, b in zip([0, *cuts], [*cuts, shape[d]])])
        else:
            from torch.distributed.tensor import Replicate

            places.append(Replicate())
            sizes.append(None)
    return ShardLayout.build(shape, mesh, places, sizes)
