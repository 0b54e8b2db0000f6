"""Halo convolution against single-device torch: forward, input, weight and bias gradients."""

import random

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.layout import conv_plan
from tests.tensor._cases import random_sizes


def _random_config(rng):
    n = rng.choice([1, 1, 2, 2, 3])
    transposed = rng.random() < 0.3
    k = [rng.randint(1, 4) for _ in range(n)]
    s = [rng.randint(1, 3) for _ in range(n)]
    d = [rng.randint(1, 2) for _ in range(n)]
    groups = rng.choice([1, 1, 2])
    cin, cout = 2 * groups, rng.choice([1, 2]) * groups
    if transposed:
        padding = [rng.randint(0, 2) for _ in range(n)]
        out_pad = [rng.randint(0, max(s[i], d[i]) - 1) for i in range(n)]
        mode = "zeros"
    else:
        padding = rng.choice(
            ["same", "valid", rng.randint(0, 2), [rng.randint(0, 2) for _ in range(n)]]
        )
        if padding == "same":
            s = [1] * n
        out_pad = [0] * n
        mode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
        if mode != "zeros" and padding in ("same", "valid"):
            padding = 1
    spatial = [rng.randint(1, 9) for _ in range(n)]
    return dict(
        n=n,
        transposed=transposed,
        k=k,
        s=s,
        d=d,
        groups=groups,
        cin=cin,
        cout=cout,
        padding=padding,
        out_pad=out_pad,
        mode=mode,
        spatial=spatial,
        bias=rng.random() < 0.7,
        batch=rng.randint(1, 2),
    )


def _module(cfg):
    n = cfg["n"]
    if cfg["transposed"]:
        cls = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][n - 1]
        return cls(
            cfg["cin"],
            cfg["cout"],
            cfg["k"],
            cfg["s"],
            cfg["padding"],
            cfg["out_pad"],
            cfg["groups"],
            cfg["bias"],
            cfg["d"],
        ).double()
    cls = [nn.Conv1d, nn.Conv2d, nn.Conv3d][n - 1]
    return cls(
        cfg["cin"],
        cfg["cout"],
        cfg["k"],
        cfg["s"],
        cfg["padding"],
        cfg["d"],
        cfg["groups"],
        cfg["bias"],
        cfg["mode"],
    ).double()


def _sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done, seen = 0, set()
        while done < cases:
            cfg = _random_config(rng)
            torch.manual_seed(done)
            conv = _module(cfg)
            shape = [cfg["batch"], cfg["cin"], *cfg["spatial"]]
            g = torch.randn(shape, dtype=torch.float64)
            try:
                xr = g.clone().requires_grad_()
                ref = conv(xr)
            except RuntimeError:
                continue  # torch itself rejects this configuration
            w_out = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w_out).sum().backward()
            ref_grads = [p.grad.clone() for p in conv.parameters()]
            conv.zero_grad(set_to_none=True)
            # shard one spatial dim per mesh dim (or the batch on the first mesh dim)
            dims = rng.sample(range(2, 2 + cfg["n"]), min(len(mesh_shape), cfg["n"]))
            if len(dims) < len(mesh_shape) or rng.random() < 0.1:
                dims = [0] + dims[: len(mesh_shape) - 1]
            dims += [None] * (len(mesh_shape) - len(dims))
            placements = [Shard(dm) if dm is not None else Replicate() for dm in dims]
            sizes = [
                random_sizes(rng, shape[dm], mesh_shape[m]) if dm is not None else None
                for m, dm in enumerate(dims)
            ]
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, placements, sizes=sizes)
                with shardlab.trace() as t:
                    y = conv(st)
            out = y.full_tensor()
            assert torch.allclose(out, ref, atol=1e-10), cfg
            (out * w_out).sum().backward()
            assert torch.allclose(x.grad, xr.grad, atol=1e-10), cfg
            for p, r in zip(conv.parameters(), ref_grads):
                assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, r, atol=1e-10), cfg
            # communication: only point-to-point halo rows (no collective in forward)
            assert set(t.counts()) <= {"send", "recv"}, (cfg, t.counts())
            seen.add((cfg["n"], cfg["transposed"], cfg["mode"], str(cfg["padding"])[:4]))
            done += 1
        return done, len(seen)

    return body


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_sweep_1d_mesh(ranks_for, world):
    """One rank: the spatial dims are whole, one local conv (no halo)."""
    got = ranks_for(world).run(_sweep((world,), 60, seed=world))
    assert got[0][0] == 60 and got[0][1] >= 15


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 1), (1, 2)])
def test_conv_sweep_2d_mesh(ranks_for, mesh_shape):
    """(2, 1) and (1, 2): a spatial dim cut by a mesh dim of one rank is whole there."""
    world = mesh_shape[0] * mesh_shape[1]
    got = ranks_for(world).run(_sweep(mesh_shape, 50, seed=11))
    assert got[0][0] == 50


