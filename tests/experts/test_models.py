"""Whole ``transformers`` MoE models, unchanged, expert-parallel: Mixtral and Qwen2-MoE (2
layers, 4 experts, top-2, random weights) on 2 and 4 ranks, each rank its own sequences
(the batch cut unevenly). One training step (forward, backward, AdamW) equals one device,
and sends nothing beyond each MoE layer's all-to-alls, the loss's one all-reduce and the
gradients' one all-reduce. With the tokens cut along the sequence instead, the routing
gathers no whole tensor (without the style it does)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.experts import _moe  # noqa: E402

BATCH = {2: [3, 2], 4: [2, 1, 1, 1]}  # sequences per rank
SEQ = 7
PLAN = {"model.layers.*.mlp": None}  # every layer's MoE block (the style filled in below)


def _grads_and_step(model):
    """(gradients, parameters after one AdamW step), as plain tensors of this rank."""

    def mine(t):
        return t.to_local() if hasattr(t, "to_local") else t

    grads = {n: mine(p.grad).clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    return grads, {n: mine(p).detach().clone() for n, p in model.named_parameters()}


def _step_body(family: str, sizes: list[int]):
    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        ids = torch.randint(0, _moe.VOCAB, (sum(sizes), SEQ),
                            generator=torch.Generator().manual_seed(3))  # fmt: skip

        def loss_of(logits, ids):  # next-token cross entropy, in float64
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        one = _moe.model(family)
        ref_logits = one(input_ids=ids).logits
        ref_loss = loss_of(ref_logits, ids)
        ref_loss.backward()
        want_grads, want_params = _grads_and_step(one)

        model = _moe.model(family)
        plan = dict.fromkeys(PLAN, ExpertParallel())
        parallelize_module(model, me.mesh, plan)
        with shardlab.patched(), shardlab.gathers("raise"), shardlab.trace() as t:
            mine = shardlab.distribute(ids, me.mesh, [Shard(0)], [sizes])  # my sequences
            logits = model(input_ids=mine).logits
            loss = loss_of(logits, mine)
            loss.backward()
            got_grads, got_params = _grads_and_step(model)

        local = model.model.layers[0].mlp.experts.num_experts
        experts = slice(me.rank * local, (me.rank + 1) * local)

        def bad(got, want):
            return sorted(
                n
                for n in want
                if not _moe.close(got[n], want[n][experts] if ".experts." in n else want[n])
            )

        return {
            "logits": _moe.close(logits.full_tensor(), ref_logits.detach()),
            "loss": _moe.close(loss.full_tensor(), ref_loss.detach()),
            "grads": bad(got_grads, want_grads),
            "params": bad(got_params, want_params),
            "events": [(e.kind, e.label, e.bytes) for e in t.events],
            "tokens": sizes[me.rank] * SEQ,
        }

    return body


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_an_expert_parallel_training_step_equals_one_device(ranks_for, family, world):
    row = _moe.HIDDEN * 8  # one float64 token row
    for res in ranks_for(world).run(_step_body(family, BATCH[world])):
        assert res["logits"] and res["loss"], res
        assert res["grads"] == [] and res["params"] == [], res
        events = res["events"]
        a2a = [e for e in events if e[0] == "all_to_all"]
        assert len(a2a) == 2 * 5, events  # per MoE layer: 3 forward (1 of counts), 2 backward
        dispatch = [e[2] for e in a2a if e[1] == "experts.dispatch forward"]
        assert dispatch == [res["tokens"] * _moe.K * row] * 2, events
        rest = [(e[0], e[1]) for e in events if e[0] != "all_to_all"]
        assert rest == [("all_reduce", "cross_entropy forward"), ("all_reduce", "params backward")]


def _sequence_body(sizes: list[int]):
    def body():
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        ids = torch.randint(0, _moe.VOCAB, (2, sum(sizes)),
                            generator=torch.Generator().manual_seed(3))  # fmt: skip
        model = _moe.model("mixtral", torch.float32)  # transformers' grouped_mm experts
        one = _moe.model("mixtral", torch.float32)
        ref = one(input_ids=ids, labels=ids)
        ref.loss.backward()

        before = None
        with shardlab.patched():
            mine = shardlab.distribute(ids, me.mesh, [Shard(1)], [sizes])  # along S
            hidden = model.model.embed_tokens(mine)
            try:
                with shardlab.gathers("raise"):
                    model.model.layers[0].mlp(hidden)
            except shardlab.GatherError as e:
                before = str(e)
        model.zero_grad(set_to_none=True)
        parallelize_module(model, me.mesh, dict.fromkeys(PLAN, ExpertParallel()))
        with shardlab.patched(), shardlab.gathers("raise"), shardlab.trace() as t:
            out = model(input_ids=mine, labels=mine)  # the model's own loss
            out.loss.backward()
        local = model.model.layers[0].mlp.experts.num_experts
        experts = slice(me.rank * local, (me.rank + 1) * local)
        bad = []
        for n, p in model.named_parameters():
            g = p.grad.to_local() if ".experts." in n else p.grad
            want = dict(one.named_parameters())[n].grad
            want = want[experts] if ".experts." in n else want
            if not torch.allclose(g, want, rtol=1e-4, atol=1e-6):
                bad.append(n)
        return {
            "gathered without the style": before,
            "logits": torch.allclose(out.logits.full_tensor(), ref.logits, rtol=1e-5, atol=1e-6),
            "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-5),
            "grads": bad,
            "labels": sorted({e.label.split(" ")[0] for e in t.events}),
        }

    return body


@pytest.mark.parametrize("world", [2, 4])
def test_with_the_sequence_cut_the_routing_gathers_no_whole_tensor(ranks_for, world):
    """Mixtral, float32, its tokens cut unevenly along the sequence: the stock block's
    routing (a sort over every token) gathers them all; expert-parallel, the whole model
    runs forward and backward under ``gathers("raise")``, equal to one device."""
    sizes = {2: [5, 4], 4: [4, 1, 2, 2]}[world]
    for res in ranks_for(world).run(_sequence_body(sizes)):
        assert "sort has no rule" in res["gathered without the style"], res
        assert res["logits"] and res["loss"] and res["grads"] == [], res
        assert {"experts.counts", "experts.dispatch", "experts.combine"} <= set(res["labels"])


def test_activation_checkpointing_sends_each_layers_forward_again(ranks_for):
    """``gradient_checkpointing_enable()``: each decoder layer's forward runs again in the
    backward, all-to-alls included, on every rank at the same point; still one device's
    gradients."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me, sizes = shardlab.this_rank(), BATCH[2]
        ids = torch.randint(0, _moe.VOCAB, (sum(sizes), SEQ),
                            generator=torch.Generator().manual_seed(3))  # fmt: skip

        def loss_of(logits, ids):
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        one = _moe.model("mixtral")
        loss_of(one(input_ids=ids).logits, ids).backward()
        model = _moe.model("mixtral")
        model.gradient_checkpointing_enable()
        parallelize_module(model, me.mesh, dict.fromkeys(PLAN, ExpertParallel()))
        with shardlab.patched(), shardlab.trace() as t:
            mine = shardlab.distribute(ids, me.mesh, [Shard(0)], [sizes])
            loss_of(model(input_ids=mine).logits, mine).backward()
        experts = slice(me.rank * 2, me.rank * 2 + 2)
        want = dict(one.named_parameters())
        bad = [
            n
            for n, p in model.named_parameters()
            if not _moe.close(p.grad.to_local() if ".experts." in n else p.grad,
                              want[n].grad[experts] if ".experts." in n else want[n].grad)
        ]  # fmt: skip
        return bad, [e.label for e in t.events if e.label.startswith("experts.")]

    forward = ["experts.counts forward", "experts.dispatch forward", "experts.combine forward"]
    backward = ["experts.combine backward", "experts.dispatch backward"]
    for bad, labels in ranks_for(2).run(body):
        assert bad == [], bad
        assert labels == forward * 2 + (forward + backward) * 2, labels


