"""Parameters' gradients summed once at the end of the backward
(``shardlab/tensor/grad_sum.py``), against single-device torch (float64): every case a
user of torch can write around a parameter, where the sum is kept for the end and where
it must not be (a hook, ``torch.autograd.grad``, ``inputs=``, DDP, autocast), and the
messages: one all-reduce of all the parameters' gradients per backward."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank


def _net():
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "conv": nn.Conv1d(3, 4, 3, padding=1),
            "norm": nn.LayerNorm(4),
            "lin": nn.Linear(4, 4),
            "head": nn.Linear(4, 2, bias=False),
        }
    ).double()


def _loss(net, x, extra=None):
    """(B, 3, L) -> conv -> (B, L, 4) -> norm -> lin twice (one weight, two uses) -> head;
    ``extra``: a plain-code use of a weight too."""
    h = net["conv"](x).transpose(1, 2)  # (B, L_local, 4)
    h = net["lin"](torch.tanh(net["lin"](net["norm"](h))))
    out = net["head"](h).pow(2).sum()
    if extra == "plain":  # the same parameter in plain code: a full (not partial) gradient
        out = out + net["lin"].weight.pow(2).sum() * 3
    return out


def _cases(world):
    def body():
        mesh = this_rank().mesh if world < 4 else this_rank().mesh_for((2, 2))
        places = [Shard(2)] if mesh.ndim == 1 else [Shard(0), Shard(2)]
        sizes = {1: [[9]], 2: [[6, 3]], 3: [[5, 0, 4]]}.get(world, [[2, 1], [5, 4]])
        x = torch.randn(3, 3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        net = _net()
        out = {}

        def run(name, fn_one, fn_sharded):
            """fn_*(net, x) -> gradients (a list); both from the same weights."""
            net.zero_grad(set_to_none=True)
            want = fn_one(net, x.clone())
            net.zero_grad(set_to_none=True)
            with shardlab.patched(), shardlab.trace() as t:
                got = fn_sharded(net, distribute(x, mesh, places, sizes))
            err = max(
                float("inf") if (a is None) != (b is None) else 0.0 if a is None else
                (a - b).abs().max().item()
                for a, b in zip(got, want)
            )  # fmt: skip
            mine = [e for e in t.events if e.rank == torch.distributed.get_rank()]
            out[name] = (err, len(want) == len(got), [(e.label, e.kind, e.bytes) for e in mine])

        grads = lambda: [p.grad for p in net.parameters()]  # noqa: E731

        def backward(extra=None):
            def fn(net, x):
                _loss(net, x, extra).backward()
                return grads()

            return fn

        run("backward", backward(), backward())
        run("plain use too", backward("plain"), backward("plain"))

        def twice(net, x):  # gradient accumulation: two backwards, no zero_grad between
            _loss(net, x).backward()
            _loss(net, x).backward()
            return grads()

        run("accumulated", twice, twice)

        def retained(net, x):
            loss = _loss(net, x)
            loss.backward(retain_graph=True)
            loss.backward()
            return grads()

        run("retain_graph", retained, retained)

        def autograd_grad(net, x):  # captured, not accumulated: .grad stays None
            g = torch.autograd.grad(_loss(net, x), list(net.parameters()))
            return list(g) + grads()

        run("autograd.grad", autograd_grad, autograd_grad)

        def some_inputs(net, x):
            _loss(net, x).backward(inputs=[net["lin"].weight, net["conv"].bias])
            return grads()

        run("inputs=", some_inputs, some_inputs)

        def hooked(net, x):  # a tensor hook sees the full gradient, and its change counts
            seen = []
            w = net["lin"].weight
            hs = [
                w.register_hook(lambda g: seen.append(g.clone()) or g * 2),
                net["head"].weight.register_post_accumulate_grad_hook(
                    lambda p: seen.append(p.grad.clone())
                ),
            ]
            _loss(net, x).backward()
            for h in hs:
                h.remove()
            return seen + grads()

        run("hooks", hooked, hooked)

        def checkpointed(reentrant):
            def fn(net, x):
                from torch.utils.checkpoint import checkpoint

                x.requires_grad_(reentrant)  # (torch's reentrant one needs an input that does)
                y = checkpoint(_loss, net, x, use_reentrant=reentrant)
                y.backward()
                return grads()

            return fn

        run("checkpoint", checkpointed(False), checkpointed(False))
        run("checkpoint reentrant", checkpointed(True), checkpointed(True))

        def set_before(net, x):  # .grad set before (a list the optimizer keeps)
            for p in net.parameters():
                p.grad = torch.ones_like(p)
            _loss(net, x).backward()
            return grads()

        run(".grad set before", set_before, set_before)
        return out

    return body


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parameter_gradients_equal_torch_in_every_case(ranks_for, world):
    per_rank = ranks_for(world).run(_cases(world))
    for res in per_rank:
        for name, (err, same_len, _) in res.items():
            assert same_len and err < 1e-12, (world, name, err)
    for res in per_rank:
        params = 4 * 3 * 3 + 4 + 4 + 4 + 4 * 4 + 4 + 4 * 2  # conv, norm, lin, head
        # one all-reduce of every parameter's gradient, at the end of the backward
        for name in ("backward", "plain use too", "checkpoint", "checkpoint reentrant"):
            sums = [m for m in res[name][2] if "params" in m[0]]
            assert sums == [("params backward", "all_reduce", params * 8)], (name, sums)
        assert [m for m in res["accumulated"][2] if "params" in m[0]] == [
            ("params backward", "all_reduce", params * 8)
        ] * 2
        # where the sum cannot wait, it is done at once, per op, as before: every
        # parameter under torch.autograd.grad, the two hooked ones here
        labels = [m[0] for m in res["autograd.grad"][2]]
        assert "params backward" not in labels and "linear.params backward" in labels
        labels = [m[0] for m in res["hooks"][2]]
        assert labels.count("params backward") == 1 and "linear.params backward" in labels


def _ddp_and_autocast():
    """Inside DDP's forward (over a group of one rank here: its reducer's hooks read
    ``.grad`` as it is accumulated) and under autocast (the cast weight is no leaf), each
    gradient is summed at once."""
    mesh = this_rank().mesh
    x = torch.randn(3, 3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = {}
    net = _net()
    _loss(net, x).backward()
    want = [p.grad for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    me = torch.distributed.get_rank()
    groups = [torch.distributed.new_group([r]) for r in range(mesh.size())]
    ddp = nn.parallel.DistributedDataParallel(_Wrapped(net), process_group=groups[me])
    with shardlab.patched(), shardlab.trace() as t:
        ddp(distribute(x, mesh, [Shard(2)], [[6, 3]])).backward()
    got = [p.grad for p in net.parameters()]
    out["ddp"] = (
        max((a - b).abs().max().item() for a, b in zip(got, want)),
        sorted({e.label for e in t.events if "params" in e.label}),
    )
    net.zero_grad(set_to_none=True)
    x = torch.randn(3, 9, 4, generator=torch.Generator().manual_seed(2))  # float32: cast
    lin = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x).float().pow(2).sum()
    ref.backward()
    want = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    xs = distribute(x, mesh, [Shard(1)], [[6, 3]])
    with shardlab.patched(), shardlab.trace() as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(xs).float().pow(2).sum()
        y.backward()
    out["autocast"] = (
        (lin.weight.grad - want).abs().max().item() / want.abs().max().item(),
        sorted({e.label for e in t.events if "params" in e.label}),
    )
    return out


class _Wrapped(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return _loss(self.net, x)


def test_ddp_and_autocast_sum_at_once(ranks_for):
    for res in ranks_for(2).run(_ddp_and_autocast):
        err, labels = res["ddp"]
        assert err < 1e-12 and "params backward" not in labels, res
        err, labels = res["autocast"]
        assert err < 1e-2 and "params backward" not in labels, res


def _replicated_input():
    """A parameter next to a Replicate ShardTensor: nothing is partial, nothing is sent."""
    mesh = this_rank().mesh
    lin = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with shardlab.patched(), shardlab.trace() as t:
        lin(distribute(x, mesh, [Replicate()])).full_tensor().sum().backward()
    g = lin.weight.grad.clone()
    lin.zero_grad()
    lin(x).sum().backward()
    return torch.allclose(g, lin.weight.grad), [e.label for e in t.events]


def test_a_replicated_input_sends_nothing(ranks_for):
    for same, labels in ranks_for(2).run(_replicated_input):
        assert same and not any("params" in label for label in labels), labels


def test_the_generic_lift_keeps_its_sum_too(ranks_for):
    """An aten op with a plain parameter (``mul`` by a weight, not a patched entry
    point): its Partial gradient joins the same end-of-backward sum."""

    def body():
        mesh = this_rank().mesh
        w = nn.Parameter(torch.randn(4, dtype=torch.float64))
        lin = nn.Linear(4, 4).double()
        x = torch.randn(7, 4, dtype=torch.float64)
        (lin(x * w)).pow(2).sum().backward()
        want = [w.grad.clone(), lin.weight.grad.clone()]
        w.grad, lin.weight.grad = None, None
        with shardlab.patched(), shardlab.trace() as t:
            lin(distribute(x, mesh, [Shard(0)], [[4, 3]]) * w).pow(2).sum().backward()
        err = max((a - b).abs().max().item() for a, b in zip([w.grad, lin.weight.grad], want))
        me = torch.distributed.get_rank()
        return err, [(e.label, e.bytes) for e in t.events if e.rank == me and "params" in e.label]

    for err, sums in ranks_for(2).run(body):
        assert err < 1e-12
        assert sums == [("params backward", (4 + 16 + 4) * 8)], sums


def test_a_zero_dim_parameter_gets_a_plain_gradient(ranks_for):
    """A 0-dim tensor that requires grad next to a ShardTensor, a leaf (a learned
    temperature) or not (``sigmoid(w).mean() * 2``), is lifted like any parameter: the
    leaves' ``.grad`` are plain tensors equal to one device (before, ``.grad`` came back a
    ShardTensor). The leaf's gradient joins the end-of-backward all-reduce; the non-leaf's
    is summed where it is reached (no leaf to wait for)."""

    def body():
        mesh = this_rank().mesh
        x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1)
        w = nn.Parameter(torch.randn(3, dtype=torch.float64, generator=g))
        t = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

        def loss(x):
            return (x * (w.sigmoid().mean() * 2) * t).pow(2).sum()

        loss(x).backward()
        want = [w.grad.clone(), t.grad.clone()]
        w.grad, t.grad = None, None
        with shardlab.trace() as tr:
            loss(distribute(x, mesh, [Shard(0)], [[4, 3]])).full_tensor().backward()
        got = [w.grad, t.grad]
        me = torch.distributed.get_rank()
        return (
            [type(a) for a in got],
            max((a - b).abs().max().item() for a, b in zip(got, want)),
            [(e.label, e.kind, e.bytes) for e in tr.events if e.rank == me],
        )

    for types, err, sums in ranks_for(2).run(body):
        assert types == [torch.Tensor, torch.Tensor] and err < 1e-12, (types, err)
        assert sums == [
            ("redistribute", "all_reduce", 8),  # the loss's full_tensor
            ("redistribute backward", "all_reduce", 8),  # the non-leaf's gradient, at once
            ("params backward", "all_reduce", 8),  # the leaf's, at the end of the backward
        ], sums
