"""An aten op with no rule on tensors every rank holds whole (``shardlab/engine/whole.py``):
torch's op on the blocks, single-device values and gradients, no message, the decision kept;
the result keeps the dims its argument cut; cut tensors still take the usual path."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute
from shardlab.engine import whole
from shardlab.layout import ShardLayout

aten = torch.ops.aten


# -- pure: which ops, which layout -----------------------------------------------------
@pytest.mark.parametrize(
    "op, eligible",
    [
        (aten.addmm.default, True),
        (aten.native_batch_norm.default, True),
        (aten.var_mean.correction, True),
        (aten.add_.Tensor, False),  # writes its argument
        (aten.native_batch_norm_backward.default, True),
        (aten.bernoulli.default, False),  # random
        (aten.native_dropout.default, False),
        (aten.transpose.int, False),  # a view
        (aten.alias.default, False),
    ],
)
def test_which_ops_run_on_whole_blocks(op, eligible):
    assert whole._eligible(op) is eligible


def test_the_result_keeps_the_cut_dims_of_an_argument_like_it():
    rows = ShardLayout.build((6, 6), (1,), [Shard(0)])
    weight = ShardLayout.build((6, 8), (1,), [Replicate()])
    out = whole._layout([weight, rows], (6, 8))  # addmm(bias, x, w.t()): x's rows
    assert out.placements == (Shard(0),) and out.global_shape == (6, 8)
    assert out.sizes_along(0) == (6,)
    # other dims: the placements made whole; no argument with as many dims: Replicate
    cols = ShardLayout.build((4, 5), (1, 1), [Shard(1), Replicate()])
    assert whole._layout([cols], (4, 7)).placements == (Shard(1), Replicate())
    assert whole._layout([cols], (4, 7)).sizes_along(1) == (7,)
    assert whole._layout([cols], (3,)).placements == (Replicate(), Replicate())


# -- on the ranks ---------------------------------------------------------------------------
def _batch_norm_body(mesh_shape, places):
    def body():
        from shardlab import this_rank
        from shardlab.engine import dispatch

        mesh = this_rank().mesh_for(mesh_shape)
        gen = torch.Generator().manual_seed(0)
        g = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=gen)
        w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (g, w, b))
        torch.batch_norm(x_ref, w_ref, b_ref, None, None, True, 0.1, 1e-5, False).sum().backward()

        decided = []
        full = dispatch._decide

        def counting(key, func, args, kwargs):
            decided.append(str(func))
            return full(key, func, args, kwargs)

        dispatch._decide = counting
        try:
            runs = []
            for _ in range(3):  # not patched: torch.batch_norm is aten's
                x, wp, bp = (t.clone().requires_grad_() for t in (g, w, b))
                with shardlab.trace() as t:
                    y = torch.batch_norm(distribute(x, mesh, places), wp, bp, None, None, True,
                                         0.1, 1e-5, False)  # fmt: skip
                    y.sum().backward()
                runs.append((y, x.grad, wp.grad, bp.grad, len(t.events), decided[:]))
                decided.clear()
        finally:
            dispatch._decide = full
        y, gx, gw, gb, events, _ = runs[-1]
        return {
            "values": torch.allclose(
                y.full_tensor(),
                torch.batch_norm(g, w, b, None, None, True, 0.1, 1e-5, False),
                rtol=1e-12,
                atol=1e-12,
            ),
            "grads": all(
                torch.allclose(a, r, rtol=1e-12, atol=1e-12)
                for a, r in ((gx, x_ref.grad), (gw, w_ref.grad), (gb, b_ref.grad))
            ),
            "placements": y.placements,
            "messages": [r[4] for r in runs],
            "first": runs[0][5],
            "later": [r[5] for r in runs[1:]],
        }

    return body


@pytest.mark.parametrize(
    "world, mesh_shape, places",
    [(1, (1,), [Shard(2)]), (2, (2, 1), [Replicate(), Shard(3)])],
)
def test_batch_norm_on_whole_blocks_is_one_kept_local_call(ranks_for, world, mesh_shape, places):
    """``torch.batch_norm`` has no aten rule: torch decomposed it (``var_mean``,
    ``broadcast_in_dim`` …) and decided it in full at every call (~700 µs on one rank).
    On whole blocks it is torch's kernel, decided once: later calls decide nothing."""
    for res in ranks_for(world).run(_batch_norm_body(mesh_shape, places)):
        assert res["values"] and res["grads"], res
        assert res["placements"] == tuple(places), res
        assert res["messages"] == [0, 0, 0], res
        assert "aten.native_batch_norm.default" in res["first"], res
        assert "aten.var_mean.correction" not in res["first"], res  # not decomposed
        assert res["later"] == [[], []], res


def test_cut_tensors_still_take_the_usual_path(ranks_for):
    """The same call with H cut over 2 ranks: torch's decomposition and the rules (a
    global mean and variance: collectives), equal to one device."""

    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh
        g = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        want = torch.batch_norm(g, w, b, None, None, True, 0.1, 1e-5, False)
        with shardlab.trace() as t:
            y = torch.batch_norm(distribute(g, mesh, [Shard(2)], [3, 2]), w, b, None, None,
                                 True, 0.1, 1e-5, False)  # fmt: skip
        return torch.allclose(y.full_tensor(), want, rtol=1e-12, atol=1e-12), len(t.events) > 0

    assert ranks_for(2).run(body) == [(True, True)] * 2


def _unpatched_cnn_body(mesh_shape, places):
    def body():
        from shardlab import this_rank
        from shardlab.engine import dispatch

        mesh = this_rank().mesh_for(mesh_shape)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(4, 2, 3), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(2, 3),
        ).double()  # fmt: skip
        g = torch.randn(2, 3, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x_ref = g.clone().requires_grad_()
        model(x_ref).square().sum().backward()
        want = [p.grad.clone() for p in model.parameters()]
        decided, full = [], dispatch._decide

        def counting(key, func, args, kwargs):
            decided.append(str(func))
            return full(key, func, args, kwargs)

        dispatch._decide = counting
        runs = []
        try:
            for _ in range(3):  # not patched: every op is aten's
                model.zero_grad()
                decided.clear()
                x = g.clone().requires_grad_()
                with shardlab.trace() as t:
                    model(distribute(x, mesh, places)).square().sum().backward()
                got = [x.grad, *(p.grad for p in model.parameters())]
                exact = all(
                    torch.allclose(a, b, rtol=1e-12, atol=1e-12)
                    for a, b in zip(got, [x_ref.grad, *want])
                )
                runs.append((exact, len(t.events), len(decided)))
        finally:
            dispatch._decide = full
        return runs

    return body


@pytest.mark.parametrize(
    "world, mesh_shape, places",
    [(1, (1,), [Shard(2)]), (2, (2, 1), [Replicate(), Shard(3)])],
)
def test_an_unpatched_conv_stack_on_whole_blocks(ranks_for, world, mesh_shape, places):
    """nn.Conv2d, BatchNorm2d, ReLU, MaxPool2d, AdaptiveAvgPool2d, Linear without
    ``shardlab.patched()``: every op is aten's. Equal to torch forward and backward, no
    message, and from the second step on nothing is decided in full."""
    for runs in ranks_for(world).run(_unpatched_cnn_body(mesh_shape, places)):
        assert [r[0] for r in runs] == [True] * 3, runs
        assert [r[1] for r in runs] == [0, 0, 0], runs
        assert runs[0][2] > 0 and [r[2] for r in runs[1:]] == [0, 0], runs
