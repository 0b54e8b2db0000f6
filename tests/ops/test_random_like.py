"""``rand_like`` / ``randn_like`` / ``randint_like`` of a ShardTensor
(``shardlab/ops/random_like.py``): each rank draws its own block of one global tensor, no
message; the same tensor whatever the mesh, the placement and the (uneven, empty) sizes;
every rank's generator advanced alike; torch's own numbers under ``mask_scheme("torch")``;
the ranges and moments of the distributions."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import shardlab
    from shardlab import this_rank
    from shardlab.ops.dropout import mask_scheme
    from tests.tensor._cases import placements_1d, sizes_for

    shapes, rng = random.Random(seed), random.Random(seed + world)  # (shapes: any world's)
    meshes = [this_rank().mesh]
    if world == 4:
        meshes.append(this_rank().mesh_for((2, 2)))
    calls = {
        "rand": lambda t: torch.rand_like(t),
        "rand f32": lambda t: torch.rand_like(t, dtype=torch.float32),
        "randn": lambda t: torch.randn_like(t),
        "randint": lambda t: torch.randint_like(t, 7),
        "randint low": lambda t: torch.randint_like(t, -3, 4, dtype=torch.int64),
        "rand generator": lambda t: torch.rand_like(t, generator=torch.Generator().manual_seed(5)),
    }
    bad, events = [], []
    for case in range(6):
        mesh = meshes[case % len(meshes)]
        shape = tuple(shapes.randint(1, 6) for _ in range(shapes.randint(1, 3)))
        places = [rng.choice(placements_1d(len(shape))) for _ in range(mesh.ndim)]
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        g = torch.randn(shape, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, places, sizes)
        for name, fn in calls.items():
            with shardlab.gathers("raise"), shardlab.trace() as t:
                torch.manual_seed(case)
                got = fn(x)
                after = torch.rand(())
                with mask_scheme("torch"):
                    torch.manual_seed(case)
                    exact = fn(x)
            events.append(len(t.events))
            got, exact = got.full_tensor(), exact.full_tensor()
            torch.manual_seed(case)
            want = fn(g)
            if not torch.equal(exact, want):
                bad.append(("torch scheme", name, shape, places, sizes))
            bad += [] if got.dtype == want.dtype else [("dtype", name)]
            # the counter scheme: one global tensor whatever the layout, compared across runs
            bad.append(("values", name, got.tolist(), float(after)))
    return bad, events


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_draws_its_block_of_one_tensor_whatever_the_layout(ranks_for, world):
    runs = ranks_for(world).run(_body, 7, world)
    ones = ranks_for(1).run(_body, 7, 1)[0][0]  # the same shapes on one rank
    for found, events in runs:
        assert not [b for b in found if b[0] != "values"], found[:3]
        assert all(n == 0 for n in events), events
        values = [b for b in found if b[0] == "values"]
        assert values == [b for b in ones if b[0] == "values"]  # the numbers, the generator


def test_the_distributions(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        x = shardlab.distribute(torch.zeros(300, 100), mesh, [Shard(0)], [[100, 0, 200]])
        torch.manual_seed(0)
        u, z = torch.rand_like(x).full_tensor(), torch.randn_like(x).full_tensor()
        k = torch.randint_like(x, 2, 9).full_tensor()
        return (
            float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01,
            abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02,
            set(k.unique().tolist()) == set(range(2, 9)) and bool((k == k.round()).all()),
        )

    for out in ranks_for(3).run(body):
        assert all(out), out
