"""``masked_select`` of a tensor cut along another dim than its rows or with a mask that
broadcasts, and ``masked_scatter`` / ``masked_scatter_`` with its backward
(``shardlab/engine/aten/selection.py``): equal to one device, forward and backward, over
random uneven (and empty) pieces, 1-D and 2-D meshes; one all-gather of one int64 per rank
(and an all-to-all each way for a cut moved to the rows), never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _body(seed, world):
    import random

    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from shardlab import this_rank
    from tests.tensor._cases import sizes_for

    rng = random.Random(seed)
    meshes = [this_rank().mesh]
    if world == 4:
        meshes.append(this_rank().mesh_for((2, 2)))
    bad, labels = [], set()
    for case in range(8):
        mesh = meshes[case % len(meshes)]
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(2, 3)))
        cut = rng.randrange(len(shape))
        places = [Shard(cut)] + [Replicate()] * (mesh.ndim - 1)
        if mesh.ndim == 2 and rng.random() < 0.5:
            places = places[::-1]
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        mask = torch.rand(rng.choice([shape, shape[1:], (shape[0],) + (1,) * (len(shape) - 1)]),
                          generator=gen) > 0.5  # fmt: skip
        src = torch.randn(g.numel() + 1, dtype=torch.float64, generator=gen)
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        s1, s2 = src.clone().requires_grad_(True), src.clone().requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.masked_select(x, mask)
            z = x.masked_scatter(mask, s1)
            w = torch.randn(z.shape, dtype=torch.float64, generator=gen)
            (y.sum() + (z * w).sum()).backward()
            inplace = shardlab.distribute(g, mesh, places, sizes)
            inplace.masked_scatter_(mask, src)
        labels |= {e.label for e in t.events}
        ry, rz = torch.masked_select(ref, mask), ref.masked_scatter(mask, s2)
        (ry.sum() + (rz * w).sum()).backward()
        checks = {
            "select": torch.equal(y.full_tensor(), ry),
            "scatter": torch.equal(z.full_tensor(), rz),
            "scatter_": torch.equal(inplace.full_tensor(), rz),
            "grad x": torch.allclose(x.grad.full_tensor(), ref.grad),
            "grad source": torch.allclose(_whole(s1.grad), s2.grad),
        }
        bad += [(k, shape, places, sizes, tuple(mask.shape)) for k, v in checks.items() if not v]
    return bad, labels


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_masked_select_and_scatter_equal_one_device(ranks_for, world):
    for bad, labels in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(not label.startswith("whole-tensor") for label in labels), labels


def test_a_row_cut_scatter_sends_one_count_per_rank(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(5, 4, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[1, 0, 4]])
        src = torch.randn(20, dtype=torch.float64)
        with shardlab.trace() as t:
            z = x.masked_scatter(g > 0, src)
        try:
            x.masked_scatter(g > -10, src[:3])
            said = None
        except RuntimeError as e:
            said = str(e)
        exact = torch.equal(z.full_tensor(), g.masked_scatter(g > 0, src))
        return exact, [(e.kind, e.bytes) for e in t.events], said

    for exact, events, said in ranks_for(3).run(body):
        assert exact and events == [("all_gather", 8)], events
        assert said == "Number of elements of source < number of ones in mask"
