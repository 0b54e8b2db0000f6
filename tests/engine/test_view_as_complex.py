"""``view_as_complex`` of a tensor cut along its last dim (the pairs, size 2;
``shardlab/engine/aten/views.py``): the cut moves to another dim in one all-to-all, no
whole-tensor gather; equal to one device forward and backward over random uneven (and
empty) pieces, 1-D and 2-D meshes. A 1-D tensor (a 0-d result) is gathered, said."""

from __future__ import annotations

import pytest
import torch


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
    bad, moved = [], []
    for case in range(6):
        mesh = meshes[case % len(meshes)]
        shape = (*(rng.randint(1, 5) for _ in range(rng.randint(1, 2))), 2)
        places = [Shard(len(shape) - 1)] + [rng.choice([Replicate(), Shard(0)])] * (mesh.ndim - 1)
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        g = torch.randn(shape, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.view_as_complex(x)
        with shardlab.gathers("raise"):
            (y.abs() ** 2 + y.real).sum().backward()
        want = torch.view_as_complex(ref)
        (want.abs() ** 2 + want.real).sum().backward()
        if not torch.equal(y.full_tensor(), want):
            bad.append((shape, places, sizes, "forward"))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append((shape, places, sizes, "backward"))
        moved.append((sum(e.bytes for e in t.events if e.kind == "recv"), g.numel() * 8))
    return bad, moved


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_view_as_complex_of_cut_pairs_moves_the_cut_not_the_tensor(ranks_for, world):
    for bad, moved in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(got <= whole for got, whole in moved), moved


def test_a_1d_pair_is_gathered_and_said(ranks_for):
    def body():
        import warnings

        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(2, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[1, 0, 1]])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.view_as_complex(x)
        said = any(issubclass(m.category, shardlab.GatherWarning) for m in w)
        return torch.equal(y.full_tensor(), torch.view_as_complex(g)), said

    assert all(ok and said for ok, said in ranks_for(3).run(body))
