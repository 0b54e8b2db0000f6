"""Torch's own F call when every rank holds the whole tensor (``shardlab/engine/whole.py``):
single-device values and gradients, torch's errors and autocast, no message, and the
sharded handler never called; other layouts still reach the handler."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.engine.whole import NAMES, out_layout
from shardlab.layout import ShardLayout


# -- the result's layout: a pure function --------------------------------------------
def test_the_result_keeps_the_input_dims_pieces_or_is_replicated():
    lay = ShardLayout.build((2, 3, 8, 8), (2, 1), [Replicate(), Shard(2)])
    out = out_layout(lay, (2, 5, 4, 4))
    assert out.placements == lay.placements and out.sizes_along(2) == (4,)
    assert out_layout(lay, ()).placements == (Replicate(), Replicate())
    rows = out_layout(ShardLayout.build((2, 5, 7), (1,), [Shard(2)]), (2, 7), "cross_entropy")
    assert rows.placements == (Shard(1),) and rows.global_shape == (2, 7)


# -- on the ranks --------------------------------------------------------------------------
def _calls(gen):
    """(name, plain args, kwargs, index of the argument to distribute, sharded dim)."""

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = r(2, 3, 7, 6)
    return [
        ("conv2d", (x, r(4, 3, 3, 3), r(4)), {"padding": 1}, 0, 2),
        ("conv1d", (r(3, 9), r(2, 3, 3)), {"stride": 2}, 0, 1),  # unbatched
        ("conv_transpose2d", (x, r(3, 2, 2, 2)), {"stride": 2}, 0, 3),
        ("max_pool2d", (x, 3, 2, 1), {"return_indices": True}, 0, 2),
        ("avg_pool2d", (x, 2), {"ceil_mode": True}, 0, 2),
        ("adaptive_avg_pool2d", (x, (1, 1)), {}, 0, 2),
        ("adaptive_max_pool1d", (r(2, 3, 9), 4), {}, 0, 2),
        ("pad", (x, (1, 2, 0, 1)), {"mode": "reflect"}, 0, 2),
        ("interpolate", (x,), {"scale_factor": 2, "mode": "bilinear"}, 0, 2),
        (
            "batch_norm",
            (x, torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype), r(3), r(3), True),
            {},
            0,
            2,
        ),  # fmt: skip
        ("group_norm", (r(2, 4, 5), 2, r(4), r(4)), {}, 0, 2),
        ("instance_norm", (x,), {}, 0, 3),
        (
            "scaled_dot_product_attention",
            (r(2, 4, 5, 3), r(2, 2, 5, 3), r(2, 2, 5, 3)),
            {"is_causal": True, "enable_gqa": True},
            0,
            2,
        ),  # fmt: skip
        (
            "cross_entropy",
            (r(2, 5, 7), torch.tensor([[1, -100, 3, 0, 4, 2, 1]] * 2)),
            {"reduction": "none"},
            0,
            2,
        ),  # fmt: skip
        ("cross_entropy", (r(6, 5), torch.tensor([1, -100, 3, 0, 4, 2])), {}, 0, 0),
    ]


def _body():
    from shardlab import this_rank
    from shardlab.trace import trace

    n = this_rank().world_size
    mesh = this_rank().mesh if n == 1 else this_rank().mesh_for((n, 1))
    gen = torch.Generator().manual_seed(5)
    out = []
    for name, args, kwargs, i, dim in _calls(gen):
        places = [Shard(dim)] if n == 1 else [Replicate(), Shard(dim)]
        stats = (1, 2) if name == "batch_norm" else ()  # running statistics: no gradient

        def _grad(j, a, stats=stats):
            return isinstance(a, torch.Tensor) and a.is_floating_point() and j not in stats

        ref = [_copy(a, _grad(j, a)) for j, a in enumerate(args)]
        want = getattr(F, name)(*ref, **kwargs)
        wants = want if isinstance(want, tuple) else (want,)
        seeds = [torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in wants[:1]]
        (wants[0] * seeds[0]).sum().backward()
        mine = [_copy(a, _grad(j, a)) for j, a in enumerate(args)]
        sharded = list(mine)
        sharded[i] = distribute(mine[i], mesh, places)
        with _counted(name) as called, shardlab.patched(), trace() as t:
            got = getattr(F, name)(*sharded, **kwargs)
            gots = got if isinstance(got, tuple) else (got,)
            (gots[0] * seeds[0]).sum().backward()
        same = all(torch.allclose(g.full_tensor(), w, atol=1e-12) for g, w in zip(gots, wants))
        grads = all(
            torch.allclose(m.grad, r.grad, atol=1e-12)
            for m, r in zip(mine, ref)
            if isinstance(r, torch.Tensor) and r.requires_grad
        )
        layouts = [g.placements for g in gots]
        if name == "batch_norm":  # torch's running statistics, updated in place
            same = same and all(torch.allclose(a, b) for a, b in zip(mine[1:3], ref[1:3]))
        out.append((name, same, grads, called, t.events, layouts, sharded[i].placements))
    return out


@contextlib.contextmanager
def _counted(name):
    """Inside: the calls of the sharded handler of ``F.<name>``, in a list."""
    from shardlab.ops import registry

    entry = registry.rule(name)
    called, handler = [], entry.handler
    entry.handler = lambda *a, **k: called.append(name) or handler(*a, **k)
    try:
        yield called
    finally:
        entry.handler = handler


def _copy(a, grad: bool):
    if not isinstance(a, torch.Tensor):
        return a
    return a.clone().requires_grad_() if grad else a.clone()


@pytest.mark.parametrize("world", [1, 2])
def test_whole_blocks_take_torchs_own_call(ranks_for, world):
    for res in ranks_for(world).run(_body):
        for name, same, grads, called, events, layouts, places in res:
            assert name in NAMES
            assert same and grads, (name, same, grads)
            assert called == [] and events == [], (name, called, events)
            if name != "cross_entropy":
                assert all(p == places for p in layouts), (name, layouts, places)


def _errors_and_autocast():
    from shardlab import this_rank

    n = this_rank().world_size
    mesh = this_rank().mesh_for((n, 1))
    x = torch.randn(2, 3, 8, 8)
    st = distribute(x, mesh, [Replicate(), Shard(2)])
    w = torch.randn(4, 3, 3, 3)
    with shardlab.patched():
        try:
            F.conv2d(st, torch.randn(4, 5, 3, 3))
            err = None
        except RuntimeError as e:
            err = str(e)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = F.conv2d(st, w, padding=1)
            want = F.conv2d(x, w, padding=1)
        # a dropout in attention follows shardlab's own masks: the sharded handler
        with _counted("scaled_dot_product_attention") as called:
            q = distribute(torch.randn(1, 2, 4, 3), mesh, [Replicate(), Shard(2)])
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    try:
        F.conv2d(x, torch.randn(4, 5, 3, 3))
    except RuntimeError as e:
        torch_err = str(e)
    return err == torch_err, got.dtype, torch.equal(got.full_tensor(), want), called


def test_torchs_errors_autocast_and_the_dropout_exception(ranks_for):
    for same_err, dtype, equal, called in ranks_for(2).run(_errors_and_autocast):
        assert (
            same_err
            and dtype == torch.bfloat16
            and equal
            and called == ["scaled_dot_product_attention"]
        )


def _still_sharded():

    mesh = this_rank().mesh
    x = distribute(torch.randn(2, 3, 8, 8), mesh, [Shard(2)], [[5, 3]])
    with _counted("conv2d") as called, shardlab.patched():
        y = F.conv2d(x, torch.randn(4, 3, 3, 3), padding=1)
    return called, y.placements, y.sharding.sizes_along(2)


def test_a_cut_across_ranks_still_reaches_the_sharded_handler(ranks_for):
    for called, places, sizes in ranks_for(2).run(_still_sharded):
        assert called == ["conv2d"] and places == (Shard(2),) and sizes == (5, 3)
