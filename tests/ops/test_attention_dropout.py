"""Attention dropout in sharded SDPA and nn.MultiheadAttention (issue 27 item 4).

The definition: element (b, h, i, j) of the global probabilities softmax(QK^T s + mask) is
kept iff ``counter_uniform(seed, e) >= p``, e its row-major index in (B, H, S_q, S_kv)
(i, j true positions), the seed one ``torch.randint(0, 2**62, ())`` draw. The reference
builds that mask on one device and does the attention in plain torch (autograd); the
sharded result must equal it, forward and backward (float64), for every world size, shard
sizes (empty shards), mask, GQA, causal, head-tail and 2-D mesh.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.ops import attention
from shardlab.ops._counter import counter_uniform
from tests.tensor._cases import random_sizes

f64 = torch.float64


# -- the definition, on one device, in plain torch ---------------------------------
def _drawn_seed(s: int) -> int:
    """The seed a dropout call draws first after ``torch.manual_seed(s)``."""
    torch.manual_seed(s)
    return int(torch.randint(0, 2**62, ()))


def _keep(seed: int, shape, p: float) -> torch.Tensor:
    """The global keep mask of probabilities of ``shape`` (*, H, S_q, S_kv)."""
    return counter_uniform(seed, torch.arange(math.prod(shape)).view(shape)) >= p


def _ref_attention(q, k, v, mask=None, causal=False, scale=None, gqa=False, p=0.0, keep=None):
    """softmax(QK^T scale + mask) * M / (1-p) @ V, and the dropped probabilities; rows
    that see no key give 0 (as torch's SDPA)."""
    rep = q.shape[-3] // k.shape[-3] if gqa else 1
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    seen = torch.ones(s.shape, dtype=torch.bool)
    if causal:
        seen = seen & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        seen = seen & mask
    elif mask is not None:
        s, seen = s + mask, seen & (mask != -math.inf)
    anything = seen.any(-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(~seen, -math.inf).masked_fill(~anything, 0.0), -1)
    probs = probs * anything
    if keep is not None:
        probs = probs * keep / (1 - p) if p < 1 else probs * 0
    return probs @ v, probs


# -- (a) + (b): every layout against the definition, and against each other -----------------
def _config(rng: random.Random) -> dict:
    hk, rep = rng.randint(1, 2), rng.choice([1, 1, 2])
    sq = rng.randint(1, 9)
    causal = rng.random() < 0.4
    return dict(
        b=rng.randint(1, 2), hk=hk, hq=hk * rep, gqa=rep > 1, d=3, dv=rng.choice([3, 4]),
        sq=sq, skv=sq if causal or rng.random() < 0.6 else rng.randint(1, 9),
        causal=causal, mask=None if causal else rng.choice([None, "bool", "float"]),
        mask_shape=rng.choice(["2d", "b1", "full"]), p=rng.choice([0.1, 0.3, 0.5]),
        scale=rng.choice([None, 0.7]), head_tail=causal and rng.random() < 0.5,
        cut=rng.choice(["seq", "seq", "seq", "batch"]),  # batch: the sequence whole
    )  # fmt: skip


def _inputs(cfg, gen):
    b, hq, hk, sq, skv = cfg["b"], cfg["hq"], cfg["hk"], cfg["sq"], cfg["skv"]
    q = torch.randn(b, hq, sq, cfg["d"], generator=gen, dtype=f64)
    k = torch.randn(b, hk, skv, cfg["d"], generator=gen, dtype=f64)
    v = torch.randn(b, hk, skv, cfg["dv"], generator=gen, dtype=f64)
    mask = None
    if cfg["mask"]:
        shape = {"2d": (sq, skv), "b1": (b, 1, sq, skv), "full": (b, hq, sq, skv)}
        r = torch.rand(shape[cfg["mask_shape"]], generator=gen, dtype=f64)
        mask = r < 0.75 if cfg["mask"] == "bool" else torch.randn(r.shape, generator=gen, dtype=f64)
        if cfg["mask"] == "float":
            mask = mask.masked_fill(r > 0.8, -math.inf)
    return q, k, v, mask


def _placements(cfg, mesh_shape, rng):
    """(q placements, q sizes, k/v placements, k/v sizes, ring mesh dim or None): the
    sequence on one mesh dim (or none: cut "batch"); the batch, the heads (GQA: whole K/V
    heads) or nothing on the others."""
    seq_m = rng.randrange(len(mesh_shape)) if cfg["cut"] == "seq" else None
    pq, sq_, pkv, skv_ = [], [], [], []

    def add(q_place, q_sizes, kv_place, kv_sizes):
        pq.append(q_place), sq_.append(q_sizes), pkv.append(kv_place), skv_.append(kv_sizes)

    for m, n in enumerate(mesh_shape):
        if m == seq_m:
            a, b = random_sizes(rng, cfg["sq"], n), random_sizes(rng, cfg["skv"], n)
            if cfg["head_tail"]:
                a = b = attention.head_tail_sizes(cfg["sq"], n)
            add(Shard(2), a, Shard(2), b)
            continue
        free = ["rep"] + [w for w, d in (("batch", 0), ("heads", 1)) if Shard(d) not in pq]
        what = "batch" if len(mesh_shape) == 1 else cfg["other"] if cfg["other"] in free else "rep"
        if what == "rep":
            add(Replicate(), None, Replicate(), None)
            continue
        dim = 0 if what == "batch" else 1
        s = random_sizes(rng, cfg["b"] if dim == 0 else cfg["hk"], n)
        r = 1 if dim == 0 else cfg["hq"] // cfg["hk"]
        add(Shard(dim), [x * r for x in s], Shard(dim), s)
    return pq, sq_, pkv, skv_, seq_m


def _sweep(mesh_shape, cases, size_seed):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(size_seed)
        results = []
        for i in range(cases):
            cfg = _config(random.Random(1000 + i))  # the same cases for every world size
            cfg["other"] = ("batch", "heads", "rep")[i % 3]  # a 2-D mesh's other dim cuts
            if len(mesh_shape) > 1:
                cfg["head_tail"] = False  # head_tail() cuts the sequence by one mesh dim
            gen = torch.Generator().manual_seed(i)
            q, k, v, mask = _inputs(cfg, gen)
            kw = dict(is_causal=cfg["causal"], scale=cfg["scale"], enable_gqa=cfg["gqa"])
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            keep = _keep(
                _drawn_seed(50 + i), (cfg["b"], cfg["hq"], cfg["sq"], cfg["skv"]), cfg["p"]
            )
            ref, _ = _ref_attention(
                *leaves, mask, cfg["causal"], cfg["scale"], cfg["gqa"], cfg["p"], keep
            )
            w = torch.randn(ref.shape, generator=gen, dtype=f64)
            want = torch.autograd.grad((ref * w).sum(), leaves)
            pq, sq_, pkv, skv_, seq_m = _placements(cfg, mesh_shape, rng)
            ours = [x.clone().requires_grad_() for x in (q, k, v)]
            ht = cfg["head_tail"] and seq_m is not None
            with shardlab.patched():
                if ht:
                    qs, ks, vs = (attention.balance(x, mesh, [Shard(2)]) for x in ours)
                else:
                    qs = distribute(ours[0], mesh, pq, sq_)
                    ks, vs = (distribute(x, mesh, pkv, skv_) for x in ours[1:])
                torch.manual_seed(50 + i)
                with attention.head_tail() if ht else contextlib.nullcontext():
                    y = F.scaled_dot_product_attention(qs, ks, vs, mask, cfg["p"], **kw)
                out = y.full_tensor()
                out = attention.unbalance(out, mesh_shape[0]) if ht else out
            grads = torch.autograd.grad((out * w).sum(), ours)
            err = max((a - b).abs().max().item() for a, b in zip((out, *grads), (ref, *want)))
            cfg["ran"] = ("head-tail" if ht else cfg["cut"], mesh_shape, tuple(map(str, pq)))
            results.append((err, out.detach(), [g.detach() for g in grads], cfg))
        return results

    return body


def test_every_world_size_and_layout_is_the_definition(ranks_for):
    """(a) + (b): the same cases on 1, 2, 3, 4 ranks (1-D, and a 2x2 mesh with batch or
    heads cut on the other dim), random uneven sizes with empty shards, two size draws
    on 3 ranks: each equals the plain-torch definition forward and backward, so they
    equal each other."""
    cases, runs = 16, []
    for mesh_shape, size_seed in [
        ((1,), 0),
        ((2,), 1),
        ((3,), 2),
        ((3,), 3),
        ((4,), 4),
        ((2, 2), 5),
    ]:
        world = math.prod(mesh_shape)
        per_rank = ranks_for(world).run(_sweep(mesh_shape, cases, size_seed))
        for rank_res in per_rank:
            for err, _, _, cfg in rank_res:
                assert err < 1e-12, (mesh_shape, size_seed, cfg, err)
        runs.append(per_rank[0])
    for other in runs[1:]:
        for (_, out0, g0, cfg), (_, out, g, _) in zip(runs[0], other):
            assert torch.allclose(out, out0, rtol=0, atol=1e-12), cfg
            assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(g, g0)), cfg
    # the sweep covered what it claims
    cfgs = [cfg for _, _, _, cfg in runs[0]]
    assert {c["causal"] for c in cfgs} == {True, False} and any(c["gqa"] for c in cfgs)
    assert {"bool", "float"} <= {c["mask"] for c in cfgs if c["cut"] == "seq"}
    ran = {c["ran"] for run in runs for _, _, _, c in run}
    assert any(k == "head-tail" and m[0] > 1 for k, m, _ in ran)
    assert any(k == "batch" and m[0] > 1 for k, m, _ in ran)  # the sequence whole
    for other in ("S(0)", "S(1)"):  # the ring on one mesh dim, batch or heads cut on the other
        assert any(k == "seq" and m == (2, 2) and other in pl for k, m, pl in ran), (other, ran)


