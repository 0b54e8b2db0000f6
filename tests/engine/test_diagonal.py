"""``diagonal`` and its family on a matrix cut along its rows or columns
(``shardlab/engine/aten/diagonal.py``): each rank takes the diagonal entries in its own
block, the diagonal cut in the pieces the layout and offset give; no message forward
or backward, ``trace`` a Partial sum (one all-reduce when made whole); values and
gradients equal one device; never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch

FNS = {
    "diagonal": lambda t, k: torch.diagonal(t, k, -2, -1),
    "diagonal dims swapped": lambda t, k: torch.diagonal(t, k, -1, -2),
    "diagonal_copy": lambda t, k: torch.diagonal_copy(t, k, -2, -1),
    "linalg.diagonal": lambda t, k: torch.linalg.diagonal(t, offset=k),
    "trace": lambda t, k: torch.trace(t),
    "diagonal_scatter": lambda t, k: torch.diagonal_scatter(
        t * 2, torch.diagonal(t, k, -2, -1).exp(), k, -2, -1
    ),
    "write through the view": lambda t, k: _written(t, k),
}


def _written(t, k):
    y = t * 1
    torch.diagonal(y, k, -2, -1).mul_(3)
    return y


def _body(world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import sizes_for

    rng = random.Random(world)
    meshes = [shardlab.this_rank().mesh]
    if world == 4:
        meshes.append(shardlab.this_rank().mesh_for((2, 2)))
    bad, labels = [], set()
    for case in range(10):
        mesh = meshes[case % len(meshes)]
        shape = (rng.randint(1, 3), rng.randint(1, 7), rng.randint(1, 7))
        if case % 3 == 0:
            shape = shape[1:]  # a matrix
        n = len(shape)
        places = [Shard(rng.randrange(n)) for _ in range(mesh.ndim)]
        if case % 2:
            places[0] = Shard(n - 2 + case % 4 // 2)  # a diagonal dim cut
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        k = rng.randint(-3, 3)
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        for name, fn in FNS.items():
            if name == "trace" and n == 3:
                continue  # (a matrix's)
            x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            want = fn(ref, k)
            w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator())
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x, k)
                (y * w).sum().backward()
            (want * w).sum().backward()
            labels |= {e.label for e in t.events}
            if not (
                torch.allclose(y.full_tensor(), want, atol=1e-12)
                and torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-12)
            ):
                bad.append((name, shape, places, sizes, k))
    return bad, labels


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_diagonals_of_cut_matrices_stay_on_their_ranks(ranks_for, world):
    """Rows, columns or batch dims cut (uneven, empty pieces; a 2-D mesh at 4 ranks,
    rows and columns both cut): forward and backward equal one device, no gather, and
    nothing sent but the sums' all-reduces of the loss (``y * w`` with ``w`` whole is a
    slice of ``w``)."""
    for bad, labels in ranks_for(world).run(_body, world):
        assert not bad, bad[:3]
        assert labels <= {"sum.partial", "redistribute"}, labels


def test_a_row_cut_diagonal_sends_nothing_and_trace_is_one_all_reduce(ranks_for):
    def body():
        from torch.distributed.tensor import Partial, Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(5, 6, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[2, 0, 3]]).requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as forward:
            d = torch.diagonal(x, 1)
            s = torch.trace(x)
        with shardlab.trace() as whole:
            total = s.full_tensor()
        with shardlab.gathers("raise"), shardlab.trace() as backward:
            ((d * d).sum() + s).backward()  # (d's gradient cut like d)
        return (
            len(forward.events), [(e.kind, e.bytes) for e in whole.events],
            d.placements[0], d._layout.sizes_along(0), isinstance(s.placements[0], Partial),
            x.grad._layout == x._layout, len(backward.events),
            torch.allclose(total, torch.trace(g)),
            torch.equal(d.full_tensor(), torch.diagonal(g, 1)),
        )  # fmt: skip

    for sent, whole, place, sizes, partial, same, back, exact, exact_d in ranks_for(3).run(body):
        assert sent == 0 and back == 0
        assert [kind for kind, _ in whole] == ["all_reduce"] and whole[0][1] == 8
        assert (place.dim, sizes, partial, same) == (0, (2, 0, 3), True, True)
        assert exact and exact_d
