"""Sharded F.interpolate against single-device torch: every mode, sizes and scales."""

import random

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from tests.tensor._cases import random_sizes

MODES = {1: ["nearest", "nearest-exact", "linear", "area"],
         2: ["nearest", "nearest-exact", "bilinear", "bicubic", "area"],
         3: ["nearest", "trilinear", "nearest-exact"]}  # fmt: skip


def _random_call(rng):
    n = rng.choice([1, 2, 2, 2, 3])
    mode = rng.choice(MODES[n])
    kw = {"mode": mode}
    if mode in ("linear", "bilinear", "bicubic", "trilinear"):
        kw["align_corners"] = rng.random() < 0.5
    if rng.random() < 0.5:
        kw["size"] = [rng.randint(1, 14) for _ in range(n)]
    else:
        choices = [0.5, 0.7, 1.0, 1.3, 1.5, 2.0, 2.5, 3.0, 1 / 3]
        kw["scale_factor"] = rng.choice(
            [rng.choice(choices), [rng.choice(choices) for _ in range(n)]]
        )
        kw["recompute_scale_factor"] = rng.choice([None, True, False])
    return n, kw


def _sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done, modes = 0, set()
        while done < cases:
            n, kw = _random_call(rng)
            shape = [rng.randint(1, 2), 2, *[rng.randint(1, 8) for _ in range(n)]]
            torch.manual_seed(done)
            g = torch.randn(shape, dtype=torch.float64)
            xr = g.clone().requires_grad_()
            try:
                ref = F.interpolate(xr, **kw)
            except (RuntimeError, ValueError):
                continue
            w_out = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w_out).sum().backward()
            ref_grad = xr.grad
            if not torch.allclose((ref * w_out).sum(), (g * ref_grad).sum()):
                # torch 2.13's nearest 1d/3d backward is not the adjoint of its forward when
                # an output dim has the input's size and scale != 1: use forward-mode AD
                jac = torch.func.jacfwd(lambda t, kw=kw: F.interpolate(t, **kw))(g)  # (*out, *in)
                ref_grad = (jac * w_out.view(*w_out.shape, *[1] * g.ndim)).sum(
                    tuple(range(w_out.ndim))
                )
            dims = rng.sample(range(2, 2 + n), min(len(mesh_shape), n))
            if rng.random() < 0.15:  # sometimes the batch (often with an empty shard)
                dims = [0] + dims[: len(mesh_shape) - 1]
            placements = [Shard(d) for d in dims] + [Replicate()] * (len(mesh_shape) - len(dims))
            sizes = [
                random_sizes(rng, shape[p.dim], mesh_shape[m]) if isinstance(p, Shard) else None
                for m, p in enumerate(placements)
            ]
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, placements, sizes=sizes)
                with shardlab.trace() as t:
                    y = F.interpolate(st, **kw)
            out = y.full_tensor()
            cfg = (kw, shape, placements, sizes)
            assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-12), cfg
            (out * w_out).sum().backward()
            assert torch.allclose(x.grad, ref_grad, atol=1e-12), cfg
            assert set(t.counts()) <= {"send", "recv"}, (cfg, t.counts())
            modes.add(kw["mode"])
            done += 1
        return done, len(modes)

    return body


def test_interpolate_sweep_1d_mesh(ranks_for):
    got = ranks_for(3).run(_sweep((3,), 50, seed=6))
    assert got[0][0] == 50 and got[0][1] == 7


def test_interpolate_sweep_2d_mesh(ranks_for):
    got = ranks_for(4).run(_sweep((2, 2), 25, seed=9))
    assert got[0][0] == 25


