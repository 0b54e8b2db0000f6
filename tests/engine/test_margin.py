"""``multilabel_margin_loss`` (``shardlab/engine/aten/margin.py``) cut along its classes or
its samples, 1-D and 2-D scores, each reduction, targets ended by -1: forward and backward
equal one device (float64), over random uneven and empty pieces, on 1, 3 and 4 ranks, never
a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _margins(seed, world):
    import random

    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad = []
    for _ in range(6):
        c_ = rng.randint(1, 6)
        shape = (rng.randint(1, 4), c_) if rng.random() < 0.7 else (c_,)
        a = torch.randn(shape, generator=g, dtype=torch.float64)
        t = torch.randint(-1, c_, shape, generator=g)
        red = rng.choice(["none", "mean", "sum"])
        d = rng.randrange(len(shape))
        x = shardlab.distribute(a, mesh, [Shard(d)], [random_sizes(rng, shape[d], world)])
        x.requires_grad_()
        ref = a.clone().requires_grad_()
        with shardlab.gathers("raise"):
            y = F.multilabel_margin_loss(x, t, reduction=red)
        want = F.multilabel_margin_loss(ref, t, reduction=red)
        w = torch.randn(want.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            (y * shardlab.distribute(w, mesh, [Replicate()])).sum().backward()
        (want * w).sum().backward()
        if not (torch.allclose(y.full_tensor(), want)
                and torch.allclose(x.grad.full_tensor(), ref.grad)):  # fmt: skip
            bad.append((shape, d, red, t.tolist()))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_multilabel_margin_loss_equals_one_device(ranks_for, world):
    assert ranks_for(world).run(_margins, 50 + world, world)[0] == []
