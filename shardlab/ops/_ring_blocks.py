"""The per-block math of ring attention (``_ring.py``): one block is the local queries
against one K/V block; its normalised output and logsumexp (forward) or its share of
the gradients (backward), in a fused kernel (``_ring_kernels.py``) or explicitly, with
the score matrix (S_q_local x S_kv_j) in memory. Attention dropout (``_attn_dropout.py``)
runs explicitly: the mask multiplies P in the P @ V product only.
"""

from __future__ import annotations

import math

import torch

from shardlab.ops import _ring_kernels as kernels

NEG_INF = -math.inf


def merge(o, lse, o_new, lse_new):
    """Two normalised partial attentions of the same rows, merged by their logsumexps:
    o = (e^lse o + e^lse_new o_new) / (e^lse + e^lse_new); rows seeing no key stay 0.
    ``o is None``: nothing yet, the new one is the result."""
    if o is None:
        return o_new, lse_new
    new = torch.logaddexp(lse, lse_new)
    safe = new.masked_fill(new == NEG_INF, 0.0)
    return o * (lse - safe).exp()[..., None] + o_new * (lse_new - safe).exp()[..., None], new


def compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: K/V heads repeated for their query heads (as torch does)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def fold(g: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient of :func:`heads`: sum over the query heads sharing a K/V head."""
    return g if rep == 1 else g.unflatten(-3, (g.shape[-3] // rep, rep)).sum(-3)


def once(make):
    """``make()``, called on first use only (the explicit path's float32 copies of
    half-precision tensors exist only when a block needs them)."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]

    return get


def block_attention(qi, kj, vj, plan, j: int, how, ct, rng):
    """Block j's normalised output (*, H_q, S_q, D_v) and logsumexp (*, H_q, S_q), in
    the compute dtype ``ct``. ``qi``, ``kj``, ``vj``: in the kernel's input dtype."""
    kind, pieces = how
    if pieces is not None:  # a fused kernel: no (S_q x S_kv_j) scores in memory
        o = lse = None
        for qs, ks, causal in pieces:
            part = [x[..., r, :] for x, r in ((qi, qs), (kj, ks), (vj, ks))]
            o_p, lse_p = kernels.forward(kind, *part, causal, plan.scale, rng)
            o_p, lse_p = o_p.to(ct), lse_p.to(ct)
            if len(pieces) == 1 and qs == slice(0, qi.shape[-2]):
                return o_p, lse_p  # one piece, every row: nothing to merge
            if o is None:
                o = o_p.new_zeros((*qi.shape[:-1], vj.shape[-1]))  # (*, H_q, S_q, D_v)
                lse = lse_p.new_full(qi.shape[:-1], NEG_INF)  # (*, H_q, S_q)
            o[..., qs, :], lse[..., qs] = merge(o[..., qs, :], lse[..., qs], o_p, lse_p)
        return o, lse
    qc, kc, vc = qi.to(ct), kj.to(ct), vj.to(ct)
    s = plan.scores(qc, kc, j)  # (*, H_q, S_q, S_kv_j), masked
    m = s.amax(-1)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)  # rows that see no key of block j
    p = s.sub_(m_safe[..., None]).exp_()  # in place
    z = p.sum(-1)  # the normaliser sees every key, dropped or not
    if plan.drop is not None:  # dropout: o = ((p * M) @ v) / z / (1-p)
        p.mul_(plan.drop.keep(plan.kv_starts[j], plan.kv_sizes[j], p))
    o = (p @ vc) / z.masked_fill(z == 0, 1.0)[..., None]
    if plan.drop is not None:
        o.mul_(plan.drop.factor)  # 0 for p = 1: everything dropped
    return o, m_safe + torch.log(z)  # lse -inf where no key is seen


def block_grads(ins, kj, vj, lse, plan, j: int, how, ct, rng):
    """Block j's (dq part, dk_j, dv_j, dS_j) in ``ct``; ``ins``: (q, dout, out) in the
    kernel's input dtype and, made when an explicit block needs them, in ``ct`` with
    delta. dS_j (*, H_q, S_q, S_kv_j): the scores' gradient before the scale (an
    additive mask's), None from a fused kernel (it runs only on blocks without one)."""
    kind, pieces = how
    qi, dout, out = ins["q"], ins["dout"], ins["out"]
    kr, vr = heads(kj.to(qi.dtype), plan.rep), heads(vj.to(qi.dtype), plan.rep)
    if pieces is not None:  # the fused kernel, with the *final* out and lse of the rows
        dq = dk = dv = None
        for qs, ks, causal in pieces:
            rows = [x[..., qs, :] for x in (dout, qi)]
            cols = [x[..., ks, :] for x in (kr, vr)]
            o_rows, lse_rows = out[..., qs, :], lse[..., qs]
            g = kernels.backward(kind, *rows, *cols, o_rows, lse_rows, causal, plan.scale, rng)
            dq = add_rows(dq, qs, g[0], qi.shape, ct)
            dk = add_rows(dk, ks, g[1], kr.shape, ct)
            dv = add_rows(dv, ks, g[2], vr.shape, ct)
        return dq, fold(dk, plan.rep), fold(dv, plan.rep), None
    qc, dc, delta, lse_safe = ins["explicit"]()
    kr, vr = kr.to(ct), vr.to(ct)
    p = plan.scores(qc, kr, j).sub_(lse_safe[..., None]).exp_()  # exact softmax (final lse)
    dp = dc @ vr.transpose(-2, -1)  # (*, H_q, S_q, S_kv_j)
    if plan.drop is None:
        dv = p.transpose(-2, -1) @ dc  # (*, H_q, S_kv_j, D_v)
    else:  # the same mask as forward: P' = P * M / (1-p); dV = P'^T dO, dP = dP' * M / (1-p)
        keep, f = plan.drop.keep(plan.kv_starts[j], plan.kv_sizes[j], p), plan.drop.factor
        dv = (p * keep).transpose(-2, -1) @ dc.mul(f)
        dp.mul_(keep).mul_(f)
    ds = dp.sub_(delta[..., None]).mul_(p)  # dS = P * (dP - D), before the scale
    dq, dk = (ds @ kr).mul_(plan.scale), (ds.transpose(-2, -1) @ qc).mul_(plan.scale)
    return dq, fold(dk, plan.rep), fold(dv, plan.rep), ds


def add_rows(acc, rows: slice, g, shape, ct):
    """``acc[..., rows, :] += g``, ``acc`` of ``shape`` in ``ct`` made on first use (a
    gradient of every row is taken as it is: no zeros to add it to)."""
    if acc is None:
        if rows == slice(0, shape[-2]):
            return g.to(ct)
        acc = g.new_zeros(shape, dtype=ct)
    acc[..., rows, :] += g
    return acc
