"""Parameters that are DTensors shardlab did not make, next to ShardTensor inputs.

torch's own ways to put a model on a mesh make its parameters DTensors:
``distribute_module`` (every parameter ``Replicate``), the replicated parts of
``parallelize_module``, a sub-mesh (``mesh["tp"]``), FSDP2's ``fully_shard``. Fed a
ShardTensor cut along H or the sequence, the output and every gradient equal one device;
a gradient comes back a DTensor (never a ShardTensor), its sum over the ranks pending
(``Partial()``) where torch's backward leaves it pending, so the backward sends nothing
for it; an optimizer step (torch's: it reduces the pending sums) equals one device's.
Each family runs through patched ``F`` calls (conv, norms, attention, linear) and aten
rules (matmul, element-wise, embedding, PReLU) alike. Parameters that are Replicate
ShardTensors of the user's own are summed once too.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import _zoo

_TOL = dict(rtol=1e-10, atol=1e-12)  # float64


def _families():
    """name -> (model, input shape, the dim cut). Built on each rank, seeded."""
    import torch.nn as nn

    class Block(nn.Module):  # pre-norm transformer block: layer norm, attention, MLP
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(8), nn.LayerNorm(8)
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

        def forward(self, x):  # (B, S, 8), S cut
            h = self.ln1(x)
            x = x + self.att(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Head(nn.Module):  # linear + layer norm
        def __init__(self):
            super().__init__()
            self.lin, self.ln = nn.Linear(8, 5), nn.LayerNorm(5)

        def forward(self, x):
            return self.ln(self.lin(x))

    class Aten(nn.Module):  # no patched call: matmul and element-wise aten rules
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 6))
            self.b = nn.Parameter(torch.randn(6))
            self.g = nn.Parameter(torch.randn(6))

        def forward(self, x):
            return torch.tanh(x @ self.w + self.b) * self.g

    class Embed(nn.Module):  # embedding (aten), instance norm, PReLU's weight (aten)
        def __init__(self):
            super().__init__()
            self.emb, self.act = nn.Embedding(10, 8), nn.PReLU(8)
            self.norm = nn.InstanceNorm1d(8, affine=True)
            self.conv = nn.Conv1d(8, 4, 3, padding=2, dilation=2)

        def forward(self, ids):  # (B, S) ids, S cut
            h = self.emb(ids).transpose(1, 2)  # (B, 8, S)
            return self.conv(self.act(self.norm(h)))

    conv = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.SiLU(),
        nn.Conv2d(4, 4, 3, padding=1, stride=2),
        nn.BatchNorm2d(4),
        nn.ConvTranspose2d(4, 3, 2, stride=2),
    )
    return {
        "conv": (conv, (2, 2, 18, 5), 2),
        "block": (Block(), (2, 11, 8), 1),
        "head": (Head(), (2, 11, 8), 1),
        "aten": (Aten(), (2, 11, 8), 1),
        "embed": (Embed(), (2, 11), 1),
    }


FAMILIES = ["conv", "block", "head", "aten", "embed"]


def _check(family, mesh, placements, sizes, place_params, grad_type=None):
    """Run ``family`` on one device and cut (``placements``/``sizes`` on ``mesh``), its
    parameters placed by ``place_params(model)``; one SGD step each. Returns what differs
    (empty when exact) and the kinds of the backward's messages."""
    import copy

    from torch.distributed.tensor import DTensor

    import shardlab

    grad_type = grad_type or DTensor
    torch.manual_seed(0)
    model, shape, _ = _families()[family]
    model = model.double()
    g = torch.Generator().manual_seed(1)
    if family == "embed":
        inp = torch.randint(0, 10, shape, generator=g)
    else:
        inp = torch.randn(shape, dtype=torch.float64, generator=g)
    one = copy.deepcopy(model)
    ref = one(inp)
    ref.square().sum().backward()
    torch.optim.SGD(one.parameters(), lr=0.1).step()

    place_params(model)
    x = shardlab.distribute(inp, mesh, placements, sizes)
    bad = []
    with shardlab.patched():
        y = model(x)
        loss = y.square().sum()
        with shardlab.trace() as tr:
            loss.backward()
    if not torch.allclose(y.full_tensor(), ref.detach(), **_TOL):
        bad.append("output")
    for (name, p), q in zip(model.named_parameters(), one.parameters()):
        grad = p.grad
        if type(grad) is not grad_type:  # torch's type, never a ShardTensor
            bad.append(f"{name}.grad is {type(grad).__name__}")
            continue
        if not torch.allclose(grad.full_tensor(), q.grad, **_TOL):
            bad.append(f"{name}.grad")
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # reduces the pending sums
    for (name, p), q in zip(model.named_parameters(), one.parameters()):
        if not torch.allclose(p.full_tensor(), q.detach(), **_TOL):
            bad.append(f"{name} after a step")
    return bad, sorted({e.label for e in tr.events})


def _replicated(mesh):
    from torch.distributed.tensor import distribute_module

    return lambda model: distribute_module(model, mesh)


