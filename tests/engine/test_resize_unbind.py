"""``resize_as_`` / ``resize_`` to the shape a ShardTensor has (itself, no message;
``shardlab/engine/aten/inplace_views.py``) and ``unbind`` along a dim no mesh dim cuts
(each slice a view of the blocks, no message, forward or backward; ``views.py``), and along
a cut dim (each slice where it lies, no message forward), over
random uneven (and empty) pieces, 1-D and 2-D meshes."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, events = [], []
    for case in range(8):
        mesh, shape, places, sizes = random_layout(rng, meshes, case, ndims=(2, 3), most=5)
        g = torch.randn(shape, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, places, sizes)
        cut = {p.dim for p in places if isinstance(p, Shard)}
        free = [d for d in range(len(shape)) if d not in cut]
        with shardlab.gathers("raise"), shardlab.trace() as t:
            same = x.resize_as_(g) is x and x.resize_(shape) is x
            same = same and x.resize_as_(shardlab.distribute(g, mesh, places, sizes)) is x
        events.append(len(t.events))
        if not (same and torch.equal(x.full_tensor(), g)):
            bad.append(("resize", shape, places, sizes))
        if not free:
            continue
        d = rng.choice(free)
        xg = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        w = torch.randn(shape, dtype=torch.float64)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            parts = torch.unbind(xg, d)
            sum((p * w.select(d, i)).sum() for i, p in enumerate(parts)).backward()
        events.append(sum(e.kind != "all_reduce" for e in t.events))  # (the loss's sum)
        want = torch.unbind(ref, d)
        sum((p * w.select(d, i)).sum() for i, p in enumerate(want)).backward()
        if not all(torch.equal(a.full_tensor(), b) for a, b in zip(parts, want)):
            bad.append(("unbind", d, shape, places, sizes))
        if not torch.allclose(xg.grad.full_tensor(), ref.grad):
            bad.append(("unbind backward", d, shape, places, sizes))
    return bad, events


def _cut_body(seed, world):
    """``unbind`` along a cut dim: each slice where it lies (no message), 1-D tensors
    (Partial numbers) included; the backward exact, no whole-tensor gather."""
    import random

    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import meshes_for_world, random_layout

    rng = random.Random(seed)
    meshes = meshes_for_world(world)
    bad, events = [], []
    for case in range(10):
        mesh, shape, places, sizes = random_layout(rng, meshes, case, ndims=(1, 3), most=5)
        cut = [p.dim for p in places if isinstance(p, Shard)]
        if not cut:
            continue
        d = rng.choice(cut)
        g = torch.randn(shape, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        w = torch.randn(shape, dtype=torch.float64)
        with shardlab.gathers("raise"):
            with shardlab.trace() as t:
                parts = torch.unbind(x, d)
                copies = torch.unbind_copy(x.detach(), d)
            events.append(len(t.events))
            total = sum((p * shardlab.distribute(w.select(d, i), mesh, [Replicate()] * mesh.ndim))
                        .sum() for i, p in enumerate(parts))  # fmt: skip
            total.backward()
        want = torch.unbind(ref, d)
        sum((p * w.select(d, i)).sum() for i, p in enumerate(want)).backward()
        same = all(torch.equal(a.full_tensor(), b) for a, b in zip(parts, want))
        same = same and all(torch.equal(a.full_tensor(), b) for a, b in zip(copies, want))
        if not same:
            bad.append(("unbind", d, shape, places, sizes))
        if not torch.allclose(x.grad.full_tensor(), ref.grad):
            bad.append(("unbind backward", d, shape, places, sizes))
    return bad, events


@pytest.mark.parametrize("world", [3, 4])
def test_unbind_along_a_cut_dim_keeps_each_slice_where_it_lies(ranks_for, world):
    for bad, events in ranks_for(world).run(_cut_body, 10 + world, world):
        assert not bad, bad[:3]
        assert all(n == 0 for n in events), events


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resize_to_its_shape_and_unbind_along_a_whole_dim_send_nothing(ranks_for, world):
    for bad, events in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        assert all(n == 0 for n in events), events
