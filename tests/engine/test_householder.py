"""Householder QR of a matrix cut along a matrix dim (``shardlab/engine/aten/householder.py``):
``geqrf``, ``householder_product`` (forward and backward) and ``ormqr`` (each side, each
``transpose``) equal one device (float64), LAPACK's reflectors, over random uneven and empty
pieces, rows or columns cut, batched matrices, on 1, 3 and 4 ranks; never a whole-tensor
gather; ``geqrf``'s messages as the docstring counts them (2 all-reduces per column)."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad, counts = [], []
    for _ in range(6):
        n = rng.randint(1, 5)
        m = rng.randint(n, n + 4)  # (householder_product wants M >= n)
        batch = rng.choice([(), (2,)])
        a = torch.randn(*batch, m, n, generator=g, dtype=torch.float64)
        d = rng.choice([a.ndim - 2, a.ndim - 1])
        sizes = random_sizes(rng, a.shape[d], world)
        case = (tuple(a.shape), d, sizes)
        x = shardlab.distribute(a, mesh, [Shard(d)], [sizes])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            va, tau = torch.geqrf(x)
        ra, rt = torch.geqrf(a)
        if not (torch.allclose(va.full_tensor(), ra) and torch.allclose(tau.full_tensor(), rt)):
            bad.append((*case, "geqrf"))
        if d == a.ndim - 2:
            counts.append(([e.kind for e in t.events if e.rank == dist.get_rank()], min(m, n), n))
        vs = shardlab.distribute(ra, mesh, [Shard(d)], [sizes]).requires_grad_()
        ts = shardlab.distribute(rt, mesh, [Replicate()])
        vr = ra.clone().requires_grad_()
        w = torch.randn(a.shape, generator=g, dtype=torch.float64)
        with shardlab.gathers("raise"):
            q = torch.linalg.householder_product(vs, ts)
            (q * shardlab.distribute(w, mesh, [Replicate()])).sum().backward()
        qq = torch.linalg.householder_product(vr, rt)
        (qq * w).sum().backward()
        if not (
            torch.allclose(q.full_tensor(), qq) and torch.allclose(vs.grad.full_tensor(), vr.grad)
        ):
            bad.append((*case, "householder_product"))
        for left in (True, False):
            shape = (*batch, m, 3) if left else (*batch, 3, m)
            cm = torch.randn(shape, generator=g, dtype=torch.float64)
            for tr in (True, False):
                with shardlab.gathers("raise"):
                    y = torch.ormqr(vs.detach(), ts, cm, left=left, transpose=tr)
                if not torch.allclose(
                    y.full_tensor(), torch.ormqr(ra, rt, cm, left=left, transpose=tr)
                ):
                    bad.append((*case, "ormqr", left, tr))
    return bad, counts


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_householder_family_equals_one_device(ranks_for, world):
    for bad, counts in ranks_for(world).run(_body, 11 + world, world):
        assert bad == []
        for kinds, k, n in counts:  # rows cut: per column the norm's all-reduce, and the
            # update's where columns are left to its right; none on one rank
            assert kinds == (["all_reduce"] * (k + min(k, n - 1)) if world > 1 else []), kinds