CASES = [  # (name, spatial, k, s, d, padding, sizes) the known-hard ones, 1-D on 3 ranks
    ("stride 2 kernel 3", 11, 3, 2, 1, 1, [4, 3, 4]),
    ("kernel 2 stride 2 odd shards", 9, 2, 2, 1, 0, [3, 3, 3]),
    ("dilation 2", 10, 3, 1, 2, 2, [4, 2, 4]),
    ("same", 8, 4, 1, 1, "same", [3, 2, 3]),
    ("shards of size 1", 3, 3, 1, 1, 1, [1, 1, 1]),
    ("multi-hop halo", 9, 5, 1, 2, 4, [4, 1, 4]),
    ("empty shard", 7, 3, 1, 1, 1, [4, 0, 3]),
]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_overlap_is_the_same_computation(ranks_for, world):
    """With one sharded spatial dim, the halo messages travel while the interior is
    computed: the output and the input, weight and bias gradients equal one device, and
    the messages (count, peers, bytes) are those of exchanging first (halo_overlap off);
    kernels 1-5, strides 1-4, dilations 1-3, paddings, uneven and empty shards."""

    def body():
        import torch.nn.functional as F

        from shardlab.ops import conv as C
        from shardlab.trace import trace

        mesh, rng = this_rank().mesh, random.Random(world)
        taken, worst = [], 0.0
        overlapped = C.OverlappedConv.apply

        def spy(*args, **kwargs):
            taken.append(1)
            return overlapped(*args, **kwargs)

        C.OverlappedConv.apply = spy
        try:
            for case in range(40):
                n = rng.choice([1, 2])
                k, s_, d_ = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 3)
                pad = rng.choice([0, 1, 2, "same"]) if s_ == 1 else rng.randint(0, 2)
                length = rng.randint(max(12, d_ * (k - 1) + 1), 40)
                sizes = random_sizes(rng, length, world)
                gen = torch.Generator().manual_seed(case)
                width = d_ * (k - 1) + 1 + rng.randint(0, 3)  # the unsharded dim (2-D)
                shape = (2, 3, length) + ((width,) if n == 2 else ())
                x = torch.randn(shape, generator=gen, dtype=torch.float64)
                x.requires_grad_(case % 4 != 0)  # an image needs no gradient (nor messages)
                w = torch.randn((4, 3) + (k,) * n, generator=gen, dtype=torch.float64,
                                requires_grad=True)  # fmt: skip
                b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
                name = "conv1d" if n == 1 else "conv2d"
                args = (s_, pad, d_)
                ref = getattr(F, name)(x, w, b, *args)
                leaves = [t for t in (x, w, b) if t.requires_grad]
                got, messages = {}, {}
                for on in (True, False):
                    with shardlab.patched(), C.halo_overlap(on), trace() as t:
                        xs = distribute(x, mesh, [Shard(2)], [sizes])
                        y = getattr(F, name)(xs, w, b, *args)  # the patched function
                        y = y.full_tensor()
                        grads = torch.autograd.grad(y.square().sum(), leaves)
                    got[on] = (y, *grads)
                    messages[on] = sorted((e.kind, e.peer, e.bytes) for e in t.events)
                want = (ref, *torch.autograd.grad(ref.square().sum(), leaves))
                for a, r in zip(got[True], want):
                    worst = max(worst, (a - r).abs().max().item() / (1 + r.abs().max().item()))
                assert messages[True] == messages[False], (case, sizes, k, s_, d_, pad)
        finally:
            del C.OverlappedConv.apply  # torch's own, inherited, again
        return worst, len(taken)

    for worst, taken in ranks_for(world).run(body):
        assert worst < 1e-12 and taken >= 3, (worst, taken)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_named_cases_and_exact_bytes(ranks_for, case):
    name, length, k, s, d, padding, sizes = case

    def body():
        mesh = this_rank().mesh
        me = this_rank().rank
        torch.manual_seed(0)
        conv = nn.Conv1d(2, 3, k, s, padding, d).double()
        g = torch.randn(2, 2, length, dtype=torch.float64)
        ref = conv(g)
        ref.sum().backward()
        want = [p.grad.clone() for p in conv.parameters()]
        conv.zero_grad()
        x = g.clone().requires_grad_()
        with shardlab.patched():
            st = distribute(x, mesh, [Shard(2)], sizes=sizes)
            with shardlab.trace() as t:
                y = conv(st)
                y.full_tensor().sum().backward()
        # the weight's and bias's gradients: one all-reduce of both, at the end of the
        # backward (shardlab.tensor.grad_sum)
        sums = t.filter(label="params backward")
        param_bytes = sum(p.numel() for p in conv.parameters()) * 8
        pads = (padding, padding) if isinstance(padding, int) else (1, 2)
        plan = conv_plan(sizes, k, s, d, pads)
        row = 2 * 2 * 8  # batch x channels x float64
        halo = t.filter(label="conv1d.halo forward")
        back = t.filter(label="conv1d.halo backward")
        return (
            torch.allclose(y.full_tensor(), ref, atol=1e-12),
            list(y.sharding.sizes_along(2)) == list(plan.out_sizes),
            halo.bytes(kind="recv") == plan.rows_received(me) * row,
            halo.bytes(kind="send") == plan.bytes_per_element_sent(me) * row,
            back.bytes(kind="send") == plan.rows_received(me) * row,
            back.bytes(kind="recv") == plan.bytes_per_element_sent(me) * row,
            [e.kind for e in sums.events] == ["all_reduce"] and sums.bytes() == param_bytes,
            all(torch.allclose(p.grad, w, atol=1e-12) for p, w in zip(conv.parameters(), want)),
        )

    for r in ranks_for(3).run(body):
        assert all(r), r


