"""redistribute_plan simulated on real tensors: every destination block is rebuilt from the
source blocks using only the plan's boxes, and must equal direct slicing of the global tensor."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.layout import ShardLayout, moved_elements, redistribute_plan

from .test_shards import MESHES, random_placements, random_sizes


def random_pair(rng):
    """Two Shard/Replicate layouts of the same tensor on the same mesh."""
    mesh = rng.choice(MESHES)
    shape = tuple(rng.randint(0, 7) for _ in range(rng.randint(1, 3)))
    layouts = []
    for _ in range(2):
        places = random_placements(rng, mesh, len(shape), partial=False)
        layouts.append(
            ShardLayout.build(shape, mesh, places, random_sizes(rng, shape, mesh, places))
        )
    return layouts


def block(layout, coord, x):
    return x[tuple(slice(a, b) for a, b in layout.local_box(coord))]


def test_plan_rebuilds_every_destination_block_exactly_once():
    rng = random.Random(0)
    for _ in range(400):
        src, dst = random_pair(rng)
        x = torch.randn(src.global_shape, dtype=torch.float64)
        plan = redistribute_plan(src, dst)
        held = {c: block(src, c, x) for c in src.coords()}  # what each rank has before
        for d in dst.coords():
            out = torch.full(dst.local_shape(d), torch.nan, dtype=torch.float64)
            hits = torch.zeros(dst.local_shape(d), dtype=torch.long)
            for move in (m for m in plan if m.dst == d):
                assert move.numel > 0 and move.local == (move.src == d)
                out[move.dst_slices()] = held[move.src][move.src_slices()]
                hits[move.dst_slices()] += 1
            assert bool((hits == 1).all())
            assert torch.equal(out, block(dst, d, x))
        # traffic lower bound: a rank only receives what it does not already hold
        needed = 0
        for d in dst.coords():
            mine = torch.zeros(src.global_shape, dtype=torch.bool)
            mine[tuple(slice(a, b) for a, b in src.local_box(d))] = True
            needed += int((~block(dst, d, mine)).sum())
        assert moved_elements(plan) == needed


def test_resize_example_and_replica_choice():
    src = ShardLayout.build((6,), (2,), [Shard(0)], [4, 2])
    dst = src.with_sizes([2, 4])
    assert [(m.src, m.dst, m.box, m.local) for m in redistribute_plan(src, dst)] == [
        ((0,), (0,), ((0, 2),), True),
        ((0,), (1,), ((2, 4),), False),
        ((1,), (1,), ((4, 6),), True),
    ]
    # (Shard(0), Replicate) -> (Replicate, Shard(0)): rank (i, j) serves column j only
    src = ShardLayout.build((4,), (2, 2), [Shard(0), Replicate()])
    dst = src.with_placements([Replicate(), Shard(0)])
    for move in redistribute_plan(src, dst):
        assert move.src[1] == move.dst[1]


def test_redistribute_errors():
    a = ShardLayout.build((4,), (2,), [Shard(0)])
    with pytest.raises(NotImplementedError, match="Partial"):
        redistribute_plan(a.with_placements([Partial()]), a)
    with pytest.raises(ValueError, match="dst"):
        redistribute_plan(a, ShardLayout.build((5,), (2,), [Shard(0)]))
    with pytest.raises(ValueError, match="mesh"):
        redistribute_plan(a, ShardLayout.build((4,), (4,), [Shard(0)]))
    with pytest.raises(TypeError, match="src"):
        redistribute_plan("Shard(0)", a)
