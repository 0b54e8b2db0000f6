"""Sharded normalisation layers against single device: outputs, input and parameter
gradients, running statistics, and exactly one fused all-reduce per call."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank

SHAPE = (4, 4, 5, 7)  # (N, C, H, W)

LAYOUTS = {  # name -> (mesh shape, placements, sizes)
    "H uneven+empty": ((4,), [Shard(2)], [[2, 0, 1, 2]]),
    "W, size-1": ((4,), [Shard(3)], [[3, 3, 0, 1]]),
    "batch": ((4,), [Shard(0)], [[1, 1, 2, 0]]),
    "2-D batch x H": ((2, 2), [Shard(0), Shard(2)], [[3, 1], [4, 1]]),
    "2-D H x W": ((2, 2), [Shard(2), Shard(3)], [[1, 4], [5, 2]]),
    "2-D H x Replicate": ((2, 2), [Shard(2), Replicate()], [[2, 3], None]),
    # a mesh dim of one rank cuts nothing: torch's own op on the whole block, no message
    "1 rank: H": ((1,), [Shard(2)], [[5]]),
    "2-D Replicate x H on one rank": ((2, 1), [Replicate(), Shard(2)], [None, [5]]),
}

MODULES = {  # name -> (factory, label, reduced dims: a collective iff one is sharded)
    "batch_norm": (lambda: nn.BatchNorm2d(4), "batch_norm", {0, 2, 3}),
    "batch_norm momentum=None": (lambda: nn.BatchNorm2d(4, momentum=None), "batch_norm", {0, 2, 3}),
    "group_norm": (lambda: nn.GroupNorm(2, 4), "group_norm", {2, 3}),
    "instance_norm tracked": (
        lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        "instance_norm",
        {0, 2, 3},
    ),
    "instance_norm": (lambda: nn.InstanceNorm2d(4), "instance_norm", {2, 3}),
    "layer_norm (H, W)": (lambda: nn.LayerNorm((5, 7)), "layer_norm", {2, 3}),
    "layer_norm W": (lambda: nn.LayerNorm(7), "layer_norm", {3}),
}


def _body(layout_names):
    def body():
        from shardlab import this_rank

        results = []
        for lname in layout_names:
            mesh_shape, placements, sizes = LAYOUTS[lname]
            mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
            sharded = {  # cut across ranks
                p.dim for p, n in zip(placements, mesh_shape) if isinstance(p, Shard) and n > 1
            }
            for mname, (make, op, reduced) in MODULES.items():
                torch.manual_seed(0)
                ref_m, m = make().double(), make().double()
                for p in ref_m.parameters():
                    p.data.normal_()
                m.load_state_dict(ref_m.state_dict())
                for step, training in enumerate([True, True, False]):
                    ref_m.train(training)
                    m.train(training)
                    g = torch.randn(SHAPE, dtype=torch.float64) * 2 + 3
                    xr = g.clone().requires_grad_()
                    ref = ref_m(xr)
                    w_out = torch.randn(SHAPE, dtype=torch.float64)
                    (ref * w_out).sum().backward()
                    x = g.clone().requires_grad_()
                    with shardlab.patched():
                        st = distribute(x, mesh, placements, sizes=sizes)
                        with shardlab.trace(mesh=mesh) as t:
                            y = m(st)
                            (
                                y.to_local() * distribute(w_out, mesh, placements, sizes).to_local()
                            ).sum().backward()
                    cfg = (lname, mname, step)
                    assert torch.allclose(y.full_tensor(), ref, atol=1e-10), cfg
                    assert torch.allclose(x.grad, xr.grad, atol=1e-10), cfg
                    for p, q in zip(m.parameters(), ref_m.parameters()):
                        assert type(p.grad) is torch.Tensor, cfg
                        assert torch.allclose(p.grad, q.grad, atol=1e-10), cfg
                    for b, c in zip(m.buffers(), ref_m.buffers()):
                        assert torch.allclose(b.double(), c.double(), atol=1e-12), cfg
                    uses_batch = training or not isinstance(m, nn.modules.batchnorm._NormBase) or (
                        not m.track_running_stats)  # fmt: skip
                    want = int(uses_batch and bool(reduced & sharded))
                    fwd = t.filter(label=f"{op}.stats forward").counts()
                    stats_back = t.filter(label=f"{op}.stats backward").counts()
                    assert fwd == ({"all_reduce": want} if want else {}), (cfg, fwd)
                    assert stats_back == fwd, (cfg, stats_back)
                    back = t.filter(kind="all_reduce").events
                    back = [e for e in back if e.label.startswith(op) and "backward" in e.label]
                    if op == "batch_norm" and training:  # weight/bias sums fused in
                        assert len(back) == int(bool(sharded)), (cfg, [e.label for e in back])
                    assert len(back) <= 2, (cfg, [e.label for e in back])
                    other_fwd = [
                        e for e in t.events if "forward" in e.label and not e.label.startswith(op)
                    ]
                    assert not [e for e in t.events if e.label.startswith(op) and "forward" in
                                e.label and "stats" not in e.label], cfg  # fmt: skip
                    assert not [e for e in other_fwd if "redistribute" not in e.label], cfg
                    ref_m.zero_grad()
                    m.zero_grad()
                    results.append(cfg)
        return len(results)

    return body


@pytest.mark.parametrize("layouts", [["H uneven+empty", "W, size-1", "batch"]], ids=["1-D mesh"])
def test_norms_1d_mesh(ranks_for, layouts):
    assert ranks_for(4).run(_body(layouts)) == [len(layouts) * len(MODULES) * 3] * 4


def test_norms_on_mesh_dims_of_one_rank(ranks_for):
    assert ranks_for(1).run(_body(["1 rank: H"])) == [len(MODULES) * 3]
    names = ["2-D Replicate x H on one rank"]
    assert ranks_for(2).run(_body(names)) == [len(MODULES) * 3] * 2


def test_norms_2d_mesh(ranks_for):
    names = ["2-D batch x H", "2-D H x W", "2-D H x Replicate"]
    assert ranks_for(4).run(_body(names)) == [len(names) * len(MODULES) * 3] * 4


def test_layer_norm_over_unsharded_dims_is_local(ranks_for):
    """Whole rows: no forward message; backward ONE all-reduce of the weight and bias
    gradients together (7 + 7 float64 numbers), everything equal to one device."""

    def body():
        mesh = this_rank().mesh
        torch.manual_seed(0)
        ln = nn.LayerNorm(7).double()
        nn.init.normal_(ln.weight), nn.init.normal_(ln.bias)
        one = nn.LayerNorm(7).double()
        one.load_state_dict(ln.state_dict())
        g = torch.randn(2, 3, 5, 7, dtype=torch.float64)
        gy = torch.randn(2, 3, 5, 7, dtype=torch.float64)
        want = one(g)
        want.backward(gy)
        with shardlab.patched():
            st = distribute(g, mesh, [Shard(2)], sizes=[4, 1])
            with shardlab.trace() as fwd:
                y = ln(st)
            with shardlab.trace() as bwd:
                y.backward(distribute(gy, mesh, [Shard(2)], sizes=[4, 1]))
        grads = all(
            torch.allclose(a.grad, b.grad) for a, b in zip(ln.parameters(), one.parameters())
        )
        labels = [(e.label, e.kind, e.bytes) for e in bwd.events]
        return fwd.counts(), labels, torch.allclose(y.full_tensor(), want), grads

    for counts, labels, ok, grads in ranks_for(2).run(body):
        assert counts == {} and ok and grads
        assert labels == [("params backward", "all_reduce", 14 * 8)], labels


def test_errors_on_every_rank(ranks_for):
    def body():
        mesh = this_rank().mesh
        errors = []
        with shardlab.patched():
            one = distribute(torch.randn(1, 3, 1, 1), mesh, [Shard(2)], sizes=[1, 0])
            chans = distribute(torch.randn(2, 4, 3), mesh, [Shard(1)])
            calls = (
                lambda: nn.BatchNorm2d(3)(one),  # one value per channel
                lambda: F.group_norm(distribute(torch.randn(2, 4, 3), mesh, [Shard(2)]), 3),
                lambda: nn.BatchNorm1d(4)(chans),
            )
            for call in calls:
                try:
                    call()
                except (ValueError, RuntimeError, NotImplementedError) as exc:
                    errors.append(type(exc).__name__)
        return errors

    for errors in ranks_for(2).run(body):
        assert errors == ["ValueError", "RuntimeError", "NotImplementedError"], errors


def _float32_far_from_zero():
    """float32 inputs whose mean is far from 0 (pixels around 100, activations around 1e4):
    the sharded statistics are as accurate as torch's own float32 kernels, measured
    against float64 truth, and never depend on the running buffers."""
    mesh = this_rank().mesh
    sizes = {2: [[9, 7]], 3: [[9, 0, 7]], 4: [[5, 4, 0, 7]]}[mesh.size()]
    fns = {
        "batch_norm": lambda t: F.batch_norm(t, None, None, training=True),
        "group_norm": lambda t: F.group_norm(t, 2),
        "layer_norm": lambda t: F.layer_norm(t, t.shape[1:]),
        "instance_norm": lambda t: F.instance_norm(t),
    }
    worse = []
    g = torch.Generator().manual_seed(0)
    for offset in (0.0, 100.0, 1e3, 1e4):
        x = torch.randn(2, 4, 16, 16, generator=g) * 0.5 + offset
        for name, fn in fns.items():
            truth = fn(x.double())
            with shardlab.patched():
                got = fn(distribute(x, mesh, [Shard(2)], sizes)).full_tensor()
            err, torch_err = ((t.double() - truth).abs().max().item() for t in (got, fn(x)))
            if err > 4 * torch_err + 1e-6:
                worse.append((name, offset, err, torch_err))
    # the running buffers differ from rank to rank (a step on one rank only): the
    # statistics of a training step do not read them
    x = torch.randn(2, 4, 16, 16, generator=g) + 3.0
    mean, var = torch.full((4,), float(mesh.get_coordinate()[0])), torch.ones(4)
    want = F.batch_norm(x, mean.clone(), var.clone(), training=True)
    with shardlab.patched():
        st = distribute(x, mesh, [Shard(2)], sizes)
        got = F.batch_norm(st, mean, var, training=True).full_tensor()
    return worse, (got - want).abs().max().item()


@pytest.mark.parametrize("world", [2, 3])
def test_statistics_exact_far_from_zero_and_without_the_buffers(ranks_for, world):
    for worse, diff in ranks_for(world).run(_float32_far_from_zero):
        assert worse == []
        assert diff < 1e-5


def test_layer_norm_on_whole_rows_raises_torchs_errors_on_every_rank(ranks_for):
    """Whole rows (the normalized dims uncut), arguments torch refuses (a normalized_shape
    that is not the trailing dims, an int, a weight of another shape): torch's error type
    on every rank, one owning no rows too (never normalized over the wrong dims)."""

    def body():
        mesh = this_rank().mesh
        x = torch.randn(2, 3, 4)
        st = distribute(x, mesh, [Shard(1)], sizes=[3, 0])
        bad = [((5,), None), ((3, 5), None), ((4,), torch.ones(3)), (7, None)]
        out = []
        for shape, w in bad:
            try:
                F.layer_norm(x, shape, w)
                want = None
            except (RuntimeError, TypeError) as e:
                want = (type(e), str(e))
            with shardlab.patched():
                try:
                    F.layer_norm(st, shape, w)
                    out.append(("no error", shape))
                except Exception as e:  # noqa: BLE001  (torch's type; the meta kernel's words)
                    out.append((type(e) is want[0] and "normalized_shape" in str(e), str(e)))
        return out

    results = ranks_for(2).run(body)
    assert results[0] == results[1], results  # the same error on every rank
    assert [ok for ok, _ in results[0]] == [True] * 4, results
