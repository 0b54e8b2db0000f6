"""Ops that reorder along a cut dim (``shardlab/engine/aten/ordering.py``, routed from
``dim_ops``): ``flip`` puts each row on its mirror owner once (``cat.align``), the
result cut like the input; ``sort`` / ``argsort`` / ``msort`` / ``median`` /
``nanmedian`` of a 1-D tensor cut along its only dim: a sample sort (samples, counts,
one exchange, one rebalance), torch's stable order; along a dim of a tensor with other
dims, the cut moves to another dim (one all-to-all) and each rank sorts whole lines;
``cumprod`` a scan. Values, indices and gradients equal one device; never a gather.
Not yet: the backward of ``sort`` (1-D and n-D) and of ``median`` along a cut dim of a
matrix (a ``scatter`` of the gradient by the indices, along a cut dim) still gathers,
and is left out here; the 1-D ``median``'s backward is tested."""

from __future__ import annotations

import pytest
import torch

SORT_LABELS = {"sort.samples", "sort.counts", "sort.exchange", "sort.rebalance"}
MEDIAN_LABELS = {"sort.samples", "sort.counts", "sort.exchange", "median.count",
                 "median.value"}  # fmt: skip


def _data(rng, n, case):
    g = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
    if case % 2:  # ties, signed zeros and NaN
        g = torch.tensor([rng.choice([0.0, -0.0, 1.0, 2.0, float("nan")]) for _ in range(n)],
                         dtype=torch.float64)  # fmt: skip
    return g


ONE_D = {
    "sort stable": lambda t: torch.sort(t, stable=True),
    "sort stable descending": lambda t: torch.sort(t, stable=True, descending=True),
    "argsort stable": lambda t: torch.argsort(t, stable=True, descending=True),
    "msort": lambda t: torch.msort(t),
    "median": lambda t: torch.median(t),
    "nanmedian": lambda t: torch.nanmedian(t),
    "median dim": lambda t: torch.median(t, 0),
    "nanmedian keepdim": lambda t: torch.nanmedian(t, 0, keepdim=True),
    "cumprod": lambda t: torch.cumprod(t, 0),
}


def _one_d_body(world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(world)
    mesh = shardlab.this_rank().mesh
    bad, labels = [], {}
    for case in range(4):
        n = rng.randint(1, 13)
        g = _data(rng, n, case)
        sizes = random_sizes(rng, n, mesh.size())
        for name, fn in ONE_D.items():
            if case % 2 and name in ("msort", "median dim", "cumprod"):
                continue  # ties: torch's unstable order; NaN: no gradient to compare
            x = shardlab.distribute(g, mesh, [Shard(0)], [sizes]).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x)
            want = fn(ref)
            ys = list(y) if isinstance(y, tuple) else [y]
            ws = list(want) if isinstance(want, tuple) else [want]
            same = all(torch.equal(a.full_tensor(), b) or torch.allclose(
                a.full_tensor(), b, equal_nan=True) for a, b in zip(ys, ws))  # fmt: skip
            if ys[0].ndim and ys[0]._layout != x._layout and name != "nanmedian keepdim" \
                    and mesh.size() > 1:  # fmt: skip
                same = False  # the result cut like the input
            if not case % 2 and ys[0].requires_grad and "sort" not in name:  # (no NaN)
                with shardlab.gathers("raise"):
                    (ys[0] * ys[0]).sum().backward()
                (ws[0] * ws[0]).sum().backward()
                same = same and torch.allclose(x.grad.full_tensor(), ref.grad)
            labels.setdefault(name, set()).update(e.label for e in t.events)
            if not same:
                bad.append((name, g.tolist(), sizes))
    return bad, labels


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.more_worlds), 3, 4])
def test_sort_and_median_of_a_cut_1d_tensor_equal_torch_without_a_gather(ranks_for, world):
    for bad, labels in ranks_for(world).run(_one_d_body, world):
        assert not bad, bad[:3]
        for name, got in labels.items():
            if world == 1:
                assert not got, (name, got)
            elif "sort" in name:
                assert got <= SORT_LABELS, (name, got)
            elif "median" in name:
                assert got <= MEDIAN_LABELS, (name, got)
            else:
                assert got <= {"cumprod.scan"}, (name, got)


def _nd_body(world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import sizes_for

    rng = random.Random(world)
    meshes = [shardlab.this_rank().mesh]
    if world == 4:
        meshes.append(shardlab.this_rank().mesh_for((2, 2)))
    fns = {
        "flip both": lambda t, d: torch.flip(t, [0, 1]),
        "flip one": lambda t, d: torch.flip(t, [d]),
        "sort": lambda t, d: torch.sort(t, d, descending=True)[0],
        "sort stable indices": lambda t, d: torch.sort(t, dim=d, stable=True)[1] * 1.0,
        "median": lambda t, d: torch.median(t, d)[0],
        "nanmedian": lambda t, d: torch.nanmedian(t, d, keepdim=True)[0],
    }
    bad, labels = [], set()
    for case in range(6):
        mesh = meshes[case % len(meshes)]
        shape = (rng.randint(2, 6), rng.randint(1, 6))
        d = rng.randrange(2)
        places = [Shard(d)] + [Shard(1 - d)] * (mesh.ndim - 1)  # (a dim cut twice: not yet)
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        g = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(case)).double()
        for name, fn in fns.items():
            x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x, d)
                if name.startswith("flip") and y._layout != x._layout:
                    bad.append((name, "layout", shape, places, sizes, d))
                if y.requires_grad and name.startswith("flip"):  # (the others': see the top)
                    (y * y).sum().backward()
            want = fn(ref, d)
            if want.requires_grad and name.startswith("flip"):
                (want * want).sum().backward()
            labels |= {e.label for e in t.events}
            if not torch.equal(y.full_tensor(), want) or (
                ref.grad is not None and not torch.allclose(x.grad.full_tensor(), ref.grad)
            ):
                bad.append((name, shape, places, sizes, d))
    return bad, labels


@pytest.mark.parametrize("world", [2, 3, 4])
def test_flip_sort_median_along_cut_dims_of_matrices(ranks_for, world):
    """Ties everywhere (values 0, 1, 2): the sort's whole lines give torch's own order;
    the 2-D mesh at 4 ranks cuts both dims. (A dim cut twice, nested, still moves.)"""
    for bad, labels in ranks_for(world).run(_nd_body, world):
        assert not bad, bad[:3]
        assert not any(label.startswith("whole-tensor") for label in labels), labels


def test_flip_sends_each_row_to_its_mirror_owner_once(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(7, 4, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 0, 3]])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            y = torch.flip(x, [0])
        sent = sum(e.bytes for e in t.events if e.kind == "send")
        return sent, y._layout == x._layout, torch.equal(y.full_tensor(), g.flip(0))

    out = ranks_for(3).run(body)
    # rows 0-3 (rank 0) become rows 3-6 (rank 0 keeps row 3, 3 rows go to rank 2),
    # rows 4-6 (rank 2) become rows 0-2 (to rank 0): 6 rows of 4 float64 sent in all
    assert sum(s for s, _, _ in out) == 6 * 4 * 8
    assert all(same and exact for _, same, exact in out)
