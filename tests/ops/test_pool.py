"""Sharded pooling against single-device torch: values, indices, input gradients, bytes."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.layout import conv_plan
from tests.tensor._cases import random_sizes


def _random_call(rng):
    """(function name, args, kwargs, n spatial dims) of one pooling call."""
    n = rng.choice([1, 2, 2, 3])
    kind = rng.choice(["max", "max", "avg", "avg", "adaptive_avg", "adaptive_max"])
    if kind.startswith("adaptive"):
        out = [rng.choice([1, 2, 3, 5, 7]) for _ in range(n)]
        kw = {"return_indices": rng.random() < 0.5} if kind == "adaptive_max" else {}
        return f"{kind}_pool{n}d", (out,), kw, n
    k = [rng.randint(1, 4) for _ in range(n)]
    s = rng.choice([None, [rng.randint(1, 3) for _ in range(n)]])
    p = [rng.randint(0, ki // 2) for ki in k]
    kw = {"ceil_mode": rng.random() < 0.5}
    if kind == "max":
        # (torch 2.13 itself segfaults on some dilated 3-d max pools of size-1 dims)
        kw["dilation"] = [rng.randint(1, 2) if n < 3 else 1 for _ in range(n)]
        kw["return_indices"] = rng.random() < 0.4
    else:
        kw["count_include_pad"] = rng.random() < 0.5
        if n > 1 and rng.random() < 0.25:
            kw["divisor_override"] = rng.randint(1, 5)
    return f"{kind}_pool{n}d", (k, s, p), kw, n


def _sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done, names = 0, set()
        while done < cases:
            name, args, kw, n = _random_call(rng)
            shape = [rng.randint(1, 2), 2, *[rng.randint(1, 9) for _ in range(n)]]
            torch.manual_seed(done)
            g = torch.randn(shape, dtype=torch.float64)
            xr = g.clone().requires_grad_()
            try:
                ref = getattr(F, name)(xr, *args, **kw)
            except (RuntimeError, ValueError):
                continue  # torch itself rejects this configuration
            ref, ref_idx = ref if isinstance(ref, tuple) else (ref, None)
            w_out = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w_out).sum().backward()
            dims = rng.sample(range(2, 2 + n), min(len(mesh_shape), n))
            if rng.random() < 0.15:  # sometimes the batch (often with an empty shard)
                dims = [0] + dims[: len(mesh_shape) - 1]
            dims += [0] * (len(mesh_shape) - len(dims))
            placements = [Shard(d) for d in dims]
            if len(mesh_shape) == 2 and dims[1] == 0:
                placements[1] = Replicate()
            sizes = [
                random_sizes(rng, shape[p.dim], mesh_shape[m]) if isinstance(p, Shard) else None
                for m, p in enumerate(placements)
            ]
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, placements, sizes=sizes)
                with shardlab.trace() as t:
                    y = getattr(F, name)(st, *args, **kw)
            y, idx = y if isinstance(y, tuple) else (y, None)
            out = y.full_tensor()
            cfg = (name, args, kw, shape, placements, sizes)
            assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-12), cfg
            if ref_idx is not None:
                assert torch.equal(idx.full_tensor(), ref_idx), cfg
            (out * w_out).sum().backward()
            assert torch.allclose(x.grad, xr.grad, atol=1e-12), cfg
            assert set(t.counts()) <= {"send", "recv"}, (cfg, t.counts())
            names.add(name)
            done += 1
        return done, len(names)

    return body


def test_pool_sweep_1d_mesh(ranks_for):
    got = ranks_for(3).run(_sweep((3,), 45, seed=3))
    assert got[0][0] == 45 and got[0][1] >= 8


def test_pool_sweep_2d_mesh(ranks_for):
    got = ranks_for(4).run(_sweep((2, 2), 25, seed=7))
    assert got[0][0] == 25


CASES = [  # (name, length, kwargs, sizes): 1-D on 3 ranks, exact halo bytes
    ("window crosses two shard edges", 9, dict(kernel_size=5, stride=1, padding=2), [3, 1, 5]),
    ("shards of size 1", 3, dict(kernel_size=3, stride=1, padding=1), [1, 1, 1]),
    ("odd sizes, ceil_mode", 11, dict(kernel_size=3, stride=2, ceil_mode=True), [3, 5, 3]),
    ("k2 s2 on odd shards", 9, dict(kernel_size=2, ceil_mode=True), [3, 3, 3]),
    ("empty shard, dilation", 8, dict(kernel_size=2, stride=1, dilation=3), [4, 0, 4]),
]


PAIRS = [(op, c) for c in CASES for op in ("max_pool1d", "avg_pool1d") if op[0] == "m" or
         "dilation" not in c[2]]  # fmt: skip


@pytest.mark.parametrize("op,case", PAIRS, ids=[f"{op} {c[0]}" for op, c in PAIRS])
def test_named_cases_exact_bytes(ranks_for, case, op):
    _, length, kw, sizes = case

    def body():
        mesh, me = this_rank().mesh, this_rank().rank
        g = torch.randn(
            2, 3, length, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        )
        ref = getattr(F, op)(g, **kw)
        with shardlab.patched():
            st = distribute(g.clone().requires_grad_(), mesh, [Shard(2)], sizes=sizes)
            with shardlab.trace() as t:
                y = getattr(F, op)(st, **kw)
                y.full_tensor().sum().backward()
        k, s = kw["kernel_size"], kw.get("stride", kw["kernel_size"])
        pad = kw.get("padding", 0)
        plan = conv_plan(
            sizes, k, s, kw.get("dilation", 1), (pad, pad), ceil_mode=kw.get("ceil_mode", False)
        )
        row = 2 * 3 * 8
        fwd, back = t.filter(label=f"{op}.halo forward"), t.filter(label=f"{op}.halo backward")
        return (
            torch.allclose(y.full_tensor(), ref, atol=1e-12),
            list(y.sharding.sizes_along(2)) == list(plan.out_sizes),
            fwd.bytes(kind="recv") == plan.rows_received(me) * row,
            fwd.bytes(kind="send") == plan.bytes_per_element_sent(me) * row,
            back.bytes(kind="send") == plan.rows_received(me) * row,
        )

    for r in ranks_for(3).run(body):
        assert all(r), r


def test_adaptive_exact_rows(ranks_for):
    """adaptive_avg_pool1d 10 -> 4 on sizes [3, 3, 4]: windows [0,3) [2,5) [5,8) [7,10);
    owners by first row: r0 outputs 0-1 (rows 0-4: 3, 4 from r1), r1 output 2 (rows 5-7:
    6, 7 from r2), r2 output 3 (rows 7-9, its own): exactly the rows each rank lacks."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(1, 2, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with shardlab.patched():
            st = distribute(g, mesh, [Shard(2)], sizes=[3, 3, 4])
            with shardlab.trace() as t:
                y = F.adaptive_avg_pool1d(st, 4)
        ok = torch.allclose(y.full_tensor(), F.adaptive_avg_pool1d(g, 4), atol=1e-12)
        return ok, list(y.sharding.sizes_along(2)), t.bytes(kind="recv") // (2 * 8)

    got = ranks_for(3).run(body)
    assert all(r[0] for r in got)
    assert got[0][1] == [2, 1, 1]
    assert [r[2] for r in got] == [2, 2, 0]