def test_messages_are_those_without_dropout_and_no_draw_without_it(ranks_for):
    """The same messages (kinds, bytes, peers) with and without dropout; dropout_p = 0
    draws no random number (the generator is where it was); the mask really drops."""

    def body():
        mesh = this_rank().mesh
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, 11, 4, generator=gen, dtype=f64) for _ in range(3))
        traces, outs = [], []
        for p in (0.0, 0.3):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            with shardlab.patched(), shardlab.trace(mesh=mesh) as t:
                qs, ks, vs = (distribute(x, mesh, [Shard(2)], [[5, 0, 6]]) for x in leaves)
                torch.manual_seed(3)
                y = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=p, is_causal=True)
                after = torch.rand(1)
                y.to_local().sum().backward()
            traces.append([(e.kind, e.bytes, e.peer) for e in t.events])
            outs.append((y.full_tensor(), after, {e.label for e in t.events}))
        torch.manual_seed(3)
        untouched = torch.equal(outs[0][1], torch.rand(1))  # p = 0: no draw
        return traces[0] == traces[1] and len(traces[0]) > 0, untouched, outs

    per_rank = ranks_for(3).run(body)
    for same, untouched, outs in per_rank:
        assert same and untouched
        assert not torch.allclose(outs[0][0], outs[1][0])  # dropout is on
    # without dropout the visible blocks run in the fused CPU kernel, with it explicitly
    without, with_ = (set().union(*(outs[i][2] for _, _, outs in per_rank)) for i in (0, 1))
    assert "sdpa.ring forward [cpu-flash]" in without, without
    assert "sdpa.ring forward [explicit]" in with_ and not any("flash" in x for x in with_)


