"""Activation checkpointing around sharded ops: exact, and never a message matched to
another one (``shardlab/comm/recompute.py``).

Random stacks of unchanged torch modules (halo convolutions, transposed convolutions,
pooling, interpolation, norms with all-reduces, ring attention, neighborhood attention)
on inputs cut with random uneven sizes (empty shards, shards smaller than the halo),
worlds 2-4, each wrapped in ``torch.utils.checkpoint`` (reentrant, non-reentrant, nested,
``checkpoint_sequential``, two checkpointed models in one step), against the same
modules on one device without checkpointing: output and every gradient, float64.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from tests.models import _zoo
from tests.tensor._cases import random_sizes

C = 3  # channels of the image stacks


class _NA1d(nn.Module):
    """Neighborhood attention over (B, L, E): heads of 2, window 3 (NATTEN's na1d)."""

    def __init__(self, e):
        super().__init__()
        self.qkv = nn.Linear(e, 3 * e)

    def forward(self, x):
        from shardlab.ops.neighborhood import na1d

        b, length, e = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, e // 2, 2).unbind(2)
        return x + na1d(q, k, v, kernel_size=3).reshape(b, length, e)


class _Causal(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention (the ring)."""

    def __init__(self, e):
        super().__init__()
        self.qkv, self.out = nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, e // 2).permute(2, 0, 3, 1, 4).unbind(0)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, e))


IMAGE_OPS = {
    "conv3": lambda: nn.Conv2d(C, C, 3, padding=1),
    "conv5": lambda: nn.Conv2d(C, C, 5, padding=2),
    "conv_s2": lambda: nn.Conv2d(C, C, 3, stride=2, padding=1),
    "conv_reflect": lambda: nn.Conv2d(C, C, 3, padding=1, padding_mode="reflect"),
    "convT": lambda: nn.ConvTranspose2d(C, C, 4, stride=2, padding=1),
    "maxpool": lambda: nn.MaxPool2d(3, stride=1, padding=1),
    "avgpool": lambda: nn.AvgPool2d(2, ceil_mode=True),
    "up": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "bn": lambda: nn.BatchNorm2d(C),
    "gn": lambda: nn.GroupNorm(1, C),
    "in": lambda: nn.InstanceNorm2d(C, affine=True),
    "relu": nn.ReLU,
    "gelu": nn.GELU,
}
SEQ_OPS = {
    "encoder": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
    "causal": lambda: _Causal(4),
    "na": lambda: _NA1d(4),
    "ln": lambda: nn.LayerNorm(4),
    "relu": nn.ReLU,
    "gelu": nn.GELU,
}
MODES = ["reentrant", "non-reentrant", "nested", "sequential"]


def _case(seed: int, world: int):
    """A random stack, its input's length and uneven sizes, and a checkpoint mode."""
    rng = random.Random(seed)
    seq = rng.random() < 0.35
    ops = SEQ_OPS if seq else IMAGE_OPS
    names = [rng.choice([n for n in ops if n not in ("relu", "gelu", "ln")]) for _ in range(3)]
    names.insert(rng.randint(0, 3), rng.choice(["relu", "gelu"]))
    length = rng.randint(world, 3 * world + 4)
    sizes = random_sizes(rng, length, world)
    if rng.random() < 0.3:  # a shard smaller than any halo, and an empty one
        sizes = [1, 0] + [length - 1] + [0] * (world - 3) if world >= 3 else [1, length - 1]
    return seq, names, sizes, rng.choice(MODES), rng.random() < 0.5, rng.random() < 0.5


def _build(seq, names, seed):
    torch.manual_seed(seed)
    ops = SEQ_OPS if seq else IMAGE_OPS
    return nn.Sequential(*[ops[n]() for n in names]).double()


def _run_checkpointed(model, x, mode, two):
    """``model`` in checkpointed segments; ``two``: a second segment (the same modules
    again, a residual around them) checkpointed apart, as two models in one step."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    def once(x):
        if mode == "reentrant":
            return checkpoint(model, x, use_reentrant=True)
        if mode == "non-reentrant":
            return checkpoint(model, x, use_reentrant=False)
        if mode == "sequential":
            return checkpoint_sequential(model, 2, x, use_reentrant=False)
        half = nn.Sequential(*list(model)[: len(model) // 2])  # nested: a block in a block
        rest = nn.Sequential(*list(model)[len(model) // 2 :])

        def outer(x):
            return rest(checkpoint(half, x, use_reentrant=False))

        return checkpoint(outer, x, use_reentrant=False)

    y = once(x)
    if two:
        y = y.sum() + once(x).sum()
    return y


def _reference(model, g, two):
    x = g.clone().requires_grad_()
    y = model(x)
    if two:
        y = y.sum() + model(x).sum()
    y.sum().backward() if y.ndim else y.backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def _body(seed: int):
    def body():
        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        seq, names, sizes, mode, two, on_shards = _case(seed, mesh.size())
        length = sum(sizes)
        shape = (2, length, 4) if seq else (2, C, length, 5)
        dim = 1 if seq else 2
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        model = _build(seq, names, seed)
        model.train()
        want_y, want_gx, want_gp = _reference(model, g, two)
        model.zero_grad(set_to_none=True)
        from torch.distributed.tensor import Shard

        x = g.clone().requires_grad_()
        with shardlab.patched():
            y = _run_checkpointed(model, distribute(x, mesh, [Shard(dim)], [sizes]), mode, two)
            got_y = y.full_tensor()
            root = y if on_shards else got_y  # loss.backward() on a ShardTensor, or plain
            (root.sum() if root.ndim else root).backward()
        ok = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-11)  # noqa: E731
        bad = [n for n, p in model.named_parameters() if not ok(p.grad, want_gp[n])]
        return {
            "case": (names, sizes, mode, two, on_shards),
            "out": ok(got_y.detach(), want_y),
            "input grad": ok(x.grad, want_gx),
            "params": bad,
        }

    return body


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("seed", range(12))
def test_checkpointed_stacks_equal_one_device(ranks_for, world, seed):
    for res in ranks_for(world).run(_body(1000 * world + seed)):
        assert res["out"] and res["input grad"] and res["params"] == [], res


def test_the_reported_case_conv_relu_conv_on_sizes_6_2_4_7(ranks_for):
    """The issue's case: gloo aborted every rank ("384 vs 144") in backward."""

    def body():
        from torch.distributed.tensor import Shard
        from torch.utils.checkpoint import checkpoint

        import shardlab
        from shardlab import distribute, this_rank

        torch.manual_seed(0)
        block = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 5, padding=2)
        ).double()
        g = torch.randn(1, 3, 19, 5, dtype=torch.float64)
        x = g.clone().requires_grad_()
        block(x).sum().backward()
        want = x.grad, block[0].weight.grad.clone()
        block.zero_grad(set_to_none=True)
        xs = g.clone().requires_grad_()
        with shardlab.patched():
            y = checkpoint(block, distribute(xs, this_rank().mesh, [Shard(2)], [[6, 2, 4, 7]]),
                           use_reentrant=False)  # fmt: skip
            y.full_tensor().sum().backward()
        return torch.allclose(xs.grad, want[0]) and torch.allclose(block[0].weight.grad, want[1])

    assert ranks_for(4).run(body) == [True] * 4


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["vit", "swin", "segformer", "mobilevit"])
def test_transformers_gradient_checkpointing_enable_vision(ranks_for, name, reentrant):
    """A library model's own switch (``gradient_checkpointing_enable``), image cut along H."""
    pytest.importorskip("transformers")

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        model, kind = _zoo.vision(name)
        model = model.double().train()
        if not model.supports_gradient_checkpointing:
            return "unsupported"
        g = torch.randn(_zoo.IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        b, _, h, w = _zoo.IMAGE
        labels = torch.randint(0, 3, (b, h, w)) if kind == "seg" else torch.tensor([1] * b)
        xr = g.clone().requires_grad_()
        model(pixel_values=xr, labels=labels).loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        x = g.clone().requires_grad_()
        sizes = _zoo.uneven(_zoo.IMAGE[2], mesh.size())
        with shardlab.patched():
            out = model(pixel_values=distribute(x, mesh, [Shard(2)], [sizes]), labels=labels)
            out.loss.backward()
        bad = [
            n for n, v in want.items() if not torch.allclose(model.get_parameter(n).grad, v,
                                                             rtol=1e-9, atol=1e-12)
        ]  # fmt: skip
        return torch.allclose(x.grad, xr.grad, rtol=1e-9, atol=1e-12) and bad == []

    res = ranks_for(3).run(body)
    if res[0] == "unsupported":
        pytest.skip(f"{name} has no gradient checkpointing in transformers")
    assert res == [True] * 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_transformers_gradient_checkpointing_enable_llama(ranks_for, reentrant):
    """A decoder (RoPE, GQA, the ring) with its layers checkpointed, sequence cut."""
    pytest.importorskip("transformers")

    def body():
        import shardlab
        from shardlab import this_rank
        from shardlab.lm import shard_batch

        mesh = this_rank().mesh
        model = _zoo.decoder("llama", num_hidden_layers=2).double().train()
        ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
        ref = model(input_ids=ids)
        ref.logits.sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        with shardlab.patched():
            batch = shard_batch(mesh, ids, causal=True)
            out = model(**batch)
            logits = out.logits.full_tensor()
            logits.sum().backward()
        bad = [
            n for n, v in want.items() if not torch.allclose(model.get_parameter(n).grad, v,
                                                             rtol=1e-9, atol=1e-12)
        ]  # fmt: skip
        return torch.allclose(logits, ref.logits, rtol=1e-9, atol=1e-12) and bad == []

    assert ranks_for(3).run(body) == [True] * 3


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_autograd_grad_of_a_model_with_its_plain_parameters(ranks_for, world, checkpointed):
    """``torch.autograd.grad(loss, [x, *model.parameters()])`` with x a ShardTensor: the
    plain parameters are the ones the graph used (they were lifted next to x as new
    tensors, "not used in the graph"), equal to one device; also with the model's own
    (non-reentrant) gradient checkpointing, which recomputes inside ``grad``."""
    pytest.importorskip("transformers")

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        model, _ = _zoo.vision("vit" if checkpointed else "resnet")  # (resnet: no checkpointing)
        model = model.double().train()
        params = [p for p in model.parameters() if p.requires_grad]
        g = torch.randn(_zoo.IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        labels = torch.tensor([1] * _zoo.IMAGE[0])
        xr = g.clone().requires_grad_()
        want = torch.autograd.grad(model(pixel_values=xr, labels=labels).loss, [xr, *params])
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        x = shardlab.distribute(g.clone(), mesh, [Shard(2)], [_zoo.uneven(_zoo.IMAGE[2], world)])
        x.requires_grad_()
        with shardlab.patched():
            got = torch.autograd.grad(model(pixel_values=x, labels=labels).loss, [x, *params])
        assert all(p.grad is None for p in params)  # grad() accumulates nothing
        gx = got[0].full_tensor()
        same = [torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got[1:], want[1:])]
        return isinstance(got[0], shardlab.ShardTensor), torch.allclose(gx, want[0]), all(same)

    assert ranks_for(world).run(body) == [(True, True, True)] * world


def test_autograd_grad_arguments_as_torch(ranks_for):
    """``grad_outputs`` for a non-scalar ShardTensor output, ``allow_unused`` (None, or
    torch's error without it), ``materialize_grads`` (zeros), a dict of inputs,
    ``retain_graph`` (a second call on the same graph) and ``create_graph`` (a
    differentiable result), each against the same call on one device, on 2 ranks."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        torch.manual_seed(0)
        w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        unused = torch.randn(2, requires_grad=True)
        g = torch.randn(2, 5, 3, dtype=torch.float64)
        dy = torch.randn(2, 5, 4, dtype=torch.float64)

        def shard(t):
            return shardlab.distribute(t, mesh, [Shard(1)], [[3, 2]])

        x0 = g.clone().requires_grad_()
        y0 = F.linear(x0, w).tanh()
        want = torch.autograd.grad(y0, [x0, w], dy, retain_graph=True)
        x = shard(g.clone()).requires_grad_()
        out = {}
        with shardlab.patched():
            y = F.linear(x, w).tanh()
            got = torch.autograd.grad(y, [x, w], shard(dy), retain_graph=True)
            out["grad_outputs"] = torch.allclose(got[0].full_tensor(), want[0]) and torch.allclose(
                got[1], want[1]
            )
            try:  # (a dict of inputs: 2.13 takes it, 2.11 refuses it, as the plain call)
                torch.autograd.grad(y0, {"w": w}, dy, retain_graph=True)
            except RuntimeError:
                try:
                    torch.autograd.grad(y, {"w": w}, shard(dy), retain_graph=True)
                    out["dict, retained"] = "accepted where torch refuses it"
                except RuntimeError:
                    out["dict, retained"] = True
            else:
                again = torch.autograd.grad(y, {"w": w}, shard(dy), retain_graph=True)
                out["dict, retained"] = list(again) == ["w"] and torch.allclose(again["w"], want[1])
            try:
                torch.autograd.grad(y, [w, unused], shard(dy), retain_graph=True)
                out["unused"] = "no error"
            except RuntimeError as e:
                out["unused"] = "not have been used in the graph" in str(e)
            none = torch.autograd.grad(y, [w, unused], shard(dy), retain_graph=True,
                                       allow_unused=True)  # fmt: skip
            out["allow_unused"] = none[1] is None
            zeros = torch.autograd.grad(y, [w, unused], shard(dy), retain_graph=True,
                                        materialize_grads=True)  # fmt: skip
            out["materialize_grads"] = torch.equal(zeros[1], torch.zeros(2))
            (gw,) = torch.autograd.grad(y, w, shard(dy), create_graph=True)
            out["create_graph"] = gw.requires_grad and torch.allclose(gw, want[1])
        return out

    for res in ranks_for(2).run(body):
        assert res == {k: True for k in res} and len(res) == 6, res


@pytest.mark.parametrize("world", [1, 3])
def test_an_input_distributed_once_trains_two_steps(ranks_for, world):
    """The fence's token (an empty saved tensor) made every Function it guards refuse a
    second backward: a distributed input that requires grad, used in two steps, raised
    "backward through the graph a second time", where torch's own slice of it works. Now
    x.grad and the weights' gradients add up as on one device; a second backward through
    one graph (a conv saved its input) still raises torch's error, on every rank."""

    def body():
        import copy

        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute

        mesh = shardlab.this_rank().mesh
        n = mesh.size()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
        net = net.double()
        one = copy.deepcopy(net)
        x = torch.randn(2, 3, 11, 6, dtype=torch.float64)
        x1, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        cut = distribute(xs, mesh, [Shard(2)], [[11 - 3 * (n - 1)] + [3] * (n - 1)])
        for _ in range(2):
            with shardlab.patched():
                loss = net(cut).pow(2).mean()
            loss.backward()
            one(x1).pow(2).mean().backward()
        same = torch.allclose(xs.grad, x1.grad, rtol=1e-12, atol=1e-14) and all(
            torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-14)
            for a, b in zip(net.parameters(), one.parameters())
        )
        with shardlab.patched():
            loss = net(cut).pow(2).mean()
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        return same

    assert ranks_for(world).run(body) == [True] * world


