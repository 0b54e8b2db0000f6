"""Sharded F.pad against single-device torch: every mode, positive and negative pads."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from tests.tensor._cases import sizes_for

MODES = ["constant", "reflect", "replicate", "circular"]


def _random_call(rng):
    """``(shape, pad, kw)``: 1-3 padded dims; each side -3..3 (negative: a crop)."""
    n = rng.choice([1, 2, 2, 3])
    mode = rng.choice(MODES)
    shape = [rng.randint(1, 3), rng.randint(1, 4), *[rng.randint(1, 9) for _ in range(n)]]
    pad = [rng.randint(-3, 3) for _ in range(2 * rng.randint(1, n))]
    kw = {"mode": mode}
    if mode == "constant" and rng.random() < 0.5:
        kw["value"] = rng.choice([1.5, -2.0, 0.0, 3])
    return shape, pad, kw


def _wraps_past_the_crop(shape, pad, mode) -> bool:
    """A circular pad wider than what is left after the crop: torch 2.13 returns
    uninitialised memory there (shardlab raises on a sharded dim; see test_errors)."""
    for j in range(len(pad) // 2):
        left, right = pad[2 * j], pad[2 * j + 1]
        kept = shape[len(shape) - 1 - j] - max(-left, 0) - max(-right, 0)
        if mode == "circular" and min(left, right) < 0 and max(left, right) > kept:
            return True
    return False


def _sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done, crops = 0, 0
        while done < cases:
            shape, pad, kw = _random_call(rng)
            torch.manual_seed(done)
            g = torch.randn(shape, dtype=torch.float64)
            xr = g.clone().requires_grad_()
            if _wraps_past_the_crop(shape, pad, kw["mode"]):
                continue
            try:
                ref = F.pad(xr, pad, **kw)
            except (RuntimeError, NotImplementedError):
                continue  # torch refuses it (reflect wider than the dim, ...)
            w_out = torch.randn(ref.shape, dtype=torch.float64)
            (ref * w_out).sum().backward()
            padded = list(range(len(shape) - len(pad) // 2, len(shape)))
            # mostly padded dims; at times the batch or channels (cut as they are: no message)
            pool = padded if rng.random() < 0.75 else list(range(len(shape)))
            dims = rng.sample(pool, min(len(mesh_shape), len(pool)))
            if len(mesh_shape) == 2 and rng.random() < 0.3:  # one dim cut by both mesh dims
                dims = [dims[0], dims[0]]
            placements = [Shard(d) for d in dims] + [Replicate()] * (len(mesh_shape) - len(dims))
            sizes = sizes_for(rng, shape, mesh_shape, placements)
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, placements, sizes=sizes)
                with shardlab.trace() as t:
                    y = F.pad(st, pad, **kw)
            out = y.full_tensor()
            cfg = (shape, pad, kw, placements, sizes)
            assert out.shape == ref.shape and torch.equal(out, ref.detach()), cfg
            (out * w_out).sum().backward()
            # an empty result's gradient is zeros (torch 2.13's reflect backward leaves it
            # uninitialised there)
            ref_grad = xr.grad if ref.numel() else torch.zeros_like(g)
            assert torch.allclose(x.grad, ref_grad, atol=1e-12), cfg
            assert set(t.counts()) <= {"send", "recv"}, (cfg, t.counts())
            gathered = len(dims) == 2 and dims[0] == dims[1] and dims[0] in padded
            if not gathered:  # only the rows a pad copies travel (none for a constant pad)
                assert all(e.label.startswith("pad.halo") for e in t.events), cfg
                if kw["mode"] == "constant":
                    assert len(t.events) == 0, (cfg, t.counts())
            crops += any(p < 0 for p in pad)
            done += 1
        return done, crops

    return body


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.more_worlds), 4])
def test_pad_sweep_1d_mesh(ranks_for, world):
    done, crops = ranks_for(world).run(_sweep((world,), 40, seed=world))[0]
    assert done == 40 and crops > 10


def test_pad_sweep_2d_mesh(ranks_for):
    done, crops = ranks_for(4).run(_sweep((2, 2), 30, seed=11))[0]
    assert done == 30 and crops > 5


def test_crop_sends_nothing_and_pad_sends_the_wrapped_rows(ranks_for):
    """Sizes [3, 2, 3] of 8 rows (3 floats each): cropping (-2, -1) drops rows where they
    live (sizes [1, 2, 2], no message); circular (2, 1) sends rank 0 the last two rows
    and rank 2 the first one (3 rows in all), constant (2, 1) sends nothing; circular
    (-2, 1) crops, then wraps the first row kept (one row)."""

    def body():
        mesh = this_rank().mesh
        g = torch.arange(24, dtype=torch.float64).view(1, 8, 3)
        out = []
        with shardlab.patched():
            st = distribute(g, mesh, [Shard(1)], sizes=[3, 2, 3])
            for pad, mode in [((0, 0, -2, -1), "constant"), ((0, 0, 2, 1), "circular"),
                              ((0, 0, 2, 1), "constant"), ((0, 0, -2, 1), "circular")]:  # fmt: skip
                with shardlab.trace() as t:
                    y = F.pad(st, pad, mode=mode)
                assert torch.equal(y.full_tensor(), F.pad(g, pad, mode=mode)), (pad, mode)
                out.append((list(y.sharding.sizes_along(1)), t.bytes(kind="recv") // (3 * 8)))
        return out

    got = ranks_for(3).run(body)
    sizes = [r[i][0] for r in got for i in range(4)][:4]
    assert sizes == [[1, 2, 2], [5, 2, 4], [5, 2, 4], [1, 2, 4]]
    assert [sum(r[i][1] for r in got) for i in range(4)] == [0, 3, 0, 1]


def test_errors_on_every_rank(ranks_for):
    """torch's own error, type and words (the global shape decides), on every rank."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(1, 2, 6)
        out = []
        with shardlab.patched():
            x = distribute(g, mesh, [Shard(2)], sizes=[4, 2])
            for pad, mode in [((-7, 0), "constant"), ((6, 0), "reflect"), ((1,), "constant"),
                              ((1, 1), "wrap"), ((1,) * 8, "constant"), ((1,) * 6, "reflect"),
                              ((3, -4), "circular")]:  # fmt: skip
                got = want = None
                try:
                    F.pad(x, pad, mode=mode)
                except Exception as exc:  # noqa: BLE001 (compared with torch's below)
                    got = (type(exc).__name__, str(exc)[:60])  # (meta says torch.Size(...))
                try:
                    F.pad(g, pad, mode=mode)
                except Exception as exc:  # noqa: BLE001
                    want = (type(exc).__name__, str(exc)[:60])
                out.append((got, want))
        return out

    for rank in ranks_for(2).run(body):
        for got, want in rank[:-1]:
            assert got == want and got is not None
        # torch returns uninitialised memory for a circular pad of 3 rows wrapping the 2
        # rows left after the crop; shardlab raises torch's error for that pad
        assert rank[-1][1] is None and rank[-1][0][0] == "RuntimeError"


def test_integer_tensors_and_fills_beyond_float_precision(ranks_for):
    """An int64 tensor padded with a fill a float cannot hold (2**60 + 1: torch reads the
    fill as a float, so 2**60), replicate and crops on a cut dim: torch's values, dtype."""

    def body():
        mesh = this_rank().mesh
        g = torch.arange(2 * 9 * 3, dtype=torch.int64).view(2, 9, 3) * 3
        st = distribute(g, mesh, [Shard(1)], [[4, 0, 5]])
        out = []
        with shardlab.patched():
            for pad, kw in [((0, 0, 2, 3), {"value": 2**60 + 1}), ((0, 0, -3, 2), {}),
                            ((1, 1, 3, -2), {"mode": "replicate"})]:  # fmt: skip
                y = F.pad(st, pad, **kw).full_tensor()
                want = F.pad(g, pad, **kw)
                out.append(y.dtype == want.dtype and torch.equal(y, want))
        return out

    assert ranks_for(3).run(body) == [[True] * 3] * 3
