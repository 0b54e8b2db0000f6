"""``torch.quantile`` / ``torch.nanquantile`` of ShardTensors (``shardlab/ops/quantile.py``)
against torch on one device: dims, ``keepdim``, ``q`` a number or a tensor, every
``interpolation``, NaNs, uneven and empty shards, worlds 1-3 and a 2x2 mesh, forward and
backward; torch's errors on every rank. They raised "an op resized a ShardTensor in place"."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard


def _body(mesh_shape=None):
    def body():
        import shardlab
        from shardlab import distribute, this_rank

        mesh = shardlab.this_rank().mesh
        if mesh_shape is not None:
            mesh = this_rank().mesh_for(mesh_shape)
        n = mesh.shape[-1]
        g = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        g[2, 1] = float("nan")
        sizes = [0] * (n - 1) + [9] if n > 1 else [9]  # (empty shards)
        sizes = [6] + [0] * (n - 2) + [3] if n > 2 else sizes
        places = [Shard(0)] if mesh.ndim == 1 else [Shard(1), Shard(0)]
        cuts = [sizes] if mesh.ndim == 1 else [[3, 1], sizes]
        out = {}
        cases = itertools.product(
            (torch.quantile, torch.nanquantile, torch.Tensor.quantile),
            (0.3, torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)),
            (None, 0, 1),
            (False, True),
            ("linear", "lower", "higher", "midpoint", "nearest"),
        )
        for k, (fn, q, dim, keep, how) in enumerate(cases):
            x, xs = g.clone().requires_grad_(), g.clone().requires_grad_()
            st = distribute(xs, mesh, places, cuts)
            want = fn(x, q, dim=dim, keepdim=keep, interpolation=how)
            got = fn(st, q, dim=dim, keepdim=keep, interpolation=how)
            gen = torch.Generator().manual_seed(k)
            w = torch.randn(want.shape, dtype=torch.float64, generator=gen)
            (want * w).nan_to_num().sum().backward()
            (got * w).nan_to_num().sum().backward()
            same = torch.equal(got.full_tensor().nan_to_num(), want.nan_to_num())
            same = same and torch.equal(got.full_tensor().isnan(), want.isnan())
            same = same and got.placements == (Replicate(),) * mesh.ndim
            out[k] = same and torch.equal(xs.grad.nan_to_num(), x.grad.nan_to_num())
        with pytest.raises(RuntimeError, match="q must be in the range"):
            torch.quantile(distribute(g, mesh, places, cuts), 1.5)
        x = distribute(g, mesh, places, cuts).requires_grad_()  # (a leaf: nothing to gather)
        with shardlab.trace() as tr:  # the input gathered once (its full_tensor), no more
            torch.quantile(x, 0.3).backward()
        with shardlab.trace() as gather:
            x.full_tensor()
        me = mesh.get_rank()
        sent = (tr.counts(rank=me) == gather.counts(rank=me), tr.bytes(me) == gather.bytes(me))
        return all(out.values()), len(out), sent

    return body


@pytest.mark.parametrize(
    "world, mesh_shape",
    [(1, None), (2, None), pytest.param(3, None, marks=pytest.mark.more_worlds), (4, (2, 2))],
)
def test_quantile_equals_torch(ranks_for, world, mesh_shape):
    assert ranks_for(world).run(_body(mesh_shape)) == [(True, 180, (True, True))] * world
