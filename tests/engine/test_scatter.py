"""Scatter and index ops along a cut dim with a whole index (``shardlab/engine/aten/
scatter.py``; ``x[idx]``, ``x[idx] = v`` too): each rank writes (or picks) its own rows,
no message (``x[idx] += 2``: the picked rows summed once), never a whole-tensor
gather (``gathers("raise")``), forward and backward equal to one device over random
uneven and empty pieces, duplicates, negative and empty indices; torch's errors for an
index out of range, on every rank."""

from __future__ import annotations

import pytest
import torch


def _put(idx, values, add=False):
    def put(t):
        t = t * 1
        if add:
            t[idx] += values
        else:
            t[idx] = values
        return t

    return put


def _ops(idx1, idx2, src, n):
    mixed = torch.where(torch.arange(idx1.numel()) % 2 == 0, idx1, idx1 - n)  # -1: the last
    return {
        "x[idx]": lambda t: t[idx1],
        "x[negative idx]": lambda t: t[mixed],
        "x[negative idx] = v": _put(mixed, src),
        "index_put negative accumulate": lambda t: t.index_put((mixed,), src, accumulate=True),
        "x[idx 2-d]": lambda t: t[idx1.view(-1, 1)],
        "x[idx] = v": _put(idx1, src),
        "x[idx] += 2": _put(idx1, 2.0, add=True),
        "index_put accumulate": lambda t: t.index_put((idx1,), src, accumulate=True),
        "scatter_add": lambda t: t.scatter_add(0, idx2, src),
        "scatter": lambda t: t.scatter(0, idx2[:1], src[:1]),
        "scatter_reduce amax": lambda t: t.scatter_reduce(0, idx2, src, "amax"),
        "scatter_reduce mean": lambda t: t.scatter_reduce(0, idx2, src, "mean", include_self=False),
        "index_add alpha": lambda t: t.index_add(0, idx1, src, alpha=2),
        "index_copy": lambda t: t.index_copy(0, idx1.unique(), src[: idx1.unique().numel()]),
        "index_fill": lambda t: t.index_fill(0, idx1, -1.5),
        "index_add_": lambda t: (t * 1).index_add_(0, idx1, src),
        "gather": lambda t: t.gather(0, idx2),
        "index_select": lambda t: t.index_select(0, idx1) * 2,
    }


def _body(seed):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    mesh = shardlab.this_rank().mesh
    bad, sent = [], []
    for case in range(6):
        n, f, e = rng.randint(1, 8), rng.randint(1, 4), rng.randint(0, 9)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(n, f, dtype=torch.float64, generator=gen)
        idx1 = torch.randint(0, n, (e,), generator=gen)  # duplicates likely
        idx2 = idx1[:, None].expand(e, f).contiguous()
        src = torch.randn(e, f, dtype=torch.float64, generator=gen)
        cut = case % 2  # the scattered dim, or the other one
        sizes = random_sizes(rng, g.shape[cut], mesh.size())
        for name, fn in _ops(idx1, idx2, src, n).items():
            x = shardlab.distribute(g, mesh, [Shard(cut)], [sizes]).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x)
            with shardlab.gathers("raise"):
                (y * 3).sum().backward()
            want = fn(ref)
            (want * 3).sum().backward()
            if not (
                torch.allclose(y.full_tensor(), want)
                and torch.allclose(x.grad.full_tensor(), ref.grad)
            ):
                bad.append((name, n, e, cut, sizes))
            sent.append((name, sum(ev.bytes for ev in t.events)))
    return bad, sent


@pytest.mark.parametrize("world", [2, 3])
def test_scatter_and_index_ops_on_a_cut_target_equal_one_device_without_messages(ranks_for, world):
    for bad, sent in ranks_for(world).run(_body, world):
        assert not bad, bad[:3]
        assert all(b == 0 for n, b in sent if n != "x[idx] += 2"), [s for s in sent if s[1]][:3]


def test_gather_of_a_cut_input_is_a_partial_sum_and_a_bad_index_raises_everywhere(ranks_for):
    def body():
        from torch.distributed.tensor import Partial, Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.arange(12.0).view(6, 2)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 0, 2]])
        index = torch.tensor([[5, 0], [2, 5]])
        y = x.gather(0, index)
        errors = []
        for call in (
            lambda: x.scatter_add(0, index + 1, g[:2]),
            lambda: x.index_select(0, index[0] + 1),
            lambda: x[index[0] - 11],  # [-6, -11]: -6 is the first row, -11 none
        ):
            try:
                call()
            except (IndexError, RuntimeError) as e:
                errors.append((type(e).__name__, "6" in str(e) and "out of bounds" in str(e)))
        return (
            isinstance(y.placements[0], Partial),
            torch.equal(y.full_tensor(), g.gather(0, index)),
            errors,
        )

    for partial, exact, errors in ranks_for(3).run(body):
        assert partial and exact
        assert errors == [("RuntimeError", True), ("IndexError", True), ("IndexError", True)]


