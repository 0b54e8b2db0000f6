"""View rules against a simulated mesh: for random layouts (uneven, empty pieces, 1-D and
2-D meshes, strided after earlier views) and random view chains, every rank's block of the
viewed tensor is its own block, viewed locally -- and a blocked view names mesh dims whose
move (the cheapest candidate) makes it work."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.layout import ShardLayout
from shardlab.layout.moves import cheapest, move_cost, unblock
from shardlab.layout.views import (
    Blocked,
    expand_layout,
    permute_layout,
    slice_layout,
    view_layout,
)

from ._simulate import block, factor_pairs, random_block_layout


def _random_view(rng, shape):
    """A random view of ``shape``: merge a run of dims, split one, add/drop size-1 dims."""
    shape = list(shape)
    kind = rng.choice(["merge", "split", "unsqueeze", "squeeze", "flatten", "regroup"])
    if kind == "merge" and len(shape) >= 2:
        i = rng.randrange(len(shape) - 1)
        j = rng.randrange(i + 1, len(shape))
        n = 1
        for v in shape[i : j + 1]:
            n *= v
        return shape[:i] + [n] + shape[j + 1 :]
    if kind == "split":
        i = rng.randrange(len(shape))
        a, b = rng.choice(factor_pairs(shape[i]))
        return shape[:i] + [a, b] + shape[i + 1 :]
    if kind == "unsqueeze":
        i = rng.randint(0, len(shape))
        return shape[:i] + [1] + shape[i:]
    if kind == "squeeze" and 1 in shape and len(shape) > 1:
        i = shape.index(1)
        return shape[:i] + shape[i + 1 :]
    if kind == "flatten":
        n = 1
        for v in shape:
            n *= v
        return [n]
    if kind == "regroup":  # (6, 2) -> (3, 4): only works where no cut is in the way
        n = 1
        for v in shape:
            n *= v
        a, b = rng.choice(factor_pairs(n))
        return [a, b]
    return shape


def _check_blocks(src, dst, g_src, g_dst, local_op):
    for c in src.coords():
        want = block(dst, c, g_dst)
        got = local_op(block(src, c, g_src), dst.local_shape(c))
        assert torch.equal(got, want), (src, dst, c)


def test_view_chains_match_a_simulated_mesh():
    rng = random.Random(0)
    blocked = moved = 0
    for _ in range(600):
        lay = random_block_layout(rng)
        g = torch.arange(torch.Size(lay.global_shape).numel(), dtype=torch.float64).view(
            lay.global_shape
        )
        for _ in range(rng.randint(1, 4)):
            shape = _random_view(rng, lay.global_shape)
            for _ in range(3):  # each move lifts one block
                try:
                    out = view_layout(lay, shape)
                    break
                except Blocked as b:
                    blocked += 1
                    assert b.mesh_dims, b
                    target = cheapest(lay, unblock(lay, b))
                    assert move_cost(lay, target) >= 0
                    for c in lay.coords():  # the move keeps the tensor: every block is g's
                        assert block(target, c, g).shape == target.local_shape(c)
                    lay = target
                    moved += 1
            else:
                out = view_layout(lay, shape)
            gv = g.view(shape)
            _check_blocks(lay, out, g, gv, lambda t, s: t.reshape(s))
            lay, g = out, gv
    assert blocked > 20 and moved == blocked


def test_merging_a_cut_dim_is_block_or_strided_and_moves_nothing():
    lay = ShardLayout.build((2, 7, 4), (3,), [Shard(1)], [4, 2, 1])
    merged = view_layout(lay, (2, 28))  # S*C: block, sizes x 4
    assert merged.is_block() and merged.sizes_along(1) == (16, 8, 4)
    strided = view_layout(lay, (14, 4))  # B*S: the batch stays outside the cut
    assert not strided.is_block(0) and strided.local_shape((1,)) == (4, 4)
    assert "strided" in str(strided) and view_layout(strided, (2, 7, 4)) == lay


def test_split_needs_multiples_of_the_inner_extent():
    lay = ShardLayout.build((12,), (2,), [Shard(0)], [5, 7])
    with pytest.raises(Blocked) as info:
        view_layout(lay, (3, 4))
    assert info.value.mesh_dims == (0,) and info.value.factor == 4
    fixed = cheapest(lay, unblock(lay, info.value))
    assert fixed.sizes_along(0) == (4, 8)  # rounded to multiples of 4: one row moves
    assert view_layout(fixed, (3, 4)).sizes_along(0) == (1, 2)


def test_a_size_one_dim_held_by_one_rank():
    pooled = ShardLayout.build((2, 3, 1), (4,), [Shard(2)], [0, 1, 0, 0])
    assert view_layout(pooled, (2, 3, 1)) == pooled
    with pytest.raises(Blocked):  # flatten(1): the row would have to spread
        view_layout(pooled, (2, 3))
    assert cheapest(pooled, unblock(pooled, Blocked((0,), 0, ""))).placements == (Replicate(),)


def test_permute_expand_and_slice_match_a_simulated_mesh():
    rng = random.Random(1)
    for _ in range(400):
        lay = random_block_layout(rng)
        g = torch.randn(lay.global_shape)
        if rng.random() < 0.5 and lay.global_shape[0] % 2 == 0 and len(lay.global_shape) > 1:
            shape = [lay.global_shape[0] * lay.global_shape[1], *lay.global_shape[2:]]
            try:  # strided inputs too
                lay, g = view_layout(lay, shape), g.reshape(shape)
            except Blocked:
                pass
        perm = list(range(g.ndim))
        rng.shuffle(perm)
        _check_blocks(
            lay, permute_layout(lay, perm), g, g.permute(perm), lambda t, s, p=perm: t.permute(p)
        )
        shape = [rng.randint(1, 3)] + list(g.shape)
        try:
            ex = expand_layout(lay, shape)
            _check_blocks(lay, ex, g, g.expand(shape), lambda t, s: t.expand(s))
        except Blocked:
            pass
        d = rng.randrange(g.ndim)
        if lay.is_block(d):
            n = g.shape[d]
            start, stop, step = rng.randint(0, n), rng.randint(0, n), rng.randint(1, 3)
            stop = max(stop, start)
            out = slice_layout(lay, d, start, stop, step)
            picked = g[(slice(None),) * d + (slice(start, stop, step),)]
            for c in lay.coords():
                have = lay.dim_indices(d, c).tolist()
                keep = [k for k, i in enumerate(have) if i in range(start, stop, step)]
                local = block(lay, c, g).index_select(d, torch.as_tensor(keep, dtype=torch.long))
                assert torch.equal(local, block(out, c, picked)), (lay, d, start, stop, step)