def _shard_tensor_params(mesh):
    """Every parameter a Replicate ShardTensor of its own (``shardlab.distribute``)."""
    from torch.distributed.tensor import Replicate

    import shardlab

    def place(model):
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                st = shardlab.distribute(p.detach(), mesh, [Replicate()])
                setattr(module, name, torch.nn.Parameter(st))

    return place


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_distribute_module_parameters_are_exact(ranks_for, world):
    """distribute_module's Replicate parameters, the input cut unevenly along H or the
    sequence: exact forward, gradients and step; the gradients of the parameters used only
    on a rank's rows stay pending, so nothing in the backward sums them (no
    ``redistribute backward``, no ``params backward``)."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        out = {}
        for family in FAMILIES:
            _, shape, dim = _families()[family]
            sizes = [_zoo.uneven(shape[dim], world)]
            out[family] = _check(family, mesh, [Shard(dim)], sizes, _replicated(mesh))
        return out

    for got in ranks_for(world).run(body):
        for family, (bad, labels) in got.items():
            assert bad == [], (family, bad)
            assert not [lb for lb in labels if "redistribute" in lb or "params" in lb], labels


def test_shard_tensor_parameters_are_exact(ranks_for):
    """Parameters that are Replicate ShardTensors (``shardlab.distribute``): their
    gradients (ShardTensors) are summed once, where the ops summed them twice (N x)."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import ShardTensor, this_rank

        mesh = this_rank().mesh
        out = {}
        for family in FAMILIES:
            _, shape, dim = _families()[family]
            sizes = [_zoo.uneven(shape[dim], 3)]
            place = _shard_tensor_params(mesh)
            out[family] = _check(family, mesh, [Shard(dim)], sizes, place, ShardTensor)[0]
        return out

    for got in ranks_for(3).run(body):
        for family, bad in got.items():
            assert bad == [], (family, bad)


def test_parameters_on_a_2d_mesh_and_on_a_sub_mesh(ranks_for):
    """A 2x2 mesh, the batch cut over "dp" and H / the sequence over "cp": parameters
    Replicate on the whole mesh, and Replicate on the sub-mesh ``mesh["cp"]`` (their
    gradient summed over "dp", which their mesh does not have, and pending over "cp")."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh_for((2, 2), names=("dp", "cp"))
        out = {}
        for family in FAMILIES:
            _, shape, dim = _families()[family]
            places, sizes = [Shard(0), Shard(dim)], [[1, 1], _zoo.uneven(shape[dim], 2)]
            for where, on in (("mesh", mesh), ("sub-mesh", mesh["cp"])):
                out[family, where] = _check(family, mesh, places, sizes, _replicated(on))
        return out

    for got in ranks_for(4).run(body):
        for key, (bad, _) in got.items():
            assert bad == [], (key, bad)


def test_fsdp_parameters_next_to_a_cut_input(ranks_for):
    """FSDP2's ``fully_shard`` over "dp" (parameters ``Shard(0)`` DTensors there,
    gathered for the forward), the input cut over the other mesh dim: the sharded
    gradients equal one device's (FSDP averages over "dp", each dp rank here sees the
    same batch)."""

    def body():
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh_for((2, 2), names=("dp", "cp"))
        out = {}
        for family in ("conv", "block"):
            _, shape, dim = _families()[family]
            sizes = [_zoo.uneven(shape[dim], 2)]

            def place(model):
                fully_shard(model, mesh=mesh["dp"])

            out[family] = _check(family, mesh["cp"], [Shard(dim)], sizes, place)
        return out

    for got in ranks_for(4).run(body):
        for family, (bad, _) in got.items():
            assert bad == [], (family, bad)


@pytest.mark.parametrize(
    "name", ["resnet", "vit", pytest.param("convnext", marks=pytest.mark.more_worlds)]
)
def test_library_models_with_distribute_module(ranks_for, name):
    """transformers models, unchanged, every parameter and buffer made Replicate by
    ``distribute_module``, the sequence or the image rows cut unevenly over 3 ranks: the
    loss and every gradient equal one device (float64; a decoder's loss in float32)."""
    pytest.importorskip("transformers")

    def body():
        import copy

        from torch.distributed.tensor import DTensor, Shard, distribute_module

        import shardlab

        mesh = shardlab.this_rank().mesh
        gen = torch.Generator().manual_seed(3)
        if name in _zoo.DECODERS:
            model = _zoo.decoder(name).double()
            x = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=gen)
            dim, kw = 1, lambda t: dict(input_ids=t, labels=x)
        else:
            model = _zoo.vision(name)[0].double()
            x = torch.randn(_zoo.IMAGE, dtype=torch.float64, generator=gen)
            dim, kw = 2, lambda t: dict(pixel_values=t, labels=torch.tensor([1, 2]))
        one = copy.deepcopy(model)
        ref = one(**kw(x)).loss
        ref.backward()
        distribute_module(model, mesh)
        with shardlab.patched():
            cut = shardlab.distribute(x, mesh, [Shard(dim)], [_zoo.uneven(x.shape[dim], 3)])
            loss = model(**kw(cut)).loss
            loss.backward()
        bad = [] if torch.allclose(loss.full_tensor(), ref, rtol=1e-6) else ["loss"]
        for (n, p), q in zip(model.named_parameters(), one.parameters()):
            if type(p.grad) is not DTensor:
                bad.append(f"{n}.grad is {type(p.grad).__name__}")
            elif not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9):
                bad.append(n)
        return bad

    assert ranks_for(3).run(body) == [[]] * 3