def test_errors_on_every_rank(ranks_for):
    def body():
        mesh = this_rank().mesh
        errors = []
        with shardlab.patched():
            x = distribute(torch.randn(1, 2, 7, 5), mesh, [Shard(2)], sizes=[3, 4])
            for call in (
                lambda: F.max_pool2d(x, 9),  # window larger than the input
                lambda: F.max_pool2d(x, 3, padding=2),  # padding > kernel / 2
                lambda: F.avg_pool2d(x, (2, 2), divisor_override=0),
            ):
                try:
                    call()
                except (RuntimeError, ValueError) as exc:
                    errors.append(type(exc).__name__)
            p = distribute(torch.randn(1, 2, 7, 5), mesh, [Replicate()]).redistribute(
                mesh, [Replicate()]
            )
            from torch.distributed.tensor import Partial

            part = shardlab.ShardTensor.from_local(p.to_local(), mesh, [Partial()])
            # a Partial input is summed first (one all-reduce), as DTensor would
            with shardlab.trace() as t:
                y = F.max_pool2d(part, 2)
            if torch.equal(y.full_tensor(), F.max_pool2d(2 * p.to_local(), 2)):
                errors.append(("partial", t.counts()))
        return errors

    for errors in ranks_for(2).run(body):
        assert errors == [
            "RuntimeError",
            "RuntimeError",
            "RuntimeError",
            ("partial", {"all_reduce": 1}),
        ], errors


def test_unbatched_inputs(ranks_for):
    """(C, *spatial) inputs, as torch allows: the spatial dims are the last n."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(3, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        calls = [
            lambda t: torch.nn.MaxPool2d(3, 2, 1, return_indices=True, ceil_mode=True)(t),
            lambda t: F.adaptive_max_pool2d(t, (4, 5), return_indices=True),
            lambda t: F.avg_pool1d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            lambda t: F.adaptive_avg_pool1d(t, 4),
        ]
        ok = []
        with shardlab.patched():
            for dim, sizes in [(1, [5, 0, 1, 3]), (2, [2, 2, 0, 2])]:
                st = distribute(g, mesh, [Shard(dim)], sizes=sizes)
                for call in calls:
                    got, ref = call(st), call(g)
                    got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
                    ok.append(all(torch.allclose(a.full_tensor(), b) for a, b in zip(got, ref)))
                    ok.append(len(ref) == 1 or torch.equal(got[1].full_tensor(), ref[1]))
        return ok

    for ok in ranks_for(4).run(body):
        assert all(ok), ok
