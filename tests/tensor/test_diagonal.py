"""``torch.diagonal`` of ShardTensors against one device: with the two diagonal dims whole,
each rank takes its own matrices' diagonals (no message, forward or backward); with one
of them cut, each rank the diagonal entries in its block (no message either)."""

import pytest
import torch
from torch.distributed.tensor import Shard

from shardlab import distribute, this_rank, trace

f64 = torch.float64

CALLS = [  # (offset, dim1, dim2)
    (0, -2, -1),
    (1, -2, -1),
    (-2, -1, -2),
    (0, 2, 3),
    (3, 3, 2),
    (-1, 1, 3),
]


def _body(mesh_shape, placements, sizes):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        g = torch.randn(5, 4, 3, 4, dtype=f64, generator=torch.Generator().manual_seed(0))
        out = []
        for offset, d1, d2 in CALLS:
            xr = g.clone().requires_grad_()
            ref = torch.diagonal(xr, offset, d1, d2)
            w = torch.randn(ref.shape, dtype=f64, generator=torch.Generator().manual_seed(1))
            (ref * w).sum().backward()
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, placements, sizes) * 1  # (a non-leaf: the backward runs)
            with trace() as t:
                y = torch.diagonal(st, offset, d1, d2)
            full = y.full_tensor()
            (full * w).sum().backward()
            ok = torch.equal(full, ref.detach()) and torch.allclose(x.grad, xr.grad)
            out.append((bool(ok), len(t.events) == 0))  # cut diagonal dims too: no message
        return out

    return body


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "sizes"),
    [
        ((3,), [Shard(0)], [[3, 0, 2]]),
        ((2,), [Shard(1)], [[1, 3]]),
        ((2, 2), [Shard(0), Shard(2)], [[2, 3], [1, 2]]),
    ],
)
def test_diagonal_equals_torch(ranks_for, mesh_shape, placements, sizes):
    world = 1
    for n in mesh_shape:
        world *= n
    for rank in ranks_for(world).run(_body(mesh_shape, placements, sizes)):
        for i, (ok, quiet) in enumerate(rank):
            assert ok and quiet, (CALLS[i], ok, quiet)


def test_batch_cut_diagonal_backward_sends_nothing(ranks_for):
    """The trace of each matrix of a batch cut along the batch: forward and backward on
    the ranks' own matrices; the only message is the final sum of the loss."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(6, 3, 3, dtype=f64, generator=torch.Generator().manual_seed(0))
        xr = g.clone().requires_grad_()
        torch.diagonal(xr, 0, -2, -1).sum(-1).pow(2).sum().backward()
        x = distribute(g, mesh, [Shard(0)], [[4, 0, 2]]).requires_grad_()
        with trace() as t:
            y = torch.diagonal(x, 0, -2, -1).sum(-1).pow(2)
            y.backward(torch.ones_like(y))
        grad = x.grad.full_tensor()
        return torch.allclose(grad, xr.grad), len(t.events)

    for ok, events in ranks_for(3).run(body):
        assert ok and events == 0