def _sources_body(seed):
    import random

    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    mesh = shardlab.this_rank().mesh
    bad, sent = [], []
    for case in range(6):
        n, f, e = rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 9)
        gen = torch.Generator().manual_seed(case)
        g = torch.randn(n, f, dtype=torch.float64, generator=gen)
        idx = torch.randint(0, n, (e,), generator=gen)
        src = torch.randn(e, f, dtype=torch.float64, generator=gen)
        sizes = random_sizes(rng, e, mesh.size())

        def rows(i, f=f):
            return i[:, None].expand(-1, f)

        ops = {
            "index_add": lambda t, i, s: t.index_add(0, i, s, alpha=3),
            "scatter_add": lambda t, i, s: t.scatter_add(0, rows(i), s),
            "scatter_reduce sum": lambda t, i, s: t.scatter_reduce(0, rows(i), s, "sum"),
            "scatter_reduce amax": lambda t, i, s: t.scatter_reduce(0, rows(i), s, "amax"),
        }
        for name, fn in ops.items():
            index = shardlab.distribute(idx, mesh, [Shard(0)], [sizes])
            source = shardlab.distribute(src, mesh, [Shard(0)], [sizes]).requires_grad_(True)
            x = shardlab.distribute(g, mesh, [Replicate()]).requires_grad_(True)
            x_ref, src_ref = g.clone().requires_grad_(True), src.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x, index, source)
            with shardlab.gathers("raise"):
                whole = y.full_tensor()
                (y * 2).sum().backward()
            want = fn(x_ref, idx, src_ref)
            (want * 2).sum().backward()
            if not (
                torch.allclose(whole, want)
                and torch.allclose(source.grad.full_tensor(), src_ref.grad)
                and torch.allclose(x.grad.full_tensor(), x_ref.grad)
            ):
                bad.append((name, n, e, sizes))
            sent.append((name, type(y.placements[0]).__name__, len(t.events)))
    return bad, sent


@pytest.mark.parametrize("world", [2, 3])
def test_writes_from_cut_entries_into_a_whole_target_are_partial_without_messages(ranks_for, world):
    """A graph's edges cut across ranks, the node table whole: ``index_add`` /
    ``scatter_add`` / ``scatter_reduce`` (sum, amax) write each rank's edges, a Partial
    result, no message until it is read whole; the source's gradient (an
    ``index_select`` / ``gather`` by the cut index) stays cut, no message."""
    for bad, sent in ranks_for(world).run(_sources_body, world):
        assert not bad, bad[:3]
        assert all(kind == "Partial" and count == 0 for _, kind, count in sent), sent[:3]


def test_index_tensors_given_as_shard_tensors_in_the_list(ranks_for):
    """``x[i]`` where ``i`` is itself a ShardTensor (the index list reaches the blocks as
    it is): a whole index on a cut ``x``, a cut index into a whole ``x`` (a loss's
    ``weight[target]``), and a write through them; equal to one device, no gather."""

    def body():
        from torch.distributed.tensor import Replicate, Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(6, 2, dtype=torch.float64)
        idx = torch.tensor([5, 0, 3, 3])
        x = shardlab.distribute(g, mesh, [Shard(0)], [[3, 0, 3]])
        whole_idx = shardlab.distribute(idx, mesh, [Replicate()])
        cut_idx = shardlab.distribute(idx, mesh, [Shard(0)], [[1, 2, 1]])
        with shardlab.gathers("raise"):
            picked = x[whole_idx]
            by_cut = g[cut_idx]
            y = x * 1
            y[whole_idx] = torch.ones(4, 2, dtype=torch.float64)
        want = g.clone()
        want[idx] = 1.0
        return (
            torch.equal(picked.full_tensor(), g[idx]),
            torch.equal(by_cut.full_tensor(), g[idx]) and by_cut.placements == (Shard(0),),
            torch.equal(y.full_tensor(), want),
        )

    for out in ranks_for(3).run(body):
        assert out == (True, True, True), out
