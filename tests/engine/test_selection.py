"""Results whose size depends on the values (``shardlab/engine/aten/selection.py``):
``nonzero``, ``argwhere``, ``masked_select`` and ``x[mask]`` of a tensor cut along its rows
equal one device, in torch's order, cut in uneven pieces (each rank its own hits), with one
all-gather of one number per rank and never a whole-tensor gather."""

from __future__ import annotations

import pytest
import torch


def _body(seed):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    mesh = shardlab.this_rank().mesh
    n = mesh.size()
    ops = {
        "nonzero": lambda t: torch.nonzero(t > 0),
        "argwhere": lambda t: torch.argwhere(t > 0.3),
        "masked_select": lambda t: torch.masked_select(t, t < 0),
        "x[mask]": lambda t: (
            t[t[(slice(None),) + (0,) * (t.ndim - 1)] > 0] if t.ndim > 1 else t[t > 0]
        ),
    }
    bad, events = [], []
    for case in range(8):
        shape = (rng.randint(0, 9), *(rng.randint(1, 4) for _ in range(rng.randint(0, 2))))
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        sizes = random_sizes(rng, shape[0], n)
        x = shardlab.distribute(g, mesh, [Shard(0)], [sizes])
        for name, op in ops.items():
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = op(x)
            want = op(g)
            hits = op(x.to_local()).shape[0]  # this rank's own hits
            if not torch.equal(y.full_tensor(), want) or y.to_local().shape[0] != hits:
                bad.append((name, shape, sizes))
            events.append([(e.kind, e.bytes) for e in t.events if e.label.endswith("counts")])
    return bad, events


@pytest.mark.parametrize("world", [2, 3, 4])
def test_selections_equal_one_device_cut_in_uneven_pieces(ranks_for, world):
    for bad, events in ranks_for(world).run(_body, world):
        assert not bad, bad[:3]
        assert all(e == [("all_gather", 8)] for e in events), events[:3]


def test_a_selection_along_another_cut_dim_says_it_gathers(ranks_for):
    """Cut along a dim other than the rows, row-major order interleaves the ranks: the
    fallback computes it whole, and says so."""

    def body():
        import warnings

        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(4, 5, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(1)], [[2, 3]])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.nonzero(x > 0)
        said = [m for m in w if issubclass(m.category, shardlab.GatherWarning)]
        return torch.equal(y.full_tensor(), torch.nonzero(g > 0)), len(said)

    for exact, said in ranks_for(2).run(body):
        assert exact and said == 1
