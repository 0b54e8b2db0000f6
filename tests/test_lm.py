"""Language models end to end: ``shardlab.lm.shard_batch`` + unchanged decoders.

transformers' Llama and Qwen2 (RoPE, GQA, RMSNorm, SDPA) and a GPT in plain torch
(``shardlab.demo.gpt``), float64, input ids / padding masks / labels cut along the
sequence with uneven sizes, contiguous or head-tail: logits, loss and every gradient
equal one device. Then the 2-D mesh: sequence x torch's tensor parallelism
(``parallelize_module`` on ``mesh["tp"]``) with the vocab-parallel loss.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import _zoo

pytest.importorskip("transformers")


def _model(name):
    if name == "gpt":
        from shardlab.demo.gpt import TinyGPT

        torch.manual_seed(0)
        return TinyGPT(vocab=_zoo.VOCAB, dim=16, heads=4, layers=1, max_len=64).double()
    return _zoo.decoder(name).double()


def _run(model, name, **batch):
    out = model(**batch)
    return (out[0], out[1]) if name == "gpt" else (out.logits, out.loss)


def _batch(pad: bool):
    ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
    mask, labels = torch.ones_like(ids), ids.clone()
    if pad:
        mask[0, :4] = 0  # left padding
        mask[1, -3:] = 0  # right padding
        labels[mask == 0] = -100
    return ids, mask, labels


def _body(name):
    def body():
        import shardlab
        from shardlab import this_rank
        from shardlab.lm import shard_batch
        from shardlab.ops.attention import unbalance

        mesh = this_rank().mesh
        res = {}
        for head_tail in (False, True):
            for pad in (False, True):
                model = _model(name)
                ids, mask, labels = _batch(pad)
                ref_mask = mask if name != "gpt" else _gpt_mask(mask)
                ref_logits, ref_loss = _run(
                    model, name, input_ids=ids, attention_mask=ref_mask, labels=labels
                )
                ref_loss.backward()
                want = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                with shardlab.patched(), shardlab.trace() as t:
                    batch = shard_batch(mesh, ids, mask, labels, head_tail=head_tail, causal=True)
                    logits, loss = _run(model, name, **batch)
                    loss.backward()
                full = logits.full_tensor()
                if head_tail:
                    full = unbalance(full, mesh.size(), dims=(1,))
                # transformers' loss upcasts the logits to float32 (logits.float())
                tol = dict(rtol=1e-5, atol=1e-7) if name != "gpt" else dict(rtol=1e-9, atol=1e-11)
                res[(head_tail, pad)] = {
                    "logits": torch.allclose(full, ref_logits, rtol=1e-9, atol=1e-11),
                    "loss": torch.allclose(loss.full_tensor(), ref_loss, **tol),
                    "bad grads": [
                        n
                        for n, p in model.named_parameters()
                        if type(p.grad) is not torch.Tensor
                        or not torch.allclose(p.grad, want[n], **tol)
                    ],
                    "fallbacks": sorted({e.label for e in t.events if "fallback" in e.label}),
                    "mask rows": _mask_rows(batch),
                }
        return res

    return body


def _gpt_mask(mask):
    """The (B, 1, S, S) boolean mask a decoder builds: causal and key not padded."""
    s = mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return causal[None, None] & mask.bool()[:, None, None, :]


def _mask_rows(batch):
    m = batch.get("attention_mask")
    return None if m is None else tuple(m.to_local().shape)


@pytest.mark.parametrize(
    "name,world", [("llama", 2), ("llama", 4), ("qwen2", 3), ("gpt", 2), ("gpt", 3), ("gpt", 4)]
)
def test_decoders_with_padding_and_head_tail_equal_one_device(ranks_for, name, world):
    per_rank = ranks_for(world).run(_body(name))
    for rank, res in enumerate(per_rank):
        for case, r in res.items():
            assert r["logits"] and r["loss"], (rank, case, r)
            assert r["bad grads"] == [] and r["fallbacks"] == [], (rank, case, r)
            head_tail, pad = case
            if pad or head_tail:  # the 4-D mask: my query rows only, every key column
                b, s = _zoo.TOKENS
                assert r["mask rows"][0] == b and r["mask rows"][3] == s
                assert r["mask rows"][2] < s, r
            else:
                assert r["mask rows"] is None  # causal: the decoder passes is_causal


def _text_body(name):
    def body():
        import shardlab
        from shardlab import this_rank
        from shardlab.lm import shard_batch

        mesh = this_rank().mesh
        res = {}
        for pad in (False, True):
            model = _zoo.text(name).double()
            ids, mask, labels = _batch(pad)
            ref = model(input_ids=ids, attention_mask=mask, labels=labels)
            ref.loss.backward()
            want = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            sizes = _zoo.uneven(_zoo.TOKENS[1], mesh.size())
            with shardlab.patched(), shardlab.trace() as t:
                batch = shard_batch(mesh, ids, mask, labels, sizes=sizes)
                out = model(**batch)
                out.loss.backward()
            res[pad] = {
                "keys": sorted(batch),
                "logits": torch.allclose(
                    out.logits.full_tensor(), ref.logits, rtol=1e-9, atol=1e-11
                ),  # fmt: skip
                "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-5, atol=1e-7),
                "bad grads": [
                    n
                    for n, p in model.named_parameters()
                    if type(p.grad) is not torch.Tensor
                    or not torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7)
                ],
                "fallbacks": sorted({e.label for e in t.events if "fallback" in e.label}),
            }
        return res

    return body


@pytest.mark.parametrize("name", _zoo.TEXT)
def test_default_batch_is_what_one_device_gets_for_any_text_model(ranks_for, name):
    """``shard_batch`` without ``causal``: the model's own positions and masks, so models
    that are not RoPE decoders are exact too: bidirectional (BERT), positions counted from
    the padding (RoBERTa, OPT), ALiBi from the mask (BLOOM), learned positions (GPT-2);
    left and right padding, uneven sizes, 3 ranks, float64 against one device."""
    pytest.importorskip("transformers")
    for rank, res in enumerate(ranks_for(3).run(_text_body(name))):
        for pad, r in res.items():
            assert r["keys"] == ["attention_mask", "input_ids", "labels"], r
            assert r["logits"] and r["loss"], (rank, pad, r)
            assert r["bad grads"] == [] and r["fallbacks"] == [], (rank, pad, r)


def test_label_shift_moves_one_label_per_boundary_and_kv_bytes_are_the_ring(ranks_for):
    """Contiguous blocks, no padding: forward messages are the K/V ring (each rank
    receives every other rank's K and V once per layer) and the label shift (each rank
    but the last receives its right neighbour's first label: one int64)."""

    def body():
        import shardlab
        from shardlab import this_rank
        from shardlab.lm import shard_batch

        mesh = this_rank().mesh
        model = _model("gpt")
        ids, mask, labels = _batch(False)
        with shardlab.patched(), shardlab.trace() as t:
            batch = shard_batch(
                mesh, ids, labels=labels, sizes=_zoo.uneven(13, mesh.size()), causal=True
            )
            _, loss = _run(model, "gpt", **batch)
        me, sizes = mesh.get_coordinate()[0], _zoo.uneven(13, mesh.size())
        return {
            "ring": sum(e.bytes for e in t.events if e.kind == "recv" and "sdpa" in e.label),
            "other recv": [
                (e.label, e.bytes) for e in t.events if e.kind == "recv" and "sdpa" not in e.label
            ],
            "want ring": 2 * 2 * 4 * (13 - sizes[me]) * 4 * 8,  # K and V, B=2, H=4, D=4, f64
            "ce": [e.kind for e in t.events if "cross_entropy" in e.label],
        }

    per_rank = ranks_for(3).run(body)
    for rank, r in enumerate(per_rank):
        assert r["ring"] == r["want ring"], r
        assert r["other recv"] == ([] if rank == 2 else [(r["other recv"][0][0], 2 * 8)]), r
        assert r["ce"] == ["all_reduce"], r  # the global mean over the sequence


def _body_2d(name, world):
    def body():
        import copy

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import this_rank
        from shardlab.demo.gpt import tp_plan
        from shardlab.lm import shard_batch

        mesh = this_rank().mesh_for((world // 2, 2), names=("seq", "tp"))
        model = _model(name)
        ref = copy.deepcopy(model)
        ids, _, labels = _batch(False)
        ref_logits, ref_loss = _run(ref, name, input_ids=ids, labels=labels)
        ref_loss.backward()
        if name == "gpt":
            plan = tp_plan(model)
        else:
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
            for i in range(len(model.model.layers)):
                p = f"model.layers.{i}."
                plan.update({p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
                plan.update(
                    {p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel()}
                )
                plan.update(
                    {
                        p + "self_attn.o_proj": RowwiseParallel(),
                        p + "mlp.down_proj": RowwiseParallel(),
                    }
                )
        parallelize_module(model, mesh["tp"], plan)
        sizes = _zoo.uneven(13, world // 2)
        with shardlab.patched(), shardlab.trace(mesh) as t:
            batch = shard_batch(mesh, ids, labels=labels, mesh_dim=0, sizes=sizes, causal=True)
            logits, loss = _run(model, name, **batch)
            loss.backward()
        tol = dict(rtol=1e-5, atol=1e-7) if name != "gpt" else dict(rtol=1e-9, atol=1e-11)
        bad = []
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            dtensor = isinstance(p, DTensor)  # TP weights: DTensor gradients on mesh["tp"]
            if isinstance(p.grad, DTensor) != dtensor or not torch.allclose(g, q.grad, **tol):
                bad.append(n)
        ce = [(e.kind, e.mesh_dim) for e in t.events if "cross_entropy" in e.label]
        return {
            "logits": torch.allclose(logits.full_tensor(), ref_logits, rtol=1e-9, atol=1e-11),
            "loss": torch.allclose(loss.full_tensor(), ref_loss, **tol),
            "bad": bad,
            "axes": sorted({e.mesh_dim for e in t.events}, key=str),
            "no axis": sorted({(e.label, e.kind, e.group) for e in t.events if e.mesh_dim is None}),
            "ce": ce,
            "logits layout": str(logits.sharding.placements),
        }

    return body


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_sequence_times_tensor_parallel_on_a_2d_mesh(ranks_for, name):
    for r in ranks_for(4).run(_body_2d(name, 4)):
        assert r["logits"] and r["loss"] and r["bad"] == [], r
        assert r["axes"] == [0, 1], r["no axis"]  # every message names its mesh axis
        # loss parallel: max and (sum exp, target logit) over "tp"; the mean over "seq"
        assert r["ce"] == [("all_reduce", 1), ("all_reduce", 1), ("all_reduce", 0)], r
        assert r["logits layout"] == "(Shard(dim=1), Shard(dim=2))", r


def _errors(fn):
    def body():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
        return None

    return body


def _short():
    from shardlab import this_rank
    from shardlab.lm import shard_batch

    ids = torch.zeros(1, 2, dtype=torch.long)
    shard_batch(this_rank().mesh, ids)


def _mismatched():
    from shardlab import this_rank
    from shardlab.lm import shard_batch

    ids = torch.zeros(2, 9, dtype=torch.long)
    shard_batch(this_rank().mesh, ids, labels=torch.zeros(2, 8, dtype=torch.long))


def _presharded():
    from torch.distributed.tensor import Shard

    from shardlab import distribute, this_rank
    from shardlab.lm import shard_batch

    mesh = this_rank().mesh
    ids = torch.zeros(2, 9, dtype=torch.long)
    shard_batch(mesh, ids, attention_mask=distribute(torch.ones(2, 9), mesh, [Shard(1)]))


def _head_tail_not_causal():
    from shardlab import this_rank
    from shardlab.lm import shard_batch

    ids = torch.zeros(2, 9, dtype=torch.long)
    shard_batch(this_rank().mesh, ids, head_tail=True, causal=False)


def _dropout():  # attention dropout works (tests/ops/test_attention_dropout.py); p > 1 not
    import shardlab
    from shardlab import this_rank
    from shardlab.lm import shard_batch

    model = _zoo.decoder("llama")
    for m in model.modules():  # the attention modules read it at construction
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 1.5
    model.train()
    ids = torch.zeros(2, 9, dtype=torch.long)
    with shardlab.patched():
        model(**shard_batch(this_rank().mesh, ids))


@pytest.mark.parametrize(
    "fn,kind,words",
    [
        (_short, "ValueError", "a sequence of 2 tokens on 3 ranks"),
        (_mismatched, "ValueError", "labels of shape (2, 8)"),
        (_presharded, "TypeError", "attention_mask must be a plain (B, S) tensor"),
        (_head_tail_not_causal, "ValueError", "head_tail=True permutes the tokens"),
        (_dropout, "RuntimeError", "dropout probability has to be between 0 and 1"),
    ],
)
def test_bad_input_is_the_same_error_on_every_rank(ranks_for, fn, kind, words):
    per_rank = ranks_for(3).run(_errors(fn))
    assert per_rank[0] is not None and per_rank[0][0] == kind and words in per_rank[0][1]
    assert all(r == per_rank[0] for r in per_rank), per_rank
