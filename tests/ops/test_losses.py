"""``torch.nn.functional`` losses on ShardTensors equal single-device torch, fwd + bwd.

Random shapes, sharded dims and uneven sizes (empty shards included), every reduction, world
1-4 and a 2x2 mesh. The reference is the plain torch call on the whole tensors.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardlab import distribute
from shardlab.runtime import this_rank
from tests.tensor._cases import random_sizes


def _probability(x):
    return torch.sigmoid(x)


def _sign(x):
    return torch.where(x > 0, 1.0, -1.0).to(x.dtype)


# name, loss(input, other, target, **kw), kwargs to sweep; inputs are (N, C, L) float64
LOSSES = [
    ("mse", lambda a, b, t, **k: F.mse_loss(a, b, **k), {}),
    ("l1", lambda a, b, t, **k: F.l1_loss(a, b, **k), {}),
    ("smooth_l1", lambda a, b, t, **k: F.smooth_l1_loss(a, b, beta=0.5, **k), {}),
    ("huber", lambda a, b, t, **k: F.huber_loss(a, b, delta=0.7, **k), {}),
    ("soft_margin", lambda a, b, t, **k: F.soft_margin_loss(a, _sign(b), **k), {}),
    ("bce", lambda a, b, t, **k: F.binary_cross_entropy(_probability(a), _probability(b), **k), {}),
    (
        "bce_logits",
        lambda a, b, t, **k: F.binary_cross_entropy_with_logits(a, _probability(b), **k),
        {},
    ),
    ("kl_div", lambda a, b, t, **k: F.kl_div(a, b, log_target=True, **k), {"batchmean": True}),
    ("poisson_nll", lambda a, b, t, **k: F.poisson_nll_loss(a, b.exp(), **k), {}),
    ("gaussian_nll", lambda a, b, t, **k: F.gaussian_nll_loss(a, b, t.abs() + 0.1, **k), {}),
    ("hinge", lambda a, b, t, **k: F.hinge_embedding_loss(a, _sign(b), **k), {}),
    ("margin_ranking", lambda a, b, t, **k: F.margin_ranking_loss(a, b, _sign(t), **k), {}),
]


def _body(world, mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        me = this_rank()
        mesh = me.mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done = []
        for i in range(cases):
            name, fn, extra = LOSSES[i % len(LOSSES)]
            reductions = ["mean", "sum"] + (["batchmean"] if extra.get("batchmean") else [])
            reduction = rng.choice(reductions)
            shape = (rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 9))
            dims = rng.sample(range(3), len(mesh_shape))
            sizes = [random_sizes(rng, shape[d], n) for d, n in zip(dims, mesh_shape)]
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            a, b, t = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
            ref_a = a.clone().requires_grad_()
            ref = fn(ref_a, b, t, reduction=reduction)
            ref.backward()
            x = a.clone().requires_grad_()
            placements = [Shard(d) for d in dims]
            st = [distribute(v, mesh, placements, sizes=sizes) for v in (x, b, t)]
            out = fn(*st, reduction=reduction)
            value = out.full_tensor() if hasattr(out, "full_tensor") else out
            case = (name, reduction, shape, placements, sizes)
            assert torch.allclose(value, ref, atol=1e-12, rtol=1e-10), case
            out.backward()
            assert torch.allclose(x.grad, ref_a.grad, atol=1e-12, rtol=1e-10), case
            done.append(name)
        return sorted(set(done))

    return body


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_losses_match_single_device(ranks_for, world):
    got = ranks_for(world).run(_body(world, (world,), 3 * len(LOSSES), seed=world))
    assert got[0] == sorted(name for name, _, _ in LOSSES)


def test_losses_on_a_2d_mesh(ranks_for):
    got = ranks_for(4).run(_body(4, (2, 2), 2 * len(LOSSES), seed=7))
    assert got[0] == sorted(name for name, _, _ in LOSSES)


def test_mse_loss_reads_one_number_and_moves_nothing_backward(ranks_for):
    """Even sizes, where DTensor's own rule divides the gradient by the local count.

    The mean stays a partial sum until it is read: one all-reduce of one float64 then."""

    def body():
        import shardlab

        me = this_rank()
        a = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        b = torch.zeros(4, 8, dtype=torch.float64)
        ref_a = a.clone().requires_grad_()
        F.mse_loss(ref_a, b).backward()
        cols = slice(2 * me.rank, 2 * me.rank + 2)
        x = a[:, cols].clone().requires_grad_()  # my block, a leaf: its backward is mine alone
        st = shardlab.ShardTensor.from_local(x, me.mesh, [Shard(1)], sizes=[[2] * 4])
        with shardlab.trace() as forward:
            loss = F.mse_loss(st, distribute(b, me.mesh, [Replicate()]))
            value = loss.full_tensor()
        with shardlab.trace() as backward:
            loss.backward()
        return (
            torch.equal(x.grad, ref_a.grad[:, cols]) and torch.allclose(value, F.mse_loss(a, b)),
            [(e.kind, e.bytes) for e in forward.events],
            backward.counts(),
        )

    for same, fwd, bwd in ranks_for(4).run(body):
        assert same and fwd == [("all_reduce", 8)] and bwd == {}


def test_bad_reduction_is_a_value_error(ranks_for):
    def body():
        me = this_rank()
        st = distribute(torch.zeros(4, 3), me.mesh, [Shard(0)])
        with pytest.raises(ValueError, match="reduction"):
            F.mse_loss(st, st, reduction="average")
        with pytest.raises(ValueError, match="reduction"):
            F.mse_loss(torch.zeros(2), torch.zeros(2), reduction="average")  # torch's own
        return True

    assert ranks_for(2).run(body) == [True, True]


def _nll_body(world, cases, seed):
    """nll_loss and cross_entropy with class weights and ignored targets, *without*
    ``shardlab.patched()``: rows, classes or the extra dim sharded, uneven sizes."""

    def body():
        me = this_rank()
        rng = random.Random(seed)
        done = []
        for i in range(cases):
            fn = [F.nll_loss, F.cross_entropy][i % 2]
            reduction = rng.choice(["mean", "sum", "none"])
            n, c, length = rng.randint(1, 6), rng.randint(2, 5), rng.randint(1, 5)
            d = rng.choice([0, 1, 2])  # input dim sharded; target (N, L) follows dims 0 / 2
            sizes = [random_sizes(rng, (n, c, length)[d], world)]
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            logits = torch.randn(n, c, length, generator=gen, dtype=torch.float64)
            if fn is F.nll_loss:
                logits = logits.log_softmax(1)
            target = torch.randint(0, c, (n, length), generator=gen)
            target[torch.rand(n, length, generator=gen) < 0.3] = -100  # ignored
            weight = torch.rand(c, generator=gen, dtype=torch.float64) + 0.1
            ref_x = logits.clone().requires_grad_()
            ref = fn(ref_x, target, weight=weight, reduction=reduction)
            ref.sum().backward()
            x = logits.clone().requires_grad_()
            st = distribute(x, me.mesh, [Shard(d)], sizes=sizes)
            tt = target if d == 1 else distribute(target, me.mesh, [Shard(d // 2)], sizes=sizes)
            out = fn(st, tt, weight=weight, reduction=reduction)
            value = out.full_tensor()
            case = (fn.__name__, reduction, (n, c, length), d, sizes)
            assert torch.allclose(value, ref, atol=1e-12, equal_nan=True), case
            value.sum().backward()
            if not ref.isnan().any():  # every target ignored: nan, as torch
                assert torch.allclose(x.grad, ref_x.grad, atol=1e-12), case
            done.append(fn.__name__)
        return sorted(set(done))

    return body


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nll_and_cross_entropy_with_ignored_targets_unpatched(ranks_for, world):
    """DTensor averages the local means here: wrong when ranks ignore different counts."""
    got = ranks_for(world).run(_nll_body(world, 24, seed=world))
    assert got[0] == ["cross_entropy", "nll_loss"]


def test_class_losses_with_a_target_row_per_sample(ranks_for):
    """Losses over (B, C) scores with a target per row, the batch cut unevenly (an empty
    shard among them), every reduction: ``multilabel_margin_loss`` with its labels ended
    by -1 (torch 2.11-2.14's decomposition counted the labels after the -1 too: the
    whole-tensor fallback runs the op itself there), ``multi_margin_loss`` with class
    weights, ``multilabel_soft_margin_loss``."""

    def body():
        mesh = this_rank().mesh
        gen = torch.Generator().manual_seed(0)
        b, c = 9, 5
        scores = torch.randn(b, c, dtype=torch.float64, generator=gen)
        labels = torch.randint(0, c, (b, c), generator=gen)
        labels[torch.arange(b), torch.randint(0, c, (b,), generator=gen)] = -1  # ends
        labels[0] = -1  # no label at all
        cls = torch.randint(0, c, (b,), generator=gen)
        multi_hot = (torch.rand(b, c, generator=gen) > 0.5).double()
        weight = torch.rand(c, dtype=torch.float64, generator=gen) + 0.5
        calls = {
            "multilabel_margin": lambda x, t: F.multilabel_margin_loss(x, t[0], **t[1]),
            "multi_margin": lambda x, t: F.multi_margin_loss(x, t[0], p=2, weight=weight, **t[1]),
            "multilabel_soft_margin": lambda x, t: F.multilabel_soft_margin_loss(x, t[0], **t[1]),
        }
        targets = {"multilabel_margin": labels, "multi_margin": cls,
                   "multilabel_soft_margin": multi_hot}  # fmt: skip
        bad = []
        for name, call in calls.items():
            for reduction in ("none", "mean", "sum"):
                kw = {"reduction": reduction}
                ref_x = scores.clone().requires_grad_()
                ref = call(ref_x, (targets[name], kw))
                w = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
                (ref * w).sum().backward()
                x = scores.clone().requires_grad_()
                st = distribute(x, mesh, [Shard(0)], sizes=[4, 0, 5])
                tt = distribute(targets[name], mesh, [Shard(0)], sizes=[4, 0, 5])
                out = call(st, (tt, kw))
                full = out.full_tensor()
                (full * w).sum().backward()
                if not (torch.allclose(full, ref, atol=1e-12)
                        and torch.allclose(x.grad, ref_x.grad, atol=1e-12)):  # fmt: skip
                    bad.append((name, reduction, (full - ref).abs().max().item()))
        return bad

    assert ranks_for(3).run(body) == [[]] * 3