def test_p_one_drops_everything_as_torch(ranks_for):
    """dropout_p = 1: torch's SDPA returns zeros (and zero gradients); so does the ring."""

    def body():
        mesh = this_rank().mesh
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, 2, 7, 4, generator=gen, dtype=f64, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        ref = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
        want = torch.autograd.grad(ref.square().sum() + ref.sum(), (q, k, v))
        with shardlab.patched():
            qs, ks, vs = (distribute(x, mesh, [Shard(2)], [[3, 0, 4]]) for x in (q, k, v))
            y = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=1.0).full_tensor()
        got = torch.autograd.grad(y.square().sum() + y.sum(), (q, k, v))
        return all(torch.equal(a, b) for a, b in zip((y, *got), (ref, *want)))

    assert all(ranks_for(3).run(body))


# -- (c): the keep rate and independence ----------------------------------------------------
@pytest.mark.parametrize("world,p", [(2, 0.1), (3, 0.3)])
def test_keep_rate_and_independence(ranks_for, world, p):
    """q = 0 (uniform probabilities 1/S) and V = one-hot rows: out[b, h, i, j] =
    M[b, h, i, j] / ((1-p) S), the mask itself, 2 x 4 x 112 x 112 = 100352 elements."""
    b, h, s = 2, 4, 112

    def body():
        mesh = this_rank().mesh
        q = torch.zeros(b, h, s, s, dtype=f64)
        v = torch.eye(s, dtype=f64).expand(b, h, s, s).contiguous()
        sizes = random_sizes(random.Random(world), s, world)
        with shardlab.patched():
            qs, vs = (distribute(x, mesh, [Shard(2)], [sizes]) for x in (q, v))
            torch.manual_seed(0)
            y = F.scaled_dot_product_attention(qs, qs, vs, dropout_p=p)
        return y.full_tensor()

    out = ranks_for(world).run(body)[0]
    unit = 1 / ((1 - p) * s)
    m = (out / unit).round()
    assert torch.allclose(out, m * unit, rtol=0, atol=1e-12) and set(m.unique().tolist()) <= {0, 1}
    n = m.numel()
    rate, se = m.mean().item(), math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 4 * se, (rate, 1 - p, se)
    # independence: masks of different (batch, head) pairs, of neighbouring keys and of
    # neighbouring queries are uncorrelated (each correlation within 4.5 standard errors)
    rows = m.reshape(b * h, s * s)
    corr = torch.corrcoef(rows)
    off = corr[~torch.eye(b * h, dtype=torch.bool)]
    assert off.abs().max() < 4.5 / math.sqrt(s * s), off.abs().max()
    for a, c in ((m[..., :-1].flatten(), m[..., 1:].flatten()),
                 (m[..., :-1, :].flatten(), m[..., 1:, :].flatten())):  # fmt: skip
        r = torch.corrcoef(torch.stack([a, c]))[0, 1]
        assert abs(r) < 4.5 / math.sqrt(a.numel()), r
    # and the mask is the definition's
    assert torch.equal(m.bool(), _keep(_drawn_seed(0), (b, h, s, s), p))


