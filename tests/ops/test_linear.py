"""Sharded ``F.linear`` (``shardlab/ops/linear.py``) against single-device torch: forward,
the input, weight and bias gradients, the one all-reduce of the parameter
gradients, and the cases left to the aten rules."""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.layout import ShardLayout
from shardlab.ops.linear import out_layout, rows_only
from tests.tensor._cases import random_sizes


def test_rows_only_and_the_result_layout():
    rows = ShardLayout.build((2, 7, 5), (2,), [Shard(1)], [[4, 3]])
    assert rows_only(rows)
    out = out_layout(rows, 9)
    assert out.global_shape == (2, 7, 9) and out.sizes_along(1) == (4, 3)
    assert not rows_only(ShardLayout.build((2, 7, 5), (2,), [Shard(2)]))
    assert not rows_only(ShardLayout.build((2, 7, 5), (2,), [Partial()]))
    assert out_layout(ShardLayout.build((7, 5), (2, 2), [Shard(0), Replicate()]), 3).placements == (
        Shard(0),
        Replicate(),
    )


def _sweep(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        mesh = (
            this_rank().mesh
            if len(mesh_shape) == 1
            else this_rank().mesh_for(mesh_shape, names=("a", "b"))
        )
        rng = random.Random(seed)
        out = []
        for _ in range(cases):
            ndim = rng.randint(1, 4)
            shape = [rng.randint(1, 6) for _ in range(ndim - 1)] + [rng.randint(1, 5)]
            fout, bias = rng.randint(1, 6), rng.random() < 0.6
            places, sizes = [], []
            for n in mesh_shape:  # leading dims only, or Replicate
                dims = [
                    d for d in range(ndim - 1) if d not in [p.dim for p in places if p.is_shard()]
                ]
                if dims and rng.random() < 0.8:
                    d = rng.choice(dims)
                    places.append(Shard(d))
                    sizes.append(random_sizes(rng, shape[d], n))
                else:
                    places.append(Replicate())
                    sizes.append(None)
            g = torch.Generator().manual_seed(rng.randint(0, 10**6))
            x = torch.randn(shape, generator=g, dtype=torch.float64)
            lin = nn.Linear(shape[-1], fout, bias=bias).double()
            one = nn.Linear(shape[-1], fout, bias=bias).double()
            one.load_state_dict(lin.state_dict())
            gy = torch.randn([*shape[:-1], fout], generator=g, dtype=torch.float64)
            xr = x.clone().requires_grad_()
            want = one(xr)
            want.backward(gy)
            xs = distribute(x, mesh, places, sizes).requires_grad_()
            with shardlab.patched():
                with shardlab.trace() as fwd:
                    y = lin(xs)
                with shardlab.trace() as bwd:
                    y.backward(distribute(gy, mesh, places, sizes))
            cut = any(p.is_shard() and n > 1 for p, n in zip(places, mesh_shape))
            n_params = fout * shape[-1] + (fout if bias else 0)
            expected = [("params backward", "all_reduce", n_params * 8)] if cut else []
            # a 2-D mesh with both dims cutting: one all-reduce over the world's group
            labels = [(e.label, e.kind, e.bytes) for e in bwd.events]
            out.append(
                (
                    (shape, places, sizes, fout, bias),
                    torch.allclose(y.full_tensor(), want, atol=1e-12),
                    y.placements == tuple(places),
                    torch.allclose(xs.grad.full_tensor(), xr.grad, atol=1e-12),
                    all(
                        torch.allclose(a.grad, b.grad, atol=1e-12)
                        for a, b in zip(lin.parameters(), one.parameters())
                    ),
                    fwd.events == [] and labels == expected,
                    labels,
                )
            )
        return out

    return body


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (4,), (2, 2), (2, 1), (1, 2)], ids=str)
def test_linear_equals_torch_with_one_fused_all_reduce(ranks_for, mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    for res in ranks_for(world).run(_sweep(mesh_shape, 12, seed=sum(mesh_shape) * 7)):
        for case, same, layout, xgrad, pgrads, messages, labels in res:
            assert same and layout and xgrad and pgrads, case
            assert messages, (case, labels)


def _left_to_aten():
    """A cut in_features (a Partial result, as on one device after its sum), a sharded
    weight and a non-contiguous input still give torch's values."""
    mesh = this_rank().mesh
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64)
    ok = []
    with shardlab.patched():
        cols = distribute(x, mesh, [Shard(2)], [[4, 2]])
        ok.append(torch.allclose(F.linear(cols, w).full_tensor(), F.linear(x, w)))
        ws = distribute(w, mesh, [Shard(0)], [[3, 2]])
        rows = distribute(x, mesh, [Shard(1)], [[1, 3]])
        ok.append(torch.allclose(F.linear(rows, ws).full_tensor(), F.linear(x, w)))
        t = distribute(x.transpose(0, 1).contiguous(), mesh, [Shard(0)]).transpose(0, 1)
        ok.append(torch.allclose(F.linear(t, w).full_tensor(), F.linear(x, w)))
        try:
            F.linear(rows, torch.randn(5, 7, dtype=torch.float64))
            ok.append(False)
        except RuntimeError as e:  # torch's type (its meta kernel's words), every rank
            ok.append(str(e))
    return ok


def test_other_layouts_are_left_to_the_aten_rules(ranks_for):
    per_rank = ranks_for(2).run(_left_to_aten)
    for ok in per_rank:
        assert ok[:3] == [True] * 3, ok
        assert "[12, 6] X [7, 5]" in ok[3] and ok[3] == per_rank[0][3], ok
