"""Ops with nothing for autograd to record, replayed at ``__torch_function__``
(``shardlab/engine/nograd.py``): equal to torch (values, dtypes, global strides) and
to the usual path (layouts, messages); never for views, for arguments that require
grad under grad mode, under autocast or a dispatch mode; keys that miss when any part
changes; a bounded table."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

OPS = [
    lambda a, b: a + b,
    lambda a, b: a * 2.5 - b,
    lambda a, b: torch.where(a > 0, a, b),
    lambda a, b: F.gelu(a) / (b.abs() + 1),
    lambda a, b: a.clamp(-0.5, 0.5) + b.exp(),
    lambda a, b: (a + 2).to(torch.float64) * b.double(),
    lambda a, b: a.sum(-1) + b.sum(-1),  # an uncut dim
    lambda a, b: a.sum(1) * 2,  # a cut one: a Partial sum, reduced
    lambda a, b: a.softmax(-1) * b.log_softmax(-1) + F.softmax(a, 1),
    lambda a, b: F.layer_norm(a, a.shape[-1:]) - F.log_softmax(b, dim=-1),  # Python F
    lambda a, b: torch.cat([a, b], -1)[..., 1:],
    lambda a, b: torch.cat([a, b], 1),  # along the cut dim: blocks move
    lambda a, b: a @ b.transpose(-1, -2),
    lambda a, b: (a > b).float() + torch.maximum(a, b),
    lambda a, b: a.transpose(0, 2).contiguous().sum(0),  # a view, then a copy
    lambda a, b: torch.sort(a, -1).values + b,  # a tuple of results
    lambda a, b: a.clone().add_(b).mul_(2),  # in place
    lambda a, b: torch.stack([a, b]).mean(0),
]


@contextlib.contextmanager
def _counting():
    """How many calls the nograd path replayed (``n[0]``) inside the block."""
    from shardlab.engine import nograd

    n, call = [0], nograd._Replay.__call__

    def counted(self, *a):
        n[0] += 1
        return call(self, *a)

    nograd._Replay.__call__ = counted
    try:
        yield n
    finally:
        nograd._Replay.__call__ = call


def _sweep(seed, mesh_shape=None):
    def body():
        from torch.distributed.tensor import Partial, Replicate, Shard

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.engine import decisions
        from tests.tensor._cases import random_sizes, sizes_for

        mesh = this_rank().mesh if mesh_shape is None else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        bad, replays = [], 0
        decisions.clear()
        for i, op in enumerate(OPS):
            shape = (rng.randint(1, 4), rng.randint(0, 7), rng.randint(1, 4))
            g = torch.Generator().manual_seed(seed * 100 + i)
            x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            want = op(x, y)
            if mesh.ndim == 2:  # the batch dim on one mesh dim, the cut dim on the other
                places = rng.choice([[Shard(0), Shard(1)], [Replicate(), Shard(1)]])
                sx = sizes_for(rng, shape, tuple(mesh.shape), places)
                a = distribute(x, mesh, places, sx)
                b = distribute(y, mesh, places, sx if rng.random() < 0.5 else None)
            else:
                places = rng.choice([[Shard(1)], [Shard(1)], [Replicate()], [Partial()]])
                sx = [random_sizes(rng, shape[1], mesh.size())] if places == [Shard(1)] else None
                a = distribute(x, mesh, places, sx)
                sy = sx if places == [Shard(1)] and rng.random() < 0.5 else None
                sy = sy or [random_sizes(rng, shape[1], mesh.size())]
                b = distribute(y, mesh, [Shard(1)], sy)
            results = []
            with torch.no_grad(), _counting() as n:
                for _ in range(4):  # learnt after the aten ops were kept, then replayed
                    with shardlab.trace() as t:
                        out = op(a, b)
                    results.append((out, t.counts(), t.bytes(kind="send")))
            replays += n[0]
            for out, counts, sent in results:
                full = out.full_tensor()
                if not (torch.allclose(full, want, atol=1e-5) and full.dtype == want.dtype):
                    bad.append((i, "values"))
                if out.stride() != want.stride() and want.numel() > 1:
                    bad.append((i, "strides", out.stride(), want.stride()))
                if out.sharding != results[0][0].sharding or out.requires_grad:
                    bad.append((i, "layout"))
                if (counts, sent) != results[0][1:]:
                    bad.append((i, "messages", counts, results[0][1]))
        return bad, replays

    return body


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_replayed_calls_equal_torch_and_the_usual_path(ranks_for, world, seed):
    for bad, replays in ranks_for(world).run(_sweep(world * 10 + seed)):
        assert bad == [] and replays > 0, (bad, replays)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 2), (2, 1)])
def test_replayed_calls_on_2d_meshes(ranks_for, mesh_shape):
    world = mesh_shape[0] * mesh_shape[1]
    for bad, replays in ranks_for(world).run(_sweep(70 + world, mesh_shape)):
        assert bad == [] and replays > 0, (bad, replays)


def test_views_keep_autograds_view_tracking(ranks_for):
    """A view's result is a view of its input (``_base``, a shared version counter),
    every call: views take the usual path."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import nograd

        mesh = this_rank().mesh
        a = distribute(torch.randn(3, 5, 4), mesh, [Shard(1)], [[3, 2]])
        ok = []
        with torch.no_grad(), _counting() as n:
            for _ in range(3):
                for v in (a.transpose(0, 2), a.view(3, 20), a[:, 1:], a.expand(2, 3, 5, 4)):
                    before = v._version
                    a.add_(0)
                    ok.append(v._is_view() and v._base is a and v._version == before + 1)
        ok.append(torch.Tensor.transpose in nograd._NEVER)
        return ok, n[0]

    for ok, replays in ranks_for(2).run(body):
        assert all(ok) and replays == 0, (ok, replays)