# -- (d): the same mask in backward, also when a checkpoint recomputes the forward ---------
class _Attn(nn.Module):
    """x (B, S, E) -> projections -> SDPA with dropout (B, H, S, D) -> output projection."""

    def __init__(self, e=8, heads=2, p=0.3):
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv, self.out = nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


def test_checkpoint_recomputes_the_same_mask(ranks_for):
    """torch.utils.checkpoint (non-reentrant) around a block with dropout: the recomputed
    forward draws the same seed (checkpoint restores the generator), so output and every
    gradient equal the plain run and the definition."""

    def body():
        from torch.utils.checkpoint import checkpoint

        mesh = this_rank().mesh
        torch.manual_seed(0)
        block = _Attn().double()
        x = torch.randn(2, 10, 8, dtype=f64)
        # the definition: the block's projections, plain-torch attention with the mask
        xr = x.clone().requires_grad_()
        q, k, v = block.qkv(xr).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        keep = _keep(_drawn_seed(7), (2, 2, 10, 10), 0.3)
        a, _ = _ref_attention(q, k, v, causal=True, p=0.3, keep=keep)
        ref = block.out(a.transpose(1, 2).flatten(-2))
        w = torch.randn(ref.shape, dtype=f64)
        want = torch.autograd.grad((ref * w).sum(), [xr, *block.parameters()])
        res = []
        for ckpt in (False, True):
            xs = x.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(xs, mesh, [Shard(1)], [[4, 0, 6]])
                torch.manual_seed(7)
                y = checkpoint(block, st, use_reentrant=False) if ckpt else block(st)
                torch.rand(5)  # the generator moves on before backward
                out = y.full_tensor()
                got = torch.autograd.grad((out * w).sum(), [xs, *block.parameters()])
            res.append(max((g - r).abs().max().item() for g, r in zip((out, *got), (ref, *want))))
        return res

    for errs in ranks_for(3).run(body):
        assert max(errs) < 1e-12, errs


