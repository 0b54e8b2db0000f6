"""``F.unfold`` and ``Tensor.unfold`` along sharded dims equal single-device torch, forward
and backward; the only messages are the halo rows (``unfold.halo``)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import distribute, this_rank
from tests.tensor._cases import random_sizes, sizes_for


def _f_unfold_body(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done = 0
        for _ in range(cases):
            shape = [rng.randint(1, 2), rng.randint(1, 3), rng.randint(3, 11), rng.randint(3, 9)]
            k = (rng.randint(1, 3), rng.randint(1, 3))
            kw = dict(
                kernel_size=k,
                dilation=(rng.randint(1, 2), 1),
                padding=(rng.randint(0, 1), rng.randint(0, 1)),
                stride=(rng.randint(1, 2), rng.randint(1, 2)),
            )
            g = torch.randn(shape, dtype=torch.float64)
            try:
                ref_x = g.clone().requires_grad_()
                ref = F.unfold(ref_x, **kw)
            except RuntimeError:
                continue  # torch itself refuses this configuration
            w = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w).sum().backward()
            dims = rng.sample([0, 1, 2, 3], len(mesh_shape))
            if len(mesh_shape) == 2 and rng.random() < 0.3:  # one dim cut by both mesh dims
                dims = [dims[0], dims[0]]
            sizes = sizes_for(rng, shape, mesh_shape, [Shard(d) for d in dims])
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, [Shard(d) for d in dims], sizes)
                with shardlab.trace() as t:
                    y = F.unfold(st, **kw)
            out = y.full_tensor()
            cfg = (shape, kw, dims, sizes)
            assert torch.allclose(out, ref, atol=1e-12), cfg
            (out * w).sum().backward()
            assert torch.allclose(x.grad, ref_x.grad, atol=1e-12), cfg
            allowed = {"unfold.halo forward"}
            if len(dims) == 2 and dims[0] == dims[1] and dims[0] >= 2:
                allowed.add("auto-redistribute for unfold")  # H or W cut twice: by one first
            assert {e.label for e in t.events} <= allowed, (cfg, t.counts())
            done += 1
        return done

    return body


@pytest.mark.parametrize("world", [2, 3, 4])
def test_f_unfold_1d_mesh(ranks_for, world):
    assert min(ranks_for(world).run(_f_unfold_body((world,), 25, seed=world))) >= 20


def test_f_unfold_2d_mesh(ranks_for):
    assert min(ranks_for(4).run(_f_unfold_body((2, 2), 20, seed=9))) >= 15


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tensor_unfold_along_a_cut_dim(ranks_for, world):
    """Windows longer than a shard, empty shards, steps that skip rows."""

    def body():
        mesh = this_rank().mesh
        rng = random.Random(world)
        done = 0
        for _ in range(30):
            n = rng.randint(1, 12)
            size, step = rng.randint(1, n), rng.randint(1, 3)
            g = torch.randn(2, n, 3, dtype=torch.float64)
            ref_x = g.clone().requires_grad_()
            ref = ref_x.unfold(1, size, step)
            w = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w).sum().backward()
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, [Shard(1)], random_sizes(rng, n, world))
            with shardlab.trace() as t:
                y = st.unfold(1, size, step)
            out = y.full_tensor()
            assert torch.allclose(out, ref), (n, size, step, st.sharding)
            (out * w).sum().backward()
            assert torch.allclose(x.grad, ref_x.grad), (n, size, step, st.sharding)
            assert {e.label for e in t.events} <= {"unfold.halo forward"}
            done += 1
        return done

    assert ranks_for(world).run(body) == [30] * world


def test_unfold_moves_exactly_the_halo(ranks_for):
    """(1, 1, 8, 4) rows cut [5, 3], k=3, padding 1: rank 0 needs row 5, rank 1 row 4;
    one row of 4 float64 each way (32 bytes), nothing else."""

    def body():
        g = torch.arange(32.0, dtype=torch.float64).view(1, 1, 8, 4)
        with shardlab.patched():
            st = distribute(g, this_rank().mesh, [Shard(2)], [5, 3])
            with shardlab.trace() as t:
                y = F.unfold(st, 3, padding=1)
        return (
            torch.equal(y.full_tensor(), F.unfold(g, 3, padding=1)),
            sorted((e.kind, e.bytes) for e in t.events),
            y.sharding.sizes_along(2),
        )

    for same, events, sizes in ranks_for(2).run(body):
        assert same and events == [("recv", 32), ("send", 32)] and sizes == (20, 12)
