"""Random uneven layouts shared by every rank (same seed -> same cases everywhere)."""

import contextlib
import random

import torch
from torch.distributed.tensor import Partial, Replicate, Shard


def random_sizes(rng: random.Random, length: int, parts: int) -> list[int]:
    """Random non-negative sizes summing to ``length`` (zeros and ones are common)."""
    cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, length])]


def block(g: torch.Tensor, layout, coord) -> torch.Tensor:
    return g[tuple(slice(a, b) for a, b in layout.local_box(coord))]


def placements_1d(ndim: int):
    return [Shard(d) for d in range(ndim)] + [Replicate(), Partial()]


def sizes_for(rng, shape, mesh_shape, placements):
    """Explicit random sizes for ShardLayout.build (nested dims get per-piece lists)."""
    out, seen = [], {}
    for m, p in enumerate(placements):
        if not isinstance(p, Shard):
            out.append(None)
            continue
        if p.dim in seen:  # inner split of pieces made by mesh dim seen[p.dim]
            outer = out[seen[p.dim]]
            out.append([random_sizes(rng, n, mesh_shape[m]) for n in outer])
        else:
            out.append(random_sizes(rng, shape[p.dim], mesh_shape[m]))
            seen[p.dim] = m
    return out


def meshes_for_world(world: int) -> list:
    """On the ranks: the 1-D mesh over them, and the 2x2 mesh too where there are 4."""
    from shardlab import this_rank

    me = this_rank()
    return [me.mesh] + ([me.mesh_for((2, 2))] if world == 4 else [])


def random_layout(rng, meshes, case: int, ndims=(1, 3), most: int = 6):
    """Case ``case``'s mesh (in turn from ``meshes``), a random shape of ``ndims`` dims of
    1..``most`` entries, placements (Shard, Replicate) per mesh dim and random sizes:
    ``(mesh, shape, placements, sizes)`` for ``shardlab.distribute``."""
    mesh = meshes[case % len(meshes)]
    shape = tuple(rng.randint(1, most) for _ in range(rng.randint(*ndims)))
    places = [rng.choice(placements_1d(len(shape))[:-1]) for _ in range(mesh.ndim)]
    return mesh, shape, places, sizes_for(rng, shape, tuple(mesh.shape), places)


def key_variants(g: torch.Tensor, mesh, distribute) -> dict:
    """``g`` (2, 6, 4) cut [4, 2] along dim 1, and one variant per part of a decision's
    key: other sizes, shape, dtype, placement, strides (``distribute``: shardlab's)."""
    return {
        "sizes": distribute(g, mesh, [Shard(1)], [[3, 3]]),
        "shape": distribute(g[:, :5], mesh, [Shard(1)], [[3, 2]]),
        "dtype": distribute(g.double(), mesh, [Shard(1)], [[4, 2]]),
        "placement": distribute(g, mesh, [Replicate()]),
        "strides": distribute(g.transpose(0, 2).contiguous(), mesh, [Shard(1)], [[4, 2]]).transpose(
            0, 2
        ),
    }


@contextlib.contextmanager
def samples_without_stack_walk():
    """torch's OpInfo sample generators, without their search for the calling test.

    Each ``op.sample_inputs(...)`` looks for the ``unittest.TestCase`` that called it by
    walking the stack (``inspect.stack()``: every frame's module looked up among
    ``sys.modules``). Under pytest, deep in a suite that has imported hundreds of modules,
    that walk took 35-80 s of the op database's 45-90 s sweeps. There is no TestCase here:
    the walk finds none either way, and the generators seed themselves the same (torch's
    ``SEED``), so the samples are the same.
    """
    from unittest import mock

    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    with contextlib.ExitStack() as stack:
        for module in (common_utils, core):
            if hasattr(module, "extract_test_fn"):  # (torch 2.11-2.15 all have it)
                stack.enter_context(mock.patch.object(module, "extract_test_fn", lambda: None))
        yield