# -- (e): nn.MultiheadAttention and an unchanged GPT-2 in train mode ----------------------
def _mha_reference(mha, x, p, seed, need_weights, average):
    """torch's multi-head attention (batch_first) with plain-torch attention and the
    definition's mask: (output, weights)."""
    b, s, e = x.shape
    h = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
    q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
    a, probs = _ref_attention(q, k, v, p=p, keep=_keep(seed, (b, h, s, s), p))
    out = mha.out_proj(a.transpose(1, 2).flatten(-2))
    return out, (probs.mean(1) if average else probs) if need_weights else None


def test_multihead_attention_with_dropout(ranks_for):
    """nn.MultiheadAttention(dropout=0.25) in train mode on 1, 2 and 3 ranks, uneven sizes:
    output, returned (dropped) weights, input and parameter gradients equal the definition;
    in eval mode torch's own result, and no random number drawn."""

    def body():
        mesh, n = this_rank().mesh, this_rank().world_size
        res = []
        for need_weights, average in ((False, True), (True, True), (True, False)):
            torch.manual_seed(0)
            mha = nn.MultiheadAttention(8, 2, dropout=0.25, batch_first=True).double()
            x = torch.randn(2, 9, 8, dtype=f64)
            xr = x.clone().requires_grad_()
            ref, ref_w = _mha_reference(mha, xr, 0.25, _drawn_seed(4), need_weights, average)
            w = torch.randn(ref.shape, dtype=f64)
            want = torch.autograd.grad((ref * w).sum(), [xr, *mha.parameters()])
            xs = x.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(xs, mesh, [Shard(1)], [random_sizes(random.Random(n), 9, n)])
                torch.manual_seed(4)
                y, y_w = mha(st, st, st, need_weights=need_weights, average_attn_weights=average)
                out = y.full_tensor()
            got = torch.autograd.grad((out * w).sum(), [xs, *mha.parameters()])
            err = max((g - r).abs().max().item() for g, r in zip((out, *got), (ref, *want)))
            if need_weights:
                err = max(err, (y_w.full_tensor() - ref_w).abs().max().item())
            res.append(err)
        # eval mode: torch's own, no draw
        mha.eval()
        ref, ref_w = mha(x, x, x)
        torch.manual_seed(1)
        first = torch.rand(1)
        with shardlab.patched():
            st = distribute(x, mesh, [Shard(1)], [random_sizes(random.Random(n), 9, n)])
            torch.manual_seed(1)
            y, y_w = mha(st, st, st)
            untouched = torch.equal(torch.rand(1), first)
        errs = (y.full_tensor() - ref).abs().max(), (y_w.full_tensor() - ref_w).abs().max()
        res.append(max(errs).item())
        return res, untouched

    for world in (1, 2, 3):
        for errs, untouched in ranks_for(world).run(body):
            assert max(errs) < 1e-12 and untouched, (world, errs, untouched)


def _gpt2(pdrop: float):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
        attn_pdrop=pdrop, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return tf.GPT2LMHeadModel(cfg).double().train()


def _gpt2_body():
    def body():
        from shardlab.lm import shard_batch

        mesh, n = this_rank().mesh, this_rank().world_size
        ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(3))
        res = {}
        for pdrop in (0.1, 0.0):
            model = _gpt2(pdrop)
            with shardlab.patched():
                batch = shard_batch(mesh, ids, labels=ids, sizes={2: [9, 4], 3: [2, 6, 5]}[n])
                torch.manual_seed(9)
                loss = model(**batch).loss
                loss = loss.full_tensor() if isinstance(loss, shardlab.ShardTensor) else loss
            loss.backward()
            res[pdrop] = (loss.detach(), {k: p.grad for k, p in model.named_parameters()})
        # one device, the definition: SDPA replaced by plain torch with the counter mask
        model = _gpt2(0.1)

        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
            keep = None
            if dropout_p:
                seed = int(torch.randint(0, 2**62, ()))
                keep = _keep(seed, (*q.shape[:-1], k.shape[-2]), dropout_p)
            return _ref_attention(q, k, v, attn_mask, is_causal, scale, p=dropout_p, keep=keep)[0]

        original, F.scaled_dot_product_attention = F.scaled_dot_product_attention, sdpa
        try:
            torch.manual_seed(9)
            loss = model(input_ids=ids, labels=ids).loss
        finally:
            F.scaled_dot_product_attention = original
        loss.backward()
        res["one device"] = (loss.detach(), {k: p.grad for k, p in model.named_parameters()})
        return res

    return body


