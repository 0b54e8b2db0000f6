"""``allclose`` and ``equal`` of tensors cut alike (``shardlab/engine/aten/agreement.py``):
torch's answer on every rank, over random uneven (and empty) pieces, 1-D and 2-D meshes,
``rtol`` / ``atol`` / ``equal_nan``; one all-reduce of one byte per cutting mesh dim,
never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, counts = [], []
    for case in range(12):
        mesh, shape, places, sizes = random_layout(rng, meshes, case)
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        h = g.clone()
        flat = h.view(-1)
        kind = case % 4  # equal / a small change / a large one / nan in both
        if kind == 1:
            flat[rng.randrange(flat.numel())] += 1e-9
        elif kind == 2:
            flat[rng.randrange(flat.numel())] += 1.0
        elif kind == 3:
            i = rng.randrange(flat.numel())
            g.view(-1)[i] = flat[i] = float("nan")
        x = shardlab.distribute(g, mesh, places, sizes)
        y = shardlab.distribute(h, mesh, places, sizes)
        calls = {
            "allclose": lambda a, b: torch.allclose(a, b),
            "allclose tight": lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-12),
            "allclose nan": lambda a, b: torch.allclose(a, b, equal_nan=True),
            "equal": torch.equal,
        }
        for name, fn in calls.items():
            with shardlab.gathers("raise"), shardlab.trace() as t:
                got = fn(x, y)
            if got is not fn(g, h):
                bad.append((name, shape, places, sizes, kind))
            cut = sum(isinstance(p, Shard) and mesh.shape[m] > 1 for m, p in enumerate(places))
            counts.append((cut, [(e.kind, e.bytes) for e in t.events]))
    return bad, counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allclose_and_equal_are_torchs_answer_with_one_byte_per_cutting_mesh_dim(ranks_for, world):
    for bad, counts in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(events == [("all_reduce", 1)] * cut for cut, events in counts), counts


def test_operands_cut_differently_broadcast_plain_or_of_other_shapes(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(9, 5, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 0, 5]])
        y = shardlab.distribute(g, mesh, [Shard(1)], [[2, 3, 0]])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            out = [
                torch.allclose(x, y),  # y moved to x's cut
                torch.allclose(x, g),  # a plain tensor: sliced
                torch.allclose(x, g[0]),  # broadcast: a row against every row
                torch.allclose(g, x),  # the plain one first
                torch.equal(x, g[:3]),  # other shapes: False, no message
                torch.equal(x, g),
            ]
        want = [True, True, torch.allclose(g, g[0]), True, False, True]
        aligned = {e.label for e in t.events if e.kind != "all_reduce"}
        return out == want, aligned, sum(e.kind == "all_reduce" for e in t.events)

    for ok, aligned, reduces in ranks_for(3).run(body):
        assert ok and aligned <= {"allclose.align"} and reduces == 5, (ok, aligned, reduces)
