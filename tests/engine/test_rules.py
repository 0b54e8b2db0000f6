"""Rules only decide (``shardlab/engine/rule.py``): called on ShardTensors of a 4-rank
world that exists in this process only (torch's fake process group: no rank, no message),
a rule returns a plan without sending anything, the same plan every time, and the plan's
results have the global shapes torch's own meta kernel gives."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

aten = torch.ops.aten


@pytest.fixture(scope="module")
def meshes():
    """A 1-D mesh of 4 and a 2-D mesh (2, 2) over a fake world (this process is rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    finally:
        dist.destroy_process_group()


class Sent(Exception):
    """A rule moved data: it is an algorithm of several steps, not a plan."""


@pytest.fixture
def no_messages(monkeypatch):
    """Any move stops the rule (:class:`Sent`): a rule that returns a plan never moves."""
    from shardlab.comm import p2p

    def refuse(*args, **kwargs):
        raise Sent

    monkeypatch.setattr(p2p, "redistribute_local", refuse)


def _shard(shape, mesh, placements, sizes=None, dtype=torch.float64):
    """A ShardTensor of ``shape`` on ``mesh`` (rank 0's block: zeros)."""
    from shardlab.layout import ShardLayout
    from shardlab.tensor.api import ShardTensor

    layout = ShardLayout.build(tuple(shape), tuple(mesh.shape), placements, sizes)
    coord = tuple(0 for _ in mesh.shape)
    return ShardTensor._wrap(torch.zeros(layout.local_shape(coord), dtype=dtype), mesh, layout)


def _uneven(n, parts, rng):
    """``parts`` sizes summing to ``n``, some empty."""
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


def _meta(x):
    if hasattr(x, "_layout"):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


def _rule(func):
    from shardlab.engine.aten.pointwise import is_pointwise, pointwise
    from shardlab.engine.registry import rule_for

    rule = rule_for(func)
    if rule is None and is_pointwise(func):
        return pointwise
    return rule


def _cases(mesh, rng):
    """(op, args) on random layouts: element-wise with broadcasting and plain tensors,
    reductions over cut and uncut dims (Partial inputs too), products, views, slices,
    couplings along a dim, cat, embedding."""
    n = mesh.ndim
    r, c = rng.randint(4, 9), rng.randint(2, 6)
    sr, sc = _uneven(r, mesh.shape[0], rng), _uneven(c, mesh.shape[-1], rng)
    if n == 1:  # rows cut in uneven pieces
        grid, grid_t, first = ([Shard(0)], [sr]), ([Shard(1)], [sr]), ([Shard(0)], [sr])
    else:  # rows by mesh dim 0, columns by mesh dim 1
        grid = ([Shard(0), Shard(1)], [sr, sc])
        grid_t = ([Shard(1), Shard(0)], [sr, sc])
        first = ([Shard(0), Replicate()], [sr, None])
    rows = _shard((r, c), mesh, *grid)
    cols = _shard((r, c), mesh, [Replicate()] * (n - 1) + [Shard(1)], None)
    summed = _shard((r, c), mesh, [Partial()] + [Replicate()] * (n - 1))
    ids = _shard((r,), mesh, *first, dtype=torch.int64)
    mask = _shard((r, c), mesh, *grid, dtype=torch.bool)
    rows_t = _shard((c, r), mesh, *grid_t)  # (C, R): cut as rows is, transposed
    column = _shard((r, 1), mesh, *first)
    return [
        (aten.add.Tensor, (rows, torch.ones(c, dtype=torch.float64))),
        (aten.mul.Tensor, (rows, cols)),
        (aten.mul.Tensor, (summed, 2.0)),
        (aten.where.self, (mask, rows, cols)),
        (aten.sum.dim_IntList, (rows, [0])),
        (aten.sum.dim_IntList, (rows, [1], True)),
        (aten.sum.dim_IntList, (summed, [1])),
        (aten.amax.default, (rows, [0])),
        (aten.amin.default, (cols, [1], True)),
        (aten.mm.default, (rows, torch.ones(c, 3, dtype=torch.float64))),
        (aten.mm.default, (rows_t, rows)),  # the contracted dim cut alike
        (aten.view.default, (rows, [r * c])),
        (aten.view.default, (cols, [r, c, 1])),
        (aten.slice.Tensor, (rows, 0, 1, r - 1)),
        (aten.permute.default, (rows, [1, 0])),
        (aten.expand.default, (column, [r, c])),
        (aten._softmax.default, (rows, 1, False)),
        (aten.sort.default, (rows, 0)),
        (aten.cat.default, ([rows, rows], 1)),
        (aten.embedding.default, (cols, ids)),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_rules_decide_a_plan_without_a_message_the_same_each_time(meshes, no_messages, seed):
    from shardlab.engine.rule import BLOCKS, Plan
    from shardlab.layout import ShardLayout

    rng = random.Random(seed)
    mesh = meshes[seed % 2]
    planned = 0
    for func, args in _cases(mesh, rng):
        rule = _rule(func)
        assert rule is not None, func
        try:
            plan = rule(func, args, {})
        except Sent:
            continue  # an algorithm of several steps (cat along a cut dim): not a plan
        if not isinstance(plan, Plan):
            continue  # NotImplemented (the next stage), or an algorithm's result
        planned += 1
        again = rule(func, args, {})
        assert repr(again) == repr(plan), func  # a pure function of the layouts
        want = func(*_meta(args))  # torch's own result shapes, on one device
        wants = want if isinstance(want, (tuple, list)) else (want,)
        outs = plan.layouts if plan.many else (plan.layouts,)
        assert [o.global_shape for o in outs] == [tuple(w.shape) for w in wants], func
        values = list(args)
        assert plan.moves is None or len(plan.moves) == len(values), func
        for a, m in zip(values, plan.moves or ()):
            steps = [m] if isinstance(m, ShardLayout) else m if type(m) is tuple else []
            for s in steps:
                layout = s if isinstance(s, ShardLayout) else s[0]
                assert layout.global_shape == tuple(a.shape), (func, layout)
            assert m is None or m is BLOCKS or steps, (func, m)
    assert planned >= 12


def test_a_sum_over_a_cut_dim_plans_a_partial_and_sends_nothing(meshes, no_messages):
    """The layout arithmetic of a rule, without a process: x (10, 6) rows cut [4, 3, 2, 1],
    summed over its rows, gives ``Partial(sum)``; summed over its columns, rows cut alike."""
    from shardlab.engine.aten.reductions import _sum

    x = _shard((10, 6), meshes[0], [Shard(0)], [[4, 3, 2, 1]])
    over_rows = _sum(aten.sum.dim_IntList, (x, [0]), {})
    over_cols = _sum(aten.sum.dim_IntList, (x, [1]), {})
    assert over_rows.moves is None and over_rows.layouts.placements == (Partial(),)
    assert over_cols.layouts.placements == (Shard(0),)
    assert over_cols.layouts.sizes == ((4, 3, 2, 1),) or over_cols.layouts.sizes[0] == (
        (4, 3, 2, 1),
    )


def test_a_partial_input_plans_its_reduction_as_a_move(meshes, no_messages):
    """``max`` of a ``Partial(sum)`` tensor: the plan sums it first (a move to Replicate,
    run by the dispatcher), then takes each block's maximum."""
    from shardlab.engine.aten.reductions import _extreme

    x = _shard((5, 3), meshes[0], [Partial()])
    plan = _extreme(aten.amax.default, (x, [1]), {})
    assert plan.moves[0].placements == (Replicate(),)
    assert plan.layouts.placements == (Replicate(),)
