"""ShardTensor next to DTensor's own tensor parallelism (parallelize_module)."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import shardlab


def test_parallelize_module_mlp_on_shard_tensors(ranks_for):
    def body():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = shardlab.this_rank().mesh
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        g = torch.randn(6, 4)
        ref = mlp(g)
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        outs = []
        for placements in ([Replicate()], [Shard(0)]):
            x = shardlab.distribute(g, mesh, placements)
            y = mlp(x)
            y = y.full_tensor() if hasattr(y, "full_tensor") else torch.as_tensor(y)
            outs.append(torch.allclose(y, ref, atol=1e-6))
        return outs

    assert ranks_for(2).run(body) == [[True, True]] * 2


def test_patched_functions_take_plain_dtensors_when_asked(ranks_for):
    """Inside ``patched(dtensors=True)`` shardlab takes torch's plain DTensors over: a
    ``ColwiseParallel(use_local_output=False)`` head gives ``Shard(-1)`` logits, and
    ``F.cross_entropy`` is then vocab-parallel (2 all-reduces forward) and exact, also
    where torch's ``loss_parallel`` is not (ignored targets, label smoothing). A conv on a
    ``distribute_tensor`` input is a halo conv. Gradients come back as DTensors. (Plain
    ``patched()`` leaves them to torch: ``tests/test_patch_borders.py``.)"""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = shardlab.this_rank().mesh
        torch.manual_seed(0)
        head = torch.nn.Linear(8, 12).double()
        x = torch.randn(5, 8, dtype=torch.float64)
        t = torch.tensor([3, -100, 11, 0, 7])
        ref = F.cross_entropy(head(x), t, label_smoothing=0.1)
        ref.backward()
        want = [p.grad.clone() for p in head.parameters()]
        head.zero_grad(set_to_none=True)
        parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
        with shardlab.patched(dtensors=True), shardlab.trace() as tr:
            logits = head(x)  # a plain DTensor, Shard(-1)
            kind = type(logits) is DTensor
            loss = F.cross_entropy(logits, t, label_smoothing=0.1)
            loss.backward()
        grads = [p.grad.full_tensor() for p in head.parameters()]
        ok = kind and torch.allclose(loss.full_tensor(), ref)
        ok &= all(torch.allclose(g, w) for g, w in zip(grads, want))
        fwd = [e.kind for e in tr.events if "cross_entropy" in e.label]

        img = torch.randn(1, 2, 9, 5, dtype=torch.float64)
        conv = torch.nn.Conv2d(2, 3, 3, padding=1).double()
        with shardlab.patched(dtensors=True):
            y = conv(distribute_tensor(img, mesh, [Shard(2)]))
        ok &= torch.allclose(y.full_tensor(), conv(img))
        return ok, fwd

    for ok, fwd in ranks_for(2).run(body):
        assert ok and fwd == ["all_reduce", "all_reduce"], fwd


def test_opt_einsum_takes_shard_tensors_as_torch_tensors(ranks_for):
    """opt_einsum picks its backend from the module of a tensor's class ("shardlab" for a
    ShardTensor, which it did not know: it fell back to NumPy and failed on a tensor that
    requires grad). Told that shardlab's tensors are torch's, its contraction on a
    ShardTensor cut along the batch is exact, forward and backward, and stays cut."""
    pytest.importorskip("opt_einsum")

    def body():
        import opt_einsum

        from shardlab import ShardTensor

        mesh = shardlab.this_rank().mesh
        g = torch.Generator().manual_seed(0)
        x = torch.randn(7, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
        w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
        v = torch.randn(5, 2, dtype=torch.float64, generator=g)
        ref = opt_einsum.contract("bij,jk,kl->bil", x, w, v)
        ref.square().sum().backward()
        want = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        cut = shardlab.distribute(x, mesh, [Shard(0)], [[4, 3]])
        y = opt_einsum.contract("bij,jk,kl->bil", cut, w, v)
        y.square().sum().backward()
        return (
            type(y) is ShardTensor and y.placements == (Shard(0),),
            torch.allclose(y.full_tensor(), ref),
            torch.allclose(x.grad, want[0]) and torch.allclose(w.grad, want[1]),
        )

    assert ranks_for(2).run(body) == [(True, True, True)] * 2
