"""``_trilinear`` with its inputs cut (``shardlab/engine/aten/trilinear.py``): ``F.bilinear``
and ``nn.Bilinear`` with any one of ``x1``, ``x2`` or ``W`` cut along any of its dims (a
summed dim: a Partial result; a kept one: the result cut alike), batched and unbatched,
forward and the gradient of every input equal one device (float64), over random uneven and
empty pieces, on 1, 3 and 4 ranks, never a whole-tensor gather and no message but the
bias's add to a Partial sum."""

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
    for _ in range(10):
        n, i, j, o = (rng.randint(1, 5) for _ in range(4))
        batched = rng.random() < 0.7
        args = [
            torch.randn(*((n,) if batched else ()), i, generator=g, dtype=torch.float64),
            torch.randn(*((n,) if batched else ()), j, generator=g, dtype=torch.float64),
            torch.randn(o, i, j, generator=g, dtype=torch.float64),
        ]
        bias = torch.randn(o, generator=g, dtype=torch.float64) if rng.random() < 0.5 else None
        which = rng.randrange(3)
        d = rng.randrange(args[which].ndim)
        sizes = random_sizes(rng, args[which].shape[d], world)
        refs = [t.clone().requires_grad_() for t in args]
        xs = [shardlab.distribute(t, mesh, [Shard(d)], [sizes]) if k == which else t.clone()
              for k, t in enumerate(args)]  # fmt: skip
        xs = [t.requires_grad_() for t in xs]
        with shardlab.gathers("raise"):
            y = F.bilinear(*xs, bias)
        yy = F.bilinear(*refs, bias)
        w = torch.randn(yy.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            (y * shardlab.distribute(w, mesh, [Replicate()])).sum().backward()
        (yy * w).sum().backward()
        case = (which, d, tuple(args[which].shape), sizes, batched)
        if not torch.allclose(y.full_tensor(), yy):
            bad.append((*case, "forward"))
        for k, (t, r) in enumerate(zip(xs, refs)):
            got = t.grad.full_tensor() if hasattr(t.grad, "full_tensor") else t.grad
            if not torch.allclose(got, r.grad):
                bad.append((*case, f"grad {k}"))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_bilinear_with_a_cut_input_equals_one_device(ranks_for, world):
    assert ranks_for(world).run(_body, 3 + world, world)[0] == []