def test_on_a_2d_mesh_experts_over_one_dim_the_sequence_cut_over_the_other(ranks_for):
    """Mesh (2, 2) ``("ep", "sp")``: the experts spread over ``ep``, each rank its own
    sequences along ``ep`` and its own positions along ``sp`` (sequence parallelism: the
    attention's ring runs over ``sp``). The all-to-alls run over ``ep`` only; the experts'
    gradients are summed over ``sp`` (``experts.weights backward``: one all-reduce per
    layer, of all its expert weights), every other gradient over both dims; one training
    step equals one device."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        mesh = shardlab.this_rank().mesh_for((2, 2), names=("ep", "sp"))
        ids = torch.randint(0, _moe.VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))

        def loss_of(logits, ids):
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        one = _moe.model("mixtral")
        ref = one(input_ids=ids).logits
        loss_of(ref, ids).backward()
        model = _moe.model("mixtral")
        parallelize_module(model, mesh["ep"], dict.fromkeys(PLAN, ExpertParallel()))
        with shardlab.patched(), shardlab.trace(mesh) as t:
            mine = shardlab.distribute(ids, mesh, [Shard(0), Shard(1)], [[2, 1], [5, 4]])
            logits = model(input_ids=mine).logits
            loss_of(logits, mine).backward()
        ep = mesh.get_coordinate()[0]
        want = dict(one.named_parameters())
        bad = [
            n
            for n, p in model.named_parameters()
            if not _moe.close(p.grad.to_local() if ".experts." in n else p.grad,
                              want[n].grad[2 * ep : 2 * ep + 2] if ".experts." in n
                              else want[n].grad)
        ]  # fmt: skip
        axes = {
            e.label: mesh.mesh_dim_names[e.mesh_dim]
            for e in t.events
            if e.label.startswith("experts.") and e.mesh_dim is not None
        }
        # the experts' gradients: one all-reduce per layer, all their weights' bytes
        sums = [e.bytes for e in t.events if e.label == "experts.weights backward"]
        layers = model.config.num_hidden_layers
        per_layer = sum(p.to_local().nbytes for p in model.model.layers[0].mlp.experts.parameters())
        return _moe.close(logits.full_tensor(), ref.detach()), bad, axes, sums, [per_layer] * layers

    for same, bad, axes, sums, want in ranks_for(4).run(body):
        assert same and bad == [], bad
        assert sums == want, (sums, want)
        assert axes == {
            **dict.fromkeys(
                ["experts.counts forward", "experts.dispatch forward", "experts.combine forward",
                 "experts.combine backward", "experts.dispatch backward"], "ep"),
            "experts.weights backward": "sp",
        }, axes  # fmt: skip


def test_explain_puts_each_layers_all_to_alls_on_its_experts_module(ranks_for):
    """``shardlab.explain`` on an expert-parallel Mixtral: each MoE layer's ``experts``
    module has its three forward all-to-alls (counts, dispatch, combine) and its two
    backward ones; no other module has an all-to-all; the gradients' all-reduce has its
    own row."""

    def body():
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        ids = torch.randint(0, _moe.VOCAB, (5, 4), generator=torch.Generator().manual_seed(3))
        model = _moe.model("mixtral")
        parallelize_module(model, me.mesh, dict.fromkeys(PLAN, ExpertParallel()))
        with shardlab.patched():
            mine = shardlab.distribute(ids, me.mesh, [Shard(0)], [BATCH[2]])
            ex = shardlab.explain(model, input_ids=mine, labels=mine)
        return [
            (r.name, r.phase, [(e[0], e[4]) for e in r.events if e[0] != "all_reduce"])
            for r in ex.rows(me.rank)
            if r.events
        ], [r.name for r in ex.rows(me.rank) if any(e[0] == "all_reduce" for e in r.events)]

    fwd = [("all_to_all", f"experts.{n} forward") for n in ("counts", "dispatch", "combine")]
    bwd = [("all_to_all", f"experts.{n} backward") for n in ("combine", "dispatch")]
    for rows, reduces in ranks_for(2).run(body):
        moe = [r for r in rows if r[2]]
        assert moe == [
            ("model.layers.0.mlp.experts", "forward", fwd),
            ("model.layers.1.mlp.experts", "forward", fwd),
            ("model.layers.1.mlp.experts", "backward", bwd),
            ("model.layers.0.mlp.experts", "backward", bwd),
        ], rows
        assert reduces[-1] == "(parameters' gradients)", reduces
