"""``F.embedding_bag`` over a table cut along its rows (``sum``, ``mean``: a Partial sum,
no message) or its columns (every mode, no message), with and without
``per_sample_weights``, ``include_last_offset``, empty bags: forward and the table's
gradient equal one device (float64), over random uneven and empty pieces, on 1, 3 and 4
ranks (``shardlab/engine/aten/embedding_bag.py``); no whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad = []
    for _ in range(8):
        v, d, n = rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 8)
        table = torch.randn(v, d, generator=g, dtype=torch.float64)
        idx = torch.randint(0, v, (n,), generator=g)
        off = torch.tensor(sorted([0] + [rng.randint(0, n) for _ in range(rng.randint(0, 3))]))
        dim = rng.choice([0, 1])
        mode = rng.choice(["sum", "mean"] + (["max"] if dim == 1 else []))
        psw = (
            torch.rand(n, generator=g, dtype=torch.float64)
            if mode == "sum" and rng.random() < 0.5
            else None
        )
        last = rng.random() < 0.3 and off[-1] <= n
        if last:
            off = torch.cat([off, torch.tensor([n])])
        x = shardlab.distribute(
            table, mesh, [Shard(dim)], [random_sizes(rng, table.shape[dim], world)]
        )
        x.requires_grad_()
        ref = table.clone().requires_grad_()
        kw = dict(mode=mode, per_sample_weights=psw, include_last_offset=bool(last))
        with shardlab.gathers("raise"):
            y = F.embedding_bag(idx, x, off, **kw)
        want = F.embedding_bag(idx, ref, off, **kw)
        w = torch.randn(want.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            (y * shardlab.distribute(w, mesh, [Replicate()])).sum().backward()
        (want * w).sum().backward()
        if not (torch.allclose(y.full_tensor(), want)
                and torch.allclose(x.grad.full_tensor(), ref.grad)):  # fmt: skip
            bad.append((v, d, dim, mode, psw is not None, bool(last), off.tolist()))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_embedding_bag_over_a_cut_table_equals_one_device(ranks_for, world):
    assert ranks_for(world).run(_body, 60 + world, world)[0] == []
