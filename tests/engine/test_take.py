"""``take`` / ``put`` / ``put_`` with flat indices into a cut tensor
(``shardlab/engine/aten/take.py``): equal to one device, forward and ``take``'s backward,
over random placements in random uneven (and empty) pieces, 1-D and 2-D meshes, negative
and repeated indices, ``accumulate``; no message for a plain index, the index (as many
elements as the result) for a cut one; never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout, sizes_for

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, counts = [], []
    for case in range(8):
        mesh, shape, places, sizes = random_layout(rng, meshes, case, most=5)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        numel = g.numel()
        idx = torch.randint(-numel, numel, (rng.randint(1, 4), rng.randint(1, 4)), generator=gen)
        cut_index = rng.random() < 0.3
        index = idx
        if cut_index:
            from torch.distributed.tensor import Shard

            isz = sizes_for(rng, idx.shape, tuple(mesh.shape), [Shard(0)] * mesh.ndim)
            index = shardlab.distribute(idx, mesh, [Shard(0)] * mesh.ndim, isz)
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        w = torch.randn(idx.shape, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.take(x, index)
        counts.append((cut_index, len(t.events)))
        with shardlab.gathers("raise"):
            (y * w).sum().backward()
        want = torch.take(ref, idx)
        (want * w).sum().backward()
        if not torch.allclose(y.full_tensor(), want):
            bad.append(("take", shape, places, sizes))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append(("take backward", shape, places, sizes))
        src = torch.randn(idx.numel(), dtype=torch.float64, generator=gen)
        flat = idx.reshape(-1)
        once = flat.unique()  # (put_ without accumulate: one write per position)
        for acc in (False, True):
            use = flat if acc else once
            s = src[: len(use)]
            with shardlab.gathers("raise"):
                a = x.detach().put(use, s, accumulate=acc)
                b = x.detach().clone()
                b.put_(use, s, accumulate=acc)
            want = g.put(use, s, accumulate=acc)
            if not (
                torch.allclose(a.full_tensor(), want) and torch.allclose(b.full_tensor(), want)
            ):
                bad.append(("put", acc, shape, places, sizes))
    return bad, counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_take_and_put_equal_one_device_and_send_only_a_cut_index(ranks_for, world):
    for bad, counts in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(events == 0 for cut, events in counts if not cut or world == 1), counts


def test_take_of_a_row_cut_tensor_is_a_partial_sum_and_a_bad_index_raises_everywhere(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(3, 4, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(1)], [[2, 0, 2]])
        idx = torch.tensor([[11, 0, -1], [5, 5, 2]])
        with shardlab.trace() as t:
            y = torch.take(x, idx)
        try:
            torch.take(x, torch.tensor([12]))
            said = None
        except IndexError as e:
            said = str(e)
        exact = torch.equal(y.full_tensor(), torch.take(g, idx))
        return exact, repr(y.placements[0]), len(t.events), said

    for exact, placement, events, said in ranks_for(3).run(body):
        assert exact and placement == "Partial(sum)" and events == 0
        assert said == "out of range: tried to access index 12 on a tensor of 12 elements."
