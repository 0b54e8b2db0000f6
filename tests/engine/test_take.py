"""``take`` / ``put`` / ``put_`` with flat indices into a cut tensor
(``shardlab/engine/aten/take.py``): equal to one device, forward and ``take``'s backward,
over random placements in random uneven (and empty) pieces, 1-D and 2-D meshes, negative
and repeated indices, ``accumulate``; no message for a plain index, the index (as many
elements as the result) for a cut one; never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout, sizes_for

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, counts = [], []
    for case in range(8):
        mesh, shape, places, sizes = random_layout(rng, meshes, case, most=5)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        numel = g.numel()
        idx = torch.randint(-numel, numel, (rng.randint(1, 4), rng.randint(1, 4)), generator=gen)
        cut_index = rng.random() < 0.3
        index = idx
        if cut_index:
            from torch.distributed.tensor import Shard

            isz = sizes_for(rng, idx.shape, tuple(mesh.shape), [Shard(0)] * mesh.ndim)
            index = shardlab.distribute(idx, mesh, [Shard(0)] * mesh.ndim, isz)
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        w = torch.randn(idx.shape, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.take(x, index)
        counts.append((cut_index, len(t.events)))
        with shardlab.gathers("raise"):
            (y * w).sum().backward()
        want = torch.take(ref, idx)
        (want * w).sum().backward()
        if not torch.allclose(y.full_tensor(), want):
            bad.append(("take", shape, places, sizes))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append(("take backward", shape, places, sizes))
        src = torch.randn(idx.numel(), dtype=torch.float64, generator=gen)
        flat = idx.reshape(-1)
        once = flat.unique()  # (put_ without accumulate: one write per position)
        for acc in (False, True):
            use = flat if acc else once
            s = src[: len(use)]
            with shardlab.gathers("raise"):
                a = x.detach().put(use, s, accumulate=acc)
                b = x.detach().clone()
                b.put_(use, s, accumulate=acc)
            want = g.put(use, s, accumulate=acc)
            if not (
                torch.allclose(a.full_tensor(), want) and torch.allclose(b.full_tensor(), want)
            ):
                bad.append(("put", acc, shape, places, sizes))
    return bad, counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_take_and_put_equal_one_device_and_send_only_a_cut_index(ranks_for, world):
    for bad, counts in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(events == 0 for cut, events in counts if not cut or world == 1), counts


def test_take_of_a_row_cut_tensor_is_a_partial_sum_and_a_bad_index_raises_everywhere(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(3, 4, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(1)], [[2, 0, 2]])
        idx = torch.tensor([[11, 0, -1], [5, 5, 2]])
        with shardlab.trace() as t:
            y = torch.take(x, idx)
        try:
            torch.take(x, torch.tensor([12]))
            said = None
        except IndexError as e:
            said = str(e)
        exact = torch.equal(y.full_tensor(), torch.take(g, idx))
        return exact, repr(y.placements[0]), len(t.events), said

    for exact, placement, events, said in ranks_for(3).run(body):
        assert exact and placement == "Partial(sum)" and events == 0
        assert said == "out of range: tried to access index 12 on a tensor of 12 elements."


def _strided_body(seed, world):
    """``as_strided`` / ``as_strided_copy`` / ``as_strided_scatter`` / ``unfold_copy`` of a
    cut tensor (contiguous, or a transpose of one: its storage read through its global
    strides), overlapping windows too: as ``take`` / ``put`` of the storage positions, no
    message forward; the backward exact; a write into the view reaches the base."""
    import random

    from torch.distributed.tensor import Replicate

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, counts = [], []
    for case in range(8):
        mesh, shape, places, sizes = random_layout(rng, meshes, case, ndims=(2, 3), most=5)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        transpose = rng.random() < 0.3
        numel = g.numel()
        size = (rng.randint(1, 3), rng.randint(1, 3))
        stride = (rng.randint(0, 3), rng.randint(0, 2))
        room = numel - 1 - (size[0] - 1) * stride[0] - (size[1] - 1) * stride[1]
        if room < 0:
            continue
        offset = rng.randint(0, room)

        def view(t, tr=transpose, how=(size, stride, offset)):
            return (t.mT if tr else t).as_strided(*how)

        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        w = torch.randn(size, dtype=torch.float64, generator=gen)
        src = torch.randn(size, dtype=torch.float64, generator=gen)
        at = offset + torch.arange(size[0])[:, None] * stride[0] + torch.arange(size[1]) * stride[1]
        once = at.unique().numel() == at.numel()  # (torch writes no position twice)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = view(x)
            c = torch.as_strided_copy(x.detach(), size, stride, offset)
            s = torch.as_strided_scatter(x.detach(), src, size, stride, offset) if once else None
        counts.append(len(t.events))
        with shardlab.gathers("raise"):
            (y * shardlab.distribute(w, mesh, [Replicate()] * mesh.ndim)).sum().backward()
        want = view(ref)
        (want * w).sum().backward()
        ok = torch.allclose(y.full_tensor(), want)
        ok = ok and torch.equal(c.full_tensor(), torch.as_strided_copy(g, size, stride, offset))
        if once:
            want_s = torch.as_strided_scatter(g, src, size, stride, offset)
            ok = ok and torch.equal(s.full_tensor(), want_s)
        if not ok:
            bad.append(("as_strided", shape, places, sizes, size, stride, offset, transpose))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append(("as_strided backward", shape, places, sizes, size, stride, offset))
        if not once:
            continue  # (a write needs each position once)
        z, zz = shardlab.distribute(g, mesh, places, sizes), g.clone()
        with shardlab.gathers("raise"):
            view(z).mul_(2)
        view(zz).mul_(2)
        if not torch.equal(z.full_tensor(), zz):
            bad.append(("as_strided write", shape, places, sizes, size, stride, offset))
    return bad, counts


@pytest.mark.parametrize("world", [3, 4])
def test_as_strided_reads_storage_positions_where_they_lie(ranks_for, world):
    for bad, counts in ranks_for(world).run(_strided_body, 20 + world, world):
        assert not bad, bad[:3]
        assert all(n == 0 for n in counts), counts