@pytest.mark.slow
@pytest.mark.every_torch
def test_compiled_autograd_says_it_cannot_trace_a_sharded_backward(ranks_for):
    """Compiled autograd around the backward of a compiled, sharded ``transformers`` Llama:
    shardlab's error on every rank (it failed with a ``TypeError`` on a symbolic size deep
    in a layout), for a backward from the ShardTensor loss and from plain tensors made of
    it (``full_tensor()``, ``to_local()``); the same step without it then runs and equals
    the eager step."""
    pytest.importorskip("transformers")

    def body():
        from torch._dynamo import compiled_autograd
        from torch.distributed.tensor import Shard

        import shardlab
        from tests.models import _zoo
        from tests.tensor.test_traced import _zoo_batch, _zoo_step

        mesh = shardlab.this_rank().mesh
        model, full, labels, dim = _zoo_batch("llama")
        cut = (mesh, [Shard(dim)], _zoo.uneven(full["input_ids"].shape[dim], mesh.size()))
        said = None
        torch._dynamo.reset()
        with shardlab.patched():
            eager = _zoo_step(model, full, labels, cut)
            compiled = torch.compile(model, backend="aot_eager")
            try:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    _zoo_step(compiled, full, labels, cut)
            except NotImplementedError as exc:
                said = "compiled autograd" in str(exc) and "_disable()" in str(exc)
            model.zero_grad(set_to_none=True)
            for root in (
                lambda out: out.loss.full_tensor(),
                lambda out: out.logits.to_local().sum(),
            ):
                xs = {k: shardlab.distribute(v, *cut) for k, v in full.items()}
                loss = root(compiled(**xs, labels=shardlab.distribute(labels, *cut)))
                try:  # a plain tensor's backward, through ShardTensors
                    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                        loss.backward()
                    said = False
                except NotImplementedError as exc:
                    said = said and "compiled autograd" in str(exc) and "_disable()" in str(exc)
                model.zero_grad(set_to_none=True)
            logits, grads = _zoo_step(compiled, full, labels, cut)
        same = torch.allclose(logits, eager[0]) and all(
            torch.allclose(a, b) for a, b in zip(grads, eager[1])
        )
        return said, same

    assert ranks_for(2).run(body) == [(True, True)] * 2
