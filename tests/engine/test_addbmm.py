"""``addbmm`` on the blocks (``shardlab/engine/aten/addbmm.py``): equal to one device,
forward and backward, over random placements of the three operands in random uneven
(and empty) pieces, 1-D and 2-D meshes, ``beta`` / ``alpha``; no message when the
operands are cut to fit (batch, contracted, row or column dim), never a whole-tensor
gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import shardlab
    from shardlab import this_rank
    from tests.tensor._cases import placements_1d, sizes_for

    rng = random.Random(seed)
    meshes = [this_rank().mesh]
    if world == 4:
        meshes.append(this_rank().mesh_for((2, 2)))
    bad = []
    for case in range(8):
        mesh = meshes[case % len(meshes)]
        b, n, m, p = (rng.randint(1, 5) for _ in range(4))
        shapes = [rng.choice([(n, p), (p,), (1, p), (n, 1)]), (b, n, m), (b, m, p)]
        gen = torch.Generator().manual_seed(case)
        globals_ = [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]
        ops, refs = [], []
        for g in globals_:
            places = [rng.choice(placements_1d(g.ndim)) for _ in range(mesh.ndim)]
            sizes = sizes_for(rng, g.shape, tuple(mesh.shape), places)
            x = g if rng.random() < 0.2 else shardlab.distribute(g, mesh, places, sizes)
            ops.append(x.requires_grad_(True) if x is not g else g.clone().requires_grad_(True))
            refs.append(g.clone().requires_grad_(True))
        beta, alpha = rng.choice([1.0, 0.5, 0.0]), rng.choice([1.0, -2.0])
        w = torch.randn(n, p, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"):
            y = torch.addbmm(*ops, beta=beta, alpha=alpha)
            (y * w).sum().backward()
        want = torch.addbmm(*refs, beta=beta, alpha=alpha)
        (want * w).sum().backward()
        if not torch.allclose(y.full_tensor(), want, atol=1e-10):
            bad.append((shapes, [getattr(o, "placements", "plain") for o in ops], "forward"))
        for o, r in zip(ops, refs):
            got = o.grad.full_tensor() if hasattr(o.grad, "full_tensor") else o.grad
            if not torch.allclose(got, r.grad, atol=1e-10):
                bad.append((shapes, [getattr(o, "placements", "plain") for o in ops], "grad"))
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_addbmm_equals_one_device_forward_and_backward(ranks_for, world):
    for bad in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]


def test_operands_cut_to_fit_send_nothing_and_the_input_is_added_once(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        gen = torch.Generator().manual_seed(0)
        g = [torch.randn(s, dtype=torch.float64, generator=gen) for s in ((5, 10), (4, 5, 6),
                                                                         (4, 6, 10))]  # fmt: skip
        d = shardlab.distribute
        cases = {  # (input, batch1, batch2) -> the result's placement
            "input rows, batches plain": ((d(g[0], mesh, [Shard(0)], [[1, 3, 1]]), g[1], g[2]),
                                          "Shard(dim=0)"),  # fmt: skip
            "input cols, batch2 cols": ((d(g[0], mesh, [Shard(1)], [[0, 3, 7]]), g[1],
                                         d(g[2], mesh, [Shard(2)], [[0, 3, 7]])), "Shard(dim=1)"),
            "batch dim": ((g[0], d(g[1], mesh, [Shard(0)], [[2, 0, 2]]),
                           d(g[2], mesh, [Shard(0)], [[2, 0, 2]])), "Partial(sum)"),
            "contracted dim": ((g[0], d(g[1], mesh, [Shard(2)], [[3, 3, 0]]),
                                d(g[2], mesh, [Shard(1)], [[3, 3, 0]])), "Partial(sum)"),
        }  # fmt: skip
        out = {}
        for name, (args, placement) in cases.items():
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = torch.addbmm(*args, beta=0.5, alpha=2.0)
            exact = torch.allclose(y.full_tensor(), torch.addbmm(*g, beta=0.5, alpha=2.0))
            out[name] = (exact, repr(y.placements[0]) == placement, len(t.events))
        return out

    for out in ranks_for(3).run(body):
        assert all(v == (True, True, 0) for v in out.values()), out
