"""``hash_tensor`` over cut dims (``shardlab/engine/aten/hashing.py``): torch's hash bit
for bit, over random uneven (and empty) pieces, 1-D and 2-D meshes, every placement,
``dim`` and ``keepdim``; one all-gather of the result's block per cutting mesh dim,
never a whole-tensor gather."""

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
    bad, counts = [], []
    for case in range(10):
        mesh, shape, places, sizes = random_layout(rng, meshes, case)
        dtype = rng.choice([torch.float64, torch.float32, torch.int32])
        g = (torch.randn(shape, generator=torch.Generator().manual_seed(case)) * 100).to(dtype)
        dims = rng.choice([None, 0, -1, [0, len(shape) - 1] if len(shape) > 1 else [0]])
        keep = rng.choice([False, True])
        x = shardlab.distribute(g, mesh, places, sizes)
        kw = {} if dims is None else {"dim": dims, "keepdim": keep}
        with shardlab.gathers("raise"), shardlab.trace() as t:
            got = torch.hash_tensor(x, **kw)
        want = torch.hash_tensor(g, **kw)
        if not torch.equal(got.full_tensor(), want) or got.dtype != torch.uint64:
            bad.append((shape, places, sizes, dims, keep, dtype))
        reduced = range(len(shape)) if dims is None else [
            d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)]  # fmt: skip
        cut = [m for m, p in enumerate(places)
               if isinstance(p, Shard) and p.dim in reduced and mesh.shape[m] > 1]  # fmt: skip
        entries = want.numel()
        counts.append((len(cut), [(e.kind, e.bytes) for e in t.events], entries))
    return bad, counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_hash_tensor_is_torchs_bit_for_bit_with_one_all_gather_per_cutting_mesh_dim(
    ranks_for, world
):
    for bad, counts in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:3]
        for cut, events, _ in counts:
            assert [k for k, _ in events] == ["all_gather"] * cut, counts


def test_a_hash_over_a_cut_dim_sends_eight_bytes_an_entry(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(9, 5, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 0, 5]])
        with shardlab.trace() as t:
            y = torch.hash_tensor(x, 0)
            z = torch.hash_tensor(x)
        return (
            [(e.kind, e.bytes, e.label) for e in t.events],
            torch.equal(y.full_tensor(), torch.hash_tensor(g, 0)),
            torch.equal(z.full_tensor(), torch.hash_tensor(g)),
        )

    for events, *exact in ranks_for(3).run(body):
        assert all(exact), exact
        assert events == [("all_gather", 5 * 8, "hash_tensor.reduce"),
                          ("all_gather", 8, "hash_tensor.reduce")], events  # fmt: skip