def test_x2_doubles_shards_and_exact_rows(ranks_for):
    """x2 upsampling doubles every shard (nearest: no message at all); bilinear receives
    exactly one row from each neighbour whose row its edge outputs read."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(1, 2, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        out = []
        with shardlab.patched():
            st = distribute(g, mesh, [Shard(2)], sizes=[3, 1, 0, 3])
            for mode in ("nearest", "bilinear"):
                with shardlab.trace() as t:
                    y = F.interpolate(st, scale_factor=2, mode=mode)
                ok = torch.allclose(y.full_tensor(), F.interpolate(g, scale_factor=2, mode=mode))
                out.append(
                    (ok, list(y.sharding.sizes_along(2)), t.bytes(kind="recv") // (2 * 3 * 8))
                )
        return out

    got = ranks_for(4).run(body)
    for r, rank in enumerate(got):
        (ok_n, sizes_n, rows_n), (ok_b, sizes_b, rows_b) = rank
        assert ok_n and ok_b and sizes_n == sizes_b == [6, 2, 0, 6]
        assert rows_n == 0
        assert rows_b == [1, 2, 0, 1][r]  # rows 3 | 2 and 4 | - | 3


def test_errors_on_every_rank(ranks_for):
    def body():
        mesh = this_rank().mesh
        errors = []
        with shardlab.patched():
            x = distribute(torch.randn(1, 2, 6, 5), mesh, [Shard(2)], sizes=[4, 2])
            u8 = distribute(torch.zeros(1, 2, 6, 5, dtype=torch.uint8), mesh, [Shard(2)], [4, 2])
            f16 = distribute(torch.zeros(1, 2, 6, 5, dtype=torch.float16), mesh, [Shard(2)], [6, 0])
            calls = (
                lambda: F.interpolate(u8, scale_factor=0.5, mode="bilinear", antialias=True),
                lambda: F.interpolate(f16, scale_factor=0.5, mode="bicubic", antialias=True),
                lambda: F.interpolate(x, scale_factor=2, mode="nearest", align_corners=True),
                lambda: F.interpolate(x, size=4, scale_factor=2),
                lambda: F.interpolate(x, scale_factor=2, mode="linear"),  # 4-D input
            )
            for call in calls:
                try:
                    call()
                except (NotImplementedError, ValueError) as exc:
                    errors.append(type(exc).__name__)
            b = distribute(torch.randn(2, 2, 6, 5), mesh, [Shard(0)])  # batch: local
            y = F.interpolate(b, scale_factor=0.5, mode="bilinear", antialias=True)
            ok = torch.allclose(y.full_tensor(), F.interpolate(
                b.full_tensor(), scale_factor=0.5, mode="bilinear", antialias=True))  # fmt: skip
        return errors, ok

    for errors, ok in ranks_for(2).run(body):
        assert ok and errors == [
            "NotImplementedError",
            "NotImplementedError",
            "ValueError",
            "ValueError",
            "NotImplementedError",
        ]


def _aa_reference(g, kw):
    """torch's antialiased resize of ``g`` (leaf) and what its backward should give.

    Two torch 2.13 faults are stepped around, each with torch itself: where the output is
    1 wide and H changes, torch's kernel repeats the first output row (torch's two passes
    are run apart instead, W then H, H on the column copied 2 wide); where a dim keeps
    its size but its scale is not 1, torch's backward is not the adjoint of its forward
    (the gradient is forward-mode AD's)."""
    kernel = getattr(torch._C._nn, f"_upsample_{kw['mode']}2d_aa")
    ref = F.interpolate(g, **kw)
    if ref.shape[3] == 1 and ref.shape[2] != g.shape[2]:
        sf = kw.get("scale_factor")
        sf = None if sf is None or kw.get("recompute_scale_factor") else sf
        scale_h, scale_w = sf if isinstance(sf, (list, tuple)) else (sf, sf)
        ac, h = kw["align_corners"], g.shape[2]
        col = g if g.shape[3] == 1 else kernel(g, [h, 1], ac, None, scale_w)  # (N, C, H, 1)
        ref = kernel(torch.cat([col, col], 3), [ref.shape[2], 2], ac, scale_h, None)[..., :1]
    return ref


def _aa_sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done, seen = 0, set()
        while done < cases:
            kw = {"mode": rng.choice(["bilinear", "bicubic"]), "antialias": True,
                  "align_corners": rng.random() < 0.3}  # fmt: skip
            if rng.random() < 0.5:
                kw["size"] = [rng.randint(1, 12), rng.randint(1, 12)]
            else:
                kw["scale_factor"] = rng.choice([0.3, 0.5, 0.7, 1.01, 1.5, 2.0, (0.4, 1.3)])
                kw["recompute_scale_factor"] = rng.choice([None, True, False])
            dtype = rng.choice([torch.float64, torch.float64, torch.float32])
            shape = [rng.randint(1, 2), 2, rng.randint(1, 20), rng.randint(1, 20)]
            g = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(done))
            xr = g.clone().requires_grad_()
            try:
                ref = _aa_reference(xr, kw)
            except (RuntimeError, ValueError):
                continue
            w_out = torch.randn(ref.shape, dtype=dtype)
            jac = torch.func.jacfwd(lambda t, kw=kw: _aa_reference(t, kw))(g)  # (*out, *in)
            ref_grad = (jac * w_out.view(*w_out.shape, 1, 1, 1, 1)).sum((0, 1, 2, 3))
            dims = rng.sample([2, 3], len(mesh_shape))
            if len(mesh_shape) == 2 and rng.random() < 0.3:
                dims[rng.randrange(2)] = 0  # the batch and one spatial dim
            sizes = [random_sizes(rng, shape[d], mesh_shape[m]) for m, d in enumerate(dims)]
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, [Shard(d) for d in dims], sizes=sizes)
                if rng.random() < 0.2:  # a table first made under inference mode
                    with torch.inference_mode():
                        F.interpolate(distribute(g, mesh, [Shard(d) for d in dims], sizes), **kw)
                with shardlab.trace() as t:
                    y = F.interpolate(st, **kw)
            out = y.full_tensor()
            tol = 1e-12 if dtype == torch.float64 else 1e-5  # float32: torch's own rounding
            cfg = (kw, shape, dims, sizes, dtype)
            assert out.shape == ref.shape and torch.allclose(out, ref, atol=tol), cfg
            (out * w_out).sum().backward()
            assert torch.allclose(x.grad, ref_grad, atol=tol), cfg
            assert set(t.counts()) <= {"send", "recv"}, (cfg, t.counts())
            seen.add((kw["mode"], tuple(dims)))
            done += 1
        return done, len(seen)

    return body