def test_arguments_that_require_grad_are_recorded(ranks_for):
    """Grad mode and an argument requiring grad: never replayed, gradients as torch's;
    under ``no_grad`` the same call is replayed and its result requires no grad."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        x0 = torch.randn(2, 5, 3)
        want = torch.autograd.grad((x0.requires_grad_() * 3).softmax(-1)[..., 0].sum(), x0)[0]
        with _counting() as trained:  # replayed: only the calls on c
            for _ in range(3):
                x = x0.detach().clone().requires_grad_()
                a = distribute(x, mesh, [Shard(1)], [[4, 1]])
                c = distribute(x0.detach(), mesh, [Shard(1)], [[4, 1]])  # no grad: replayed
                y = (c + 1) * 0 + (a * 3).softmax(-1)
                y.to_local()[..., 0].sum().backward()
        with torch.no_grad(), _counting() as frozen:
            outs = [(a * 3).softmax(-1) for _ in range(3)]
        return (
            trained[0] > 0,  # (c + 1) * 0
            torch.allclose(x.grad, want),
            frozen[0] > 0,
            not any(o.requires_grad for o in outs),
        )

    for ok in ranks_for(2).run(body):
        assert all(ok), ok


def test_autocast_and_modes_take_the_usual_path(ranks_for):
    def body():
        from torch.distributed.tensor import Shard
        from torch.utils._python_dispatch import TorchDispatchMode

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        x0, w0 = torch.randn(4, 6), torch.randn(6, 6)
        a, w = distribute(x0, mesh, [Shard(0)], [[1, 3]]), distribute(w0, mesh, [Shard(0)])
        seen = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), _counting() as n:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = a @ w.full_tensor()
            for _ in range(3):
                with Watch():
                    a + 1
        want = (x0.bfloat16() @ w0.bfloat16()).float()
        close = torch.allclose(out.full_tensor().float(), want, atol=0.1, rtol=0.05)
        return n[0], out.dtype == torch.bfloat16, close, seen.count(torch.ops.aten.add.Tensor)

    for replays, dtype, close, adds in ranks_for(2).run(body):
        assert replays == 0 and dtype and close and adds == 3


def test_every_part_of_the_key_misses_and_the_table_is_bounded(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import decisions, nograd
        from tests.tensor._cases import key_variants

        mesh = this_rank().mesh
        g = torch.randn(2, 6, 4)
        base = distribute(g, mesh, [Shard(1)], [[4, 2]])
        variants = key_variants(g, mesh, distribute)
        seen = {}
        with torch.no_grad():
            decisions.clear()
            for _ in range(3):
                base * 2
            n0 = len(nograd.TABLE)
            base * 2
            seen["repeat adds nothing"] = len(nograd.TABLE) == n0 == 1
            for name, v in variants.items():
                before = len(nograd.TABLE)
                for _ in range(3):
                    out = v * 2
                seen[name] = len(nograd.TABLE) == before + 1 and torch.equal(
                    out.full_tensor(), v.full_tensor() * 2
                )
            for name, s in {"scalar type": 2.0, "bool scalar": True, "nan": float("nan")}.items():
                before = len(nograd.TABLE)
                for _ in range(3):
                    out = base * s
                want = g * s
                seen[name] = (
                    len(nograd.TABLE) == before + 1
                    and out.dtype == want.dtype
                    and torch.equal(out.full_tensor().isnan(), want.isnan())
                )
            x = base
            for _ in range(200):  # a loop on its own results: their keys repeat
                x = (x * 0.5 + 1).relu()
            steady = len(nograd.TABLE)
            for _ in range(20):
                x = (x * 0.5 + 1).relu()
            seen["steady in a loop"] = len(nograd.TABLE) == steady
            seen["loop values"] = torch.allclose(x.full_tensor(), _loop(g, 220))
            old, decisions.SIZE = decisions.SIZE, 16
            try:
                for n in range(40):  # new shapes every time: the oldest go
                    t = distribute(torch.randn(n + 1), mesh, [Shard(0)])
                    for _ in range(3):
                        t + 1
                seen["bounded"] = len(nograd.TABLE) <= 16
            finally:
                decisions.SIZE = old
        return seen

    for seen in ranks_for(2).run(body):
        assert all(seen.values()), seen


def _loop(x, n):
    for _ in range(n):
        x = (x * 0.5 + 1).relu()
    return x


def test_a_replayed_call_follows_the_default_dtype(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        ints = distribute(torch.arange(10).reshape(2, 5), mesh, [Shard(1)], [[3, 2]])
        with torch.no_grad(), _counting() as n:
            first = [ints * 0.5 for _ in range(3)][-1]
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                second = ints * 0.5
            finally:
                torch.set_default_dtype(old)
        want = torch.arange(10).reshape(2, 5).double() * 0.5
        return (
            n[0] >= 1,
            first.dtype == torch.float32,
            second.dtype == second.to_local().dtype == torch.float64,
            torch.equal(second.full_tensor(), want),
        )

    for ok in ranks_for(2).run(body):
        assert all(ok), ok
