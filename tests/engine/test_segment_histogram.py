"""``segment_reduce`` (``shardlab/engine/aten/segment.py``) and ``histogramdd``
(``histogram.py``) of data cut along its rows: equal to one device (float64) over random
uneven and empty pieces, on 1, 3 and 4 ranks; ``segment_reduce`` sends nothing (max / min /
sum / mean, ``lengths`` or ``offsets``, with and without ``initial``), and its backward
equals torch's (ties, nan) with nothing gathered: no message for sum / mean, two
all-reduces of the result's size for max / min of data cut along its rows;
``histogramdd`` one all-reduce of 2 D numbers per op (the bins' range), counts Partial."""

from __future__ import annotations

import pytest
import torch


def _segments(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad, sent = [], []
    for _ in range(12):
        n = rng.randint(1, 8)
        shape = (n, *[rng.randint(1, 3) for _ in range(rng.randint(0, 1))])
        a = torch.randn(shape, generator=g, dtype=torch.float64)
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 3)))
        lengths = torch.tensor([b - a_ for a_, b in zip([0, *cuts], [*cuts, n])])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        kw = {"lengths": lengths} if rng.random() < 0.5 else {"offsets": offsets}
        if rng.random() < 0.5:
            kw["initial"] = rng.choice([0.5, -1.0])
        reduce = rng.choice(["max", "min", "sum", "mean"])
        d = rng.randrange(len(shape))
        x = shardlab.distribute(a, mesh, [Shard(d)], [random_sizes(rng, shape[d], world)])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.segment_reduce(x, reduce, **kw)
        sent.append(len(t.events))
        if not torch.allclose(y.full_tensor(), torch.segment_reduce(a, reduce, **kw),
                              equal_nan=True):  # fmt: skip
            bad.append((shape, d, reduce, kw))
    return bad, sent


def _segment_gradients(seed, world, two_d=False):
    import random

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh_for((2, 2)) if two_d else shardlab.this_rank().mesh
    bad = []
    for _ in range(16):
        n = rng.randint(1, 8)
        shape = (n, *[rng.randint(1, 3) for _ in range(rng.randint(0, 1))])
        a = torch.randint(-2, 3, shape, generator=g).double()  # (ties across the cuts)
        if rng.random() < 0.2:
            a[0] = float("nan")
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 3)))
        lengths = torch.tensor([b - a_ for a_, b in zip([0, *cuts], [*cuts, n])])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        kw = {"lengths": lengths} if rng.random() < 0.5 else {"offsets": offsets}
        if rng.random() < 0.5:
            kw["initial"] = rng.choice([0.5, -1.0, 1.0])
        reduce = rng.choice(["max", "min", "sum", "mean"])
        d = rng.randrange(len(shape))
        w = torch.randn(len(lengths), *shape[1:], generator=g, dtype=torch.float64)
        one = a.clone().requires_grad_()
        (want,) = torch.autograd.grad((torch.segment_reduce(one, reduce, **kw) * w).sum(), one)
        if two_d:  # each mesh dim cuts dim 0, dim d or nothing
            places = [rng.choice([Shard(0), Shard(d), Replicate()]) for _ in range(2)]
            sizes = [random_sizes(rng, shape[p.dim], 2) if isinstance(p, Shard) else None
                     for p in places]  # fmt: skip
            if places[0] == places[1]:  # (a dim cut twice: the inner cut even)
                sizes[1] = None
            x = shardlab.distribute(a, mesh, places, sizes).requires_grad_()
        else:
            sizes = random_sizes(rng, shape[d], world)
            x = shardlab.distribute(a, mesh, [Shard(d)], [sizes]).requires_grad_()
        with shardlab.gathers("raise"):
            loss = (torch.segment_reduce(x, reduce, **kw) * w).sum()
            with shardlab.trace() as t:
                (got,) = torch.autograd.grad(loss, x)
        mine = [(e.kind, e.label, e.bytes) for e in t.events if e.rank == dist.get_rank()]
        expected = []  # sum, mean, or data cut along another dim: no message
        if d == 0 and reduce in ("max", "min") and world > 1:  # the result, the ties' counts
            expected = [("all_reduce", "segment_reduce backward", w.numel() * 8)] * 2
        if two_d:  # (max / min: all-reduces of the result's size over the dims cutting rows)
            cut = reduce in ("max", "min") and Shard(0) in places
            expected = [m for m in mine if m[:2] == ("all_reduce", "segment_reduce backward")]
            expected = expected if cut and expected else []
        if not torch.allclose(got.full_tensor(), want, equal_nan=True) or mine != expected:
            bad.append((shape, d, sizes, reduce, kw, mine))
    return bad


def _histograms(seed, world):
    import random

    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mesh = shardlab.this_rank().mesh
    bad = []
    for _ in range(8):
        n, dims = rng.randint(1, 9), rng.randint(1, 3)
        a = torch.randn(n, dims, generator=g, dtype=torch.float64)
        if rng.random() < 0.2:
            a[:, 0] = 1.0  # (one value: torch widens the range by 1/2 each side)
        kw = {}
        if rng.random() < 0.3:
            kw["weight"] = torch.rand(n, generator=g, dtype=torch.float64)
        if rng.random() < 0.3:
            kw["density"] = True
        if rng.random() < 0.3:
            kw["range"] = [v for _ in range(dims) for v in (-1.0, 1.0)]
        bins = [rng.randint(1, 4) for _ in range(dims)]
        d = rng.randrange(2)
        x = shardlab.distribute(a, mesh, [Shard(d)], [random_sizes(rng, a.shape[d], world)])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            h = torch.histogramdd(x, bins=bins, **kw)
        want = torch.histogramdd(a, bins=bins, **kw)
        ok = torch.allclose(h.hist.full_tensor(), want.hist, equal_nan=True)
        ok = ok and all(
            torch.equal(e.full_tensor(), f) for e, f in zip(h.bin_edges, want.bin_edges)
        )
        mine = [e for e in t.events if e.rank == dist.get_rank()]
        ranged = "range" not in kw and world > 1
        if d == 0 and [e.kind for e in mine] != ["all_reduce"] * (
            2 * ranged + bool(kw.get("density")) * (world > 1)
        ):
            ok = False
        if not ok:
            bad.append((a.shape, d, bins, list(kw), [e.label for e in mine]))
    return bad


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_segment_reduce_sends_nothing(ranks_for, world):
    bad, sent = ranks_for(world).run(_segments, 30 + world, world)[0]
    assert bad == [] and all(n == 0 for n in sent), (bad, sent)


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_histogramdd_counts_each_ranks_rows(ranks_for, world):
    assert ranks_for(world).run(_histograms, 40 + world, world)[0] == []


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_segment_reduce_backward_equals_torch_without_a_gather(ranks_for, world):
    assert ranks_for(world).run(_segment_gradients, 50 + world, world)[0] == []


def test_segment_reduce_backward_on_a_2d_mesh(ranks_for):
    """Each mesh dim of a (2, 2) mesh cuts the rows, the other dim or nothing."""
    assert ranks_for(4).run(_segment_gradients, 60, 4, True)[0] == []