def test_small_cnn_unchanged(ranks_for):
    """conv -> relu -> conv -> global mean -> linear, from nn modules, on 4 uneven H shards."""

    def body():
        mesh = this_rank().mesh
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
        ).double()
        head = nn.Linear(8, 5).double()
        g = torch.randn(2, 3, 13, 10, dtype=torch.float64)
        xr = g.clone().requires_grad_()
        ref = head(model(xr).mean((2, 3)))
        ref.square().sum().backward()
        ref_grads = [p.grad.clone() for p in [*model.parameters(), *head.parameters()]]
        for p in [*model.parameters(), *head.parameters()]:
            p.grad = None
        x = g.clone().requires_grad_()
        with shardlab.patched():
            st = distribute(x, mesh, [Shard(2)], sizes=[5, 1, 4, 3])
            out = head(model(st).mean((2, 3)))
        out.full_tensor().square().sum().backward()
        ok = torch.allclose(out.full_tensor(), ref, atol=1e-12)
        ok &= torch.allclose(x.grad, xr.grad, atol=1e-12)
        for p, r in zip([*model.parameters(), *head.parameters()], ref_grads):
            ok &= torch.allclose(p.grad, r, atol=1e-12)
        return bool(ok)

    assert ranks_for(4).run(body) == [True] * 4


