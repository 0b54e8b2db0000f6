"""``cdist`` with ``x1`` cut (``shardlab/engine/aten/distances.py``): rows or batch dims (no
message), or features (p 0, 1, inf: a Partial result, no message; other p: one all-reduce
of the result), forward and backward equal one device (float64), over random uneven and
empty pieces, on 1, 3 and 4 ranks, never a whole-tensor gather. (The op database's sweep
skips ``cdist``: its results there are taken as random.)"""

from __future__ import annotations

import math

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
    for _ in range(10):
        batch = rng.choice([(), (2,)])
        pp, rr, mm = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 4)
        a = torch.randn(*batch, pp, mm, generator=g, dtype=torch.float64)
        b = torch.randn(*rng.choice([batch, ()]), rr, mm, generator=g, dtype=torch.float64)
        p = rng.choice([0.0, 1.0, 2.0, 3.0, math.inf])
        d = rng.randrange(a.ndim)
        sizes = random_sizes(rng, a.shape[d], world)
        x = shardlab.distribute(a, mesh, [Shard(d)], [sizes]).requires_grad_()
        ref = a.clone().requires_grad_()
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.cdist(x, b, p)
        yy = torch.cdist(ref, b, p)
        w = torch.randn(yy.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            (y * shardlab.distribute(w, mesh, [Replicate()])).sum().backward()
        (yy * w).sum().backward()
        sent = [e.kind for e in t.events if e.rank == 0]
        want = (
            ["all_reduce"]
            if d == a.ndim - 1 and p not in (0.0, 1.0, math.inf) and world > 1
            else []
        )
        if not torch.allclose(y.full_tensor(), yy) or sent != want:
            bad.append((tuple(a.shape), tuple(b.shape), d, p, sizes, "forward", sent))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append((tuple(a.shape), tuple(b.shape), d, p, sizes, "backward"))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_cdist_equals_one_device(ranks_for, world):
    assert ranks_for(world).run(_body, 5 + world, world)[0] == []