def test_antialias_sweep_1d_mesh(ranks_for):
    """antialias=True (a window that grows as the image shrinks) with H or W cut unevenly
    over 3 ranks, empty shards among them: torch's values and gradients, halos only."""
    got = ranks_for(3).run(_aa_sweep((3,), 40, seed=3))
    assert got[0] == (40, 4)


def test_antialias_sweep_2d_mesh(ranks_for):
    got = ranks_for(4).run(_aa_sweep((2, 2), 16, seed=4))
    assert got[0][0] == 16


def test_antialias_rows_received(ranks_for):
    """A x1/2 bilinear antialiased resize of 12 rows cut [5, 3, 4]: output o reads input
    rows 2o-1 .. 2o+2 (row 0 .. 2 for o = 0) and is computed where its middle row lives
    (anchors 1 2 4 | 6 | 8 10: sizes [3, 1, 2]); each rank receives the rows its outputs
    read past its edge: 5 and 6 | 8 | 7, already 2 wide (W is resized first, as torch
    does: the halo rows are the narrower ones)."""

    def body():
        g = torch.randn(
            1, 1, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        )
        with shardlab.patched():
            st = distribute(g, this_rank().mesh, [Shard(2)], sizes=[5, 3, 4])
            with shardlab.trace() as t:
                y = F.interpolate(st, scale_factor=0.5, mode="bilinear", antialias=True)
        ref = F.interpolate(g, scale_factor=0.5, mode="bilinear", antialias=True)
        return (torch.allclose(y.full_tensor(), ref, atol=1e-12), y.sharding.sizes_along(2),
                t.bytes(kind="recv") // (2 * 8))  # fmt: skip

    got = ranks_for(3).run(body)
    assert [(ok, list(sizes)) for ok, sizes, _ in got] == [(True, [3, 1, 2])] * 3
    assert [rows for _, _, rows in got] == [2, 1, 1]