def test_bad_input_is_a_clear_error_on_every_rank(ranks_for):
    """Layouts shardlab does not support: its own error; arguments torch refuses: torch's
    error type (checked on the global shapes, before any message), on every rank, also
    where a rank owns no rows; and the ranks exchange correctly afterwards."""

    def body():
        F = torch.nn.functional
        mesh = this_rank().mesh
        errors = []
        with shardlab.patched():
            x = distribute(torch.randn(1, 4, 6), mesh, [Shard(1)])
            try:
                F.conv1d(x, torch.randn(2, 4, 3))
            except NotImplementedError as exc:
                errors.append(str(exc))
            bad = [  # (input shape, weight shape, kwargs) torch refuses
                ((1, 3, 9), (4, 5, 3), {}),  # channels
                ((1, 2, 6), (2, 2, 9), {}),  # a kernel wider than the input
                ((1, 3, 9), (4, 1, 3), {"groups": 2}),  # groups do not divide
                ((1, 2, 6), (2, 2, 3), {"padding": "sideways"}),
                ((1, 2, 6), (2, 2, 3), {"stride": 2, "padding": "same"}),
            ]
            for shape, wshape, kw in bad:
                w = torch.randn(*wshape)
                try:
                    F.conv1d(torch.randn(*shape), w, **kw)
                    expected = None
                except Exception as exc:
                    expected = type(exc)
                for sizes in ([shape[2] - 1, 1], [shape[2], 0]):
                    x = distribute(torch.randn(*shape), mesh, [Shard(2)], sizes)
                    try:
                        F.conv1d(x, w, **kw)
                        errors.append(("no error", shape, wshape, kw, sizes))
                    except Exception as exc:
                        errors.append(
                            (
                                type(exc) is expected,
                                "global shape" in str(exc) or "padding" in str(exc),
                            )
                        )
            g = torch.randn(1, 2, 7)
            w = torch.randn(3, 2, 3)
            y = F.conv1d(distribute(g, mesh, [Shard(2)], [4, 3]), w, padding=1)
            errors.append(torch.allclose(y.full_tensor(), F.conv1d(g, w, padding=1)))
        return errors

    results = ranks_for(2).run(body)
    assert results[0] == results[1]
    errors = results[0]
    assert "Shard(dim=1)" in errors[0] or "Shard(1)" in errors[0]
    assert errors[1:-1] == [(True, True)] * 10, errors
    assert errors[-1] is True


def test_two_d_mesh_exact_bytes_with_corners(ranks_for):
    """H on mesh dim 0, W on mesh dim 1: H halos first, then W halos of the H-extended
    window, which carry the corners. Each rank receives exactly what its window lacks."""

    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh_for((2, 2))
        i, j = mesh.get_coordinate()
        h_sizes, w_sizes = [4, 3], [2, 5]
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 3, 3, padding=1).double()
        g = torch.randn(1, 2, 7, 7, dtype=torch.float64)
        x = g.clone().requires_grad_()
        with shardlab.patched():
            st = distribute(x, mesh, [Shard(2), Shard(3)], sizes=[h_sizes, w_sizes])
            with shardlab.trace(mesh=mesh) as t:
                y = conv(st)
        ok = torch.allclose(y.full_tensor(), conv(g), atol=1e-12)
        ph, pw = conv_plan(h_sizes, 3, 1, 1, (1, 1)), conv_plan(w_sizes, 3, 1, 1, (1, 1))
        a, b = ph.window(i)
        row = 1 * 2 * 8
        want = ph.rows_received(i) * w_sizes[j] * row + pw.rows_received(j) * (b - a) * row
        got = t.bytes(kind="recv")
        corners = {e.peer for e in t.filter(kind="recv").events}
        return ok, got == want, got, want, sorted(corners)

    for ok, exact, got, want, _ in ranks_for(4).run(body):
        assert ok and exact, (got, want)


