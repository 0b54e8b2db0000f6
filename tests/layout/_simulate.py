"""A single-process simulation of a mesh: every rank's block of a global tensor, taken by
the index sets a layout says it holds. The layout rules are checked against it."""

from __future__ import annotations

import random

import torch
from torch.distributed.tensor import Partial, Replicate

from shardlab.layout import ShardLayout

from .test_shards import MESHES, random_placements, random_sizes


def block(layout: ShardLayout, coord, g: torch.Tensor) -> torch.Tensor:
    """Rank ``coord``'s block of the global tensor ``g`` (any layout, strided too)."""
    out = g
    for d in range(g.ndim):
        out = out.index_select(d, torch.as_tensor(layout.dim_indices(d, coord)))
    return out


def whole(layout: ShardLayout) -> ShardLayout:
    """The same layout with Partial mesh dims read as Replicate."""
    return layout.replace(
        placements=tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    )


def summed(layout: ShardLayout, locals_: dict) -> dict:
    """Blocks of a layout with Partial(sum) mesh dims: each coordinate's value is the sum
    of the parts along those mesh dims (what the all-reduce computes)."""
    partial = [m for m, p in enumerate(layout.placements) if isinstance(p, Partial)]
    out = {}
    for c in layout.coords():
        peers = [
            q
            for q in layout.coords()
            if all(q[m] == c[m] for m in range(len(c)) if m not in partial)
        ]
        out[c] = sum(locals_[q] for q in peers)
    return out


def random_block_layout(rng: random.Random, ndim_range=(1, 4), max_n=6, partial=False):
    mesh = rng.choice(MESHES)
    shape = tuple(rng.randint(1, max_n) for _ in range(rng.randint(*ndim_range)))
    places = random_placements(rng, mesh, len(shape), partial)
    return ShardLayout.build(shape, mesh, places, random_sizes(rng, shape, mesh, places))


def factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]
