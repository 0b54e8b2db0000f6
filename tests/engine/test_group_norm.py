"""``native_group_norm`` called at aten's level on a batch cut
(``shardlab/engine/aten/group_norm.py``): each rank its samples, no message, forward and
backward (input, weight, bias) equal one device (float64), over random uneven and empty
pieces, on 1, 3 and 4 ranks."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad = []
    for _ in range(4):
        group = rng.choice([1, 2, 3])
        ch = group * rng.randint(1, 2)
        spatial = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
        n = rng.randint(1, 5)
        a = torch.randn(n, ch, *spatial, generator=g, dtype=torch.float64)
        hw = 1
        for s in spatial:
            hw *= s
        w = torch.randn(ch, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(ch, generator=g, dtype=torch.float64, requires_grad=True)
        sizes = random_sizes(rng, n, world)
        x = shardlab.distribute(a, mesh, [Shard(0)], [sizes]).requires_grad_()
        ref = a.clone().requires_grad_()
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.native_group_norm(x, w, b, n, ch, hw, group, 1e-5)
        yy = torch.native_group_norm(ref, w, b, n, ch, hw, group, 1e-5)
        wt = torch.randn(a.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            (y[0] * shardlab.distribute(wt, mesh, [Replicate()])).sum().backward()
        gw, gb = w.grad.clone(), b.grad.clone()
        w.grad = b.grad = None
        (yy[0] * wt).sum().backward()
        ok = all(torch.allclose(p.full_tensor(), q) for p, q in zip(y, yy)) and not t.events
        ok = ok and torch.allclose(x.grad.full_tensor(), ref.grad)
        ok = ok and torch.allclose(gw, w.grad) and torch.allclose(gb, b.grad)
        if not ok:
            bad.append((tuple(a.shape), group, sizes))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_group_norm_on_a_batch_cut_equals_one_device(ranks_for, world):
    assert ranks_for(world).run(_body, 2 + world, world)[0] == []