def test_unbatched_input_as_torch_takes_it(ranks_for):
    """An unbatched (C, *spatial) input cut along a spatial dim: torch's values and input
    gradient (a batch of one inside); cut along its channels with groups > 1: shardlab's
    own error (groups 1: tests/ops/test_doors.py); a
    wrong number of dims: torch's error type. The same on every rank."""

    def body():
        F = torch.nn.functional
        mesh = this_rank().mesh
        g = torch.Generator().manual_seed(2)
        out = []
        calls = [
            ("conv1d", (3, 11), (4, 3, 3), 1, [6, 5], {"padding": 1}),
            ("conv2d", (3, 7, 6), (2, 3, 3, 3), 1, [2, 5], {"stride": 2}),
            ("conv_transpose2d", (3, 5, 6), (3, 2, 2, 2), 2, [6, 0], {"stride": 2}),
        ]
        for name, shape, wshape, dim, sizes, kw in calls:
            x0 = torch.randn(shape, generator=g, dtype=torch.float64)
            w = torch.randn(wshape, generator=g, dtype=torch.float64)
            ref = x0.clone().requires_grad_()
            want = getattr(F, name)(ref, w, **kw)
            gy = torch.randn(want.shape, generator=g, dtype=torch.float64)
            want.backward(gy)
            xs = distribute(x0, mesh, [Shard(dim)], sizes).requires_grad_()
            with shardlab.patched():
                y = getattr(F, name)(xs, w, **kw)  # patched: looked up inside
                y.backward(distribute(gy, mesh, [Shard(dim)], [list(y.sharding.sizes_along(dim))]))
            out.append(
                torch.allclose(y.full_tensor(), want)
                and torch.allclose(xs.grad.full_tensor(), ref.grad)
                and y.placements == (Shard(dim),)
            )
        with shardlab.patched():
            for x, err in (
                (distribute(torch.randn(4, 9), mesh, [Shard(0)]), NotImplementedError),
                (distribute(torch.randn(9), mesh, [Shard(0)]), RuntimeError),
            ):
                try:  # channels cut with groups > 1: shardlab's own error
                    F.conv1d(x, torch.randn(2, 2, 3), groups=2)
                    out.append("no error")
                except err as exc:
                    out.append(str(exc).split(":")[0])
        return out

    results = ranks_for(2).run(body)
    assert results[0] == results[1] == [True, True, True, "conv1d", "conv1d"], results


def test_every_door_to_a_convolution_or_a_pooling_sends_halos(ranks_for):
    """``torch.conv2d`` (the same function as ``F.conv2d``), an F function called without
    ``patched()`` (a library that bound it at its import) and the pooling functions reach
    the halo exchange, never a whole-tensor gather; values and gradients as one device."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(2, 3, 11, 8, dtype=torch.float64)
        w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
        calls = {
            "torch.conv2d": lambda t: torch.conv2d(t, w, None, 1, 1),
            "F.conv2d": lambda t: F.conv2d(t, w, padding=1, stride=2),
            "F.conv_transpose2d": lambda t: F.conv_transpose2d(t, w.transpose(0, 1)),
            "F.max_pool2d": lambda t: F.max_pool2d(t, 3, 2, 1),
            "F.avg_pool2d": lambda t: F.avg_pool2d(t, 2),
            "F.adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, (4, 3)),
        }
        out = {}
        for name, call in calls.items():
            x = shardlab.distribute(g, mesh, [Shard(2)], [[6, 5]]).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = call(x)
                y.sum().backward()
            call(ref).sum().backward()
            labels = {e.label for e in t.events}
            out[name] = (
                torch.allclose(y.full_tensor(), call(g)),
                torch.allclose(x.grad.full_tensor(), ref.grad),
                not any(lab.startswith(("whole-tensor", "auto-redistribute")) for lab in labels),
            )
            if name == "torch.conv2d":
                out["halos"] = (any("halo" in lab for lab in labels),)
        return out

    for out in ranks_for(2).run(body):
        assert all(all(v) for v in out.values()), {k: v for k, v in out.items() if not all(v)}
