"""Variance and standard deviation over cut dims (``shardlab/engine/aten/moments.py``):
equal to one device, forward and backward, over random uneven (and empty) pieces, 1-D and
2-D meshes, every placement, ``correction`` and ``keepdim``; one all-gather per cut mesh
dim and never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import this_rank
    from tests.tensor._cases import placements_1d, sizes_for

    rng = random.Random(seed)
    meshes = [this_rank().mesh]
    if world == 4:
        meshes.append(this_rank().mesh_for((2, 2)))
    fns = {
        "var": lambda t, d, c, k: torch.var(t, d, correction=c, keepdim=k),
        "std": lambda t, d, c, k: torch.std(t, d, correction=c, keepdim=k),
        "var_mean": lambda t, d, c, k: torch.var_mean(t, d, correction=c, keepdim=k),
        "std_mean": lambda t, d, c, k: torch.std_mean(t, d, correction=c, keepdim=k),
    }
    bad, counts = [], []
    for case in range(10):
        mesh = meshes[case % len(meshes)]
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        places = [rng.choice(placements_1d(len(shape))[:-1]) for _ in range(mesh.ndim)]
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        dims = rng.choice([None, 0, -1, [0, len(shape) - 1] if len(shape) > 1 else [0]])
        corr, keep = rng.choice([0, 1, 2]), rng.choice([False, True])
        name = rng.choice(list(fns))
        fn = fns[name]
        x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
        ref = g.clone().requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            got = fn(x, dims, corr, keep)
        want = fn(ref, dims, corr, keep)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want):
            if not torch.allclose(a.full_tensor(), b, atol=1e-10, equal_nan=True):
                bad.append((name, shape, places, sizes, dims, corr, keep, "forward"))
        weights = [torch.randn(w.shape, dtype=torch.float64) for w in want]
        if all(torch.isfinite(w).all() for w in want):
            sum((a * w).sum() for a, w in zip(got, weights)).backward()
            sum((b * w).sum() for b, w in zip(want, weights)).backward()
            if not torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-10):
                bad.append((name, shape, places, sizes, dims, corr, keep, "backward"))
        cut = [
            m
            for m, p in enumerate(places)
            if isinstance(p, Shard)
            and (dims is None or p.dim % len(shape) in [d % len(shape) for d in (
                [dims] if isinstance(dims, int) else dims)])
            and mesh.shape[m] > 1
        ]  # fmt: skip
        counts.append((len(cut), sum(e.kind == "all_gather" for e in t.events)))
    return bad, counts


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("world", [pytest.param(2), pytest.param(3), pytest.param(4)])
def test_moments_equal_one_device_with_one_all_gather_per_cut_mesh_dim(ranks_for, world, seed):
    for bad, counts in ranks_for(world).run(_body, seed, world):
        assert not bad, bad[:3]
        assert all(gathers <= cut for cut, gathers in counts), counts


def test_a_moment_over_a_cut_dim_sends_one_all_gather_of_three_numbers_per_entry(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(9, 5, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 3, 2]])
        with shardlab.trace() as t:
            y = x.var(0)
        return (
            [(e.kind, e.bytes, e.label) for e in t.events],
            torch.allclose(y.full_tensor(), g.var(0)),
            y.placements,
        )

    for events, exact, placements in ranks_for(3).run(body):
        assert exact and [type(p).__name__ for p in placements] == ["Replicate"]
        assert events == [("all_gather", 3 * 5 * 8, "var.reduce")], events  # (n, mean, M2) x 5


def test_norms_over_a_cut_dim_through_torchs_primitives_gather_nothing(ranks_for):
    """``F.layer_norm`` / ``F.group_norm`` unpatched over a cut dim: torch's reference
    decomposition emits ``prims.var`` / ``prims.sum`` / ``prims.broadcast_in_dim``
    (``shardlab/engine/aten/prims.py``), each run as the aten op it is; exact forward and
    backward, no whole-tensor gather."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(3, 4, 5, dtype=torch.float64)
        out = {}
        for name, f in {
            "layer_norm": lambda t: F.layer_norm(t, (5,)),
            "layer_norm (4, 5)": lambda t: F.layer_norm(t, (4, 5)),
            "group_norm": lambda t: F.group_norm(t, 2),
        }.items():
            x = shardlab.distribute(g, mesh, [Shard(2)], [[2, 0, 3]]).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"):
                y = f(x)
                (y * y).sum().backward()
            r = f(ref)
            (r * r).sum().backward()
            out[name] = (
                torch.allclose(y.full_tensor(), r),
                torch.allclose(x.grad.full_tensor(), ref.grad),
            )
        return out

    for out in ranks_for(3).run(body):
        assert all(all(v) for v in out.values()), out