def test_gpt2_train_mode_is_the_same_on_2_and_3_ranks(ranks_for):
    """An unchanged transformers GPT-2 with attn_pdrop=0.1 (resid/embd dropout 0), train
    mode, float64, uneven sizes: loss and gradients the same on 2 and 3 ranks and equal
    to one device running the definition; the loss differs from attn_pdrop=0."""
    pytest.importorskip("transformers")
    runs = [ranks_for(world).run(_gpt2_body())[0] for world in (2, 3)]
    for res in runs:
        ref_loss, ref_grads = res["one device"]
        for got_loss, got_grads in (res[0.1], runs[0][0.1]):
            # transformers computes the loss in float32 (logits.float()), on one device too
            assert torch.allclose(got_loss, ref_loss, rtol=1e-6, atol=0)
            for k, g in got_grads.items():
                assert type(g) is torch.Tensor, k
                assert torch.allclose(g, ref_grads[k], rtol=1e-5, atol=1e-7), k
        # dropout is on: the loss moves far beyond float32 rounding (a random model's loss
        # stays near log(64) either way), the attention's gradients a lot
        assert (res[0.1][0] - res[0.0][0]).abs() > 1e-5 * res[0.0][0]  # 10x the tolerance
        on, off = (res[x][1]["transformer.h.0.attn.c_attn.weight"] for x in (0.1, 0.0))
        assert (on - off).norm() > 0.05 * off.norm()
    assert torch.allclose(runs[0][0.1][0], runs[1][0.1][0], rtol=1e-6, atol=0)


# -- (f): bad probabilities: torch's error type on every rank -----------------------------
def test_bad_dropout_p_is_torchs_error_on_every_rank(ranks_for):
    def body():
        mesh = this_rank().mesh
        x = torch.randn(1, 2, 5, 4)
        mha = nn.MultiheadAttention(4, 2, batch_first=True)
        got = []
        for p in (-0.1, 1.5):
            calls = [
                ("sdpa", lambda q, p=p: F.scaled_dot_product_attention(q, q, q, dropout_p=p)),
                ("mha weights", lambda q, p=p: F.multi_head_attention_forward(
                    *_mha_args(mha, q, p), need_weights=True)),
                ("mha", lambda q, p=p: F.multi_head_attention_forward(
                    *_mha_args(mha, q, p), need_weights=False)),
            ]  # fmt: skip
            for name, call in calls:
                plain = x if name == "sdpa" else x[0].transpose(0, 1)  # (S, B, E) for mha
                try:
                    call(plain)
                    want = None
                except Exception as exc:  # noqa: BLE001 torch's type, whatever it is
                    want = type(exc)
                with shardlab.patched():
                    st = distribute(
                        plain, mesh, [Shard(plain.ndim - 2 if name == "sdpa" else 0)], [[3, 0, 2]]
                    )
                    try:
                        call(st)
                        mine = None
                    except Exception as exc:  # noqa: BLE001
                        mine = (type(exc), str(exc))
                got.append((name, p, want, mine))
        with shardlab.patched():  # eval mode ignores p, as torch
            st = distribute(x[0].transpose(0, 1), mesh, [Shard(0)], [[3, 0, 2]])
            F.multi_head_attention_forward(*_mha_args(mha, st, 1.5), training=False)
        return got

    per_rank = ranks_for(3).run(body)
    assert all(got == per_rank[0] for got in per_rank)  # the same error on every rank
    for got in per_rank:
        for name, p, want, mine in got:
            if (name, p) == ("mha weights", -0.1):  # torch: F.dropout only for p > 0
                assert want is None and mine is None
                continue
            assert want is not None and mine is not None, (name, p)
            assert mine[0] is want and "between 0 and 1" in mine[1], (name, p, want, mine)


def _mha_args(mha, x, p):
    return (x, x, x, 4, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, p,
            mha.out_proj.weight, mha.out_proj.bias)  # fmt: skip
