"""Ring attention on local blocks: the autograd Function behind sharded SDPA.

Rank ``r`` of a ring of N owns query rows ``q_r`` and key/value rows ``kv_r``.
The queries stay; the K/V blocks travel one hop per step (send to ``r+1``,
receive from ``r-1``), so after N-1 hops every query block has met every K/V
block. N = 4::

    step 0:   r0 [q0 . kv0]   r1 [q1 . kv1]   r2 [q2 . kv2]   r3 [q3 . kv3]    own block
    step 1:   r0 [q0 . kv3]   r1 [q1 . kv0]   r2 [q2 . kv1]   r3 [q3 . kv2]    kv moved right
    step 2:   r0 [q0 . kv2]   r1 [q1 . kv3]   r2 [q2 . kv0]   r3 [q3 . kv1]
    step 3:   r0 [q0 . kv1]   r1 [q1 . kv2]   r2 [q2 . kv3]   r3 [q3 . kv0]

At step t rank r holds block ``j = r - t (mod N)``. Each step posts the
isend/irecv of the next block *before* computing on the current one, and waits
after: the transfer overlaps the compute. Partial results merge with an online
softmax: each block gives a normalised output and its logsumexp, merged into the
running (output, logsumexp). On CPU a block without a mask (every key visible, or
the causal diagonal) runs in torch's fused kernel, which holds no score matrix;
other blocks hold scores of (S_local_q x S_local_kv) only.

Messages per rank (blocks of size 0 are never sent):

* forward:  N-1 K blocks and N-1 V blocks received (every other rank's, once);
* backward: the same K/V pairs again, plus N-1 dK/dV accumulator pairs. The
  accumulator of block j is born at rank j+1 (step 1), picks up each rank's
  contribution on its way round, and its last hop (step N-1) brings it home
  to rank j, which adds its own contribution. dQ never leaves the rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab.tensor.comm import post
from shardlab.trace import label

NEG_INF = -math.inf


@dataclass
class RingPlan:
    """What every rank knows about the ring (the same numbers on every rank).

    ``kv_sizes[j]`` / ``kv_starts[j]``: rows of K/V block j along the sequence.
    ``q_pos`` / ``kv_pos[j]``: true sequence positions (for ``is_causal``).
    ``mask``: additive or boolean, already cut to the local query rows and
    broadcastable to (*, H_q, S_local_q, S_kv) (columns: the global K/V rows).
    """

    peers: list[int]  # global rank of ring position k (from mesh coordinates)
    me: int  # my position in the ring
    group: object  # the process group of the ring's mesh dim (None: no ring)
    kv_sizes: list[int]
    kv_starts: list[int]
    q_pos: torch.Tensor | None
    kv_pos: list[torch.Tensor] | None
    mask: torch.Tensor | None
    scale: float
    rep: int  # GQA: query heads per K/V head

    @property
    def n(self) -> int:
        return len(self.kv_sizes)

    def visible(self, j: int, sq: int) -> bool:
        """Does block j need any compute? (empty blocks, blocks a boolean mask hides
        completely, and, for causal, blocks whose keys all come after every local query
        are skipped: a local decision about compute; the messages stay the same)."""
        if sq == 0 or self.kv_sizes[j] == 0:
            return False
        m = self.block_mask(j)
        if m is not None and m.dtype == torch.bool and not bool(m.any()):
            return False
        if self.q_pos is None:
            return True
        return bool(self.q_pos.max() >= self.kv_pos[j].min())

    def fused(self, j: int, q: torch.Tensor, v: torch.Tensor) -> list | None:
        """How block j runs in torch's fused CPU kernel (no score matrix in memory):
        a list of (query rows, key rows, is_causal) pieces, one per pair of contiguous
        position runs that sees anything (head-tail balancing gives two runs each); or
        None: explicit masked scores (a mask, another device, or a run pair that is
        neither all visible nor the same positions)."""
        if q.device.type != "cpu" or q.shape[-1] != v.shape[-1]:
            return None
        m = self.block_mask(j)  # a boolean mask showing every key of block j: no mask
        if m is not None and (m.dtype != torch.bool or not bool(m.all())):
            return None
        if q.numel() == 0 or v.numel() == 0:  # no batch or no heads here (the kernel crashes)
            return None
        everything = slice(0, q.shape[-2]), slice(0, v.shape[-2])
        if self.q_pos is None:
            return [(*everything, False)]
        pieces = []
        for qs, qp in _runs(self.q_pos):
            for ks, kp in _runs(self.kv_pos[j]):
                if kp[0] > qp[-1]:
                    continue  # every key after every query: masked out
                if kp[-1] <= qp[0]:
                    pieces.append((qs, ks, False))  # every key before every query
                elif torch.equal(kp, qp):
                    pieces.append((qs, ks, True))  # the same positions: the diagonal
                else:
                    return None
        return pieces

    def block_mask(self, j: int) -> torch.Tensor | None:
        """The mask's columns of block j (None: no mask)."""
        m = self.mask
        if m is None or m.shape[-1] == 1:
            return m
        return m.narrow(-1, self.kv_starts[j], self.kv_sizes[j])

    def scores(self, q: torch.Tensor, k: torch.Tensor, j: int) -> torch.Tensor:
        """Scores of the local queries against block j, masked (in place: one
        (*, H_q, S_q, S_kv_j) tensor is the only large allocation)."""
        s = (q @ k.transpose(-2, -1)).mul_(self.scale)  # (*, H_q, S_q, S_kv_j)
        if self.mask is not None:
            m = self.block_mask(j)  # block j's columns
            s = s.masked_fill_(~m, NEG_INF) if m.dtype == torch.bool else s.add_(m)
        if self.q_pos is not None:  # causal, by true positions
            s = s.masked_fill_(self.kv_pos[j][None, :] > self.q_pos[:, None], NEG_INF)
        return s


def _runs(pos: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """The contiguous runs of increasing positions: (index slice, positions) each."""
    breaks = [0, *((torch.diff(pos) != 1).nonzero().flatten() + 1).tolist(), len(pos)]
    return [(slice(a, b), pos[a:b]) for a, b in zip(breaks, breaks[1:]) if b > a]


def _merge(o, lse, o_new, lse_new):
    """Two normalised partial attentions of the same rows, merged by their logsumexps:
    o = (e^lse o + e^lse_new o_new) / (e^lse + e^lse_new); rows seeing no key stay 0."""
    new = torch.logaddexp(lse, lse_new)
    safe = new.masked_fill(new == NEG_INF, 0.0)
    return o * (lse - safe).exp()[..., None] + o_new * (lse_new - safe).exp()[..., None], new


def _compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: K/V heads repeated for their query heads (as torch does)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _fold(g: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient of :func:`_heads`: sum over the query heads sharing a K/V head."""
    return g if rep == 1 else g.unflatten(-3, (g.shape[-3] // rep, rep)).sum(-3)


def _post(plan: RingPlan, send: list, recv_shapes: list, like: torch.Tensor, cause: str):
    """Post sends of ``send`` to the next rank and receives (new buffers) from the
    previous one; return (buffers, works). Nothing is posted for empty tensors."""
    nxt, prv = plan.peers[(plan.me + 1) % plan.n], plan.peers[(plan.me - 1) % plan.n]
    ops = [dist.P2POp(dist.isend, t, nxt, plan.group) for t in send if t.numel()]
    bufs = [like.new_empty(s) for s in recv_shapes]
    ops += [dist.P2POp(dist.irecv, b, prv, plan.group) for b in bufs if b.numel()]
    if not ops:
        return bufs, []
    with label(*cause.split(" ")):
        return bufs, post(ops)


def _post_next_kv(plan: RingPlan, kv: list, j: int, t: int, cause: str):
    """Step ``t`` holding block j: pass it on and receive block j-1 (none at the last
    step). Returns (buffers for block j-1, works to wait for)."""
    if t == plan.n - 1:
        return None, []
    rows = plan.kv_sizes[(j - 1) % plan.n]
    return _post(plan, kv, [_with_rows(x, rows) for x in kv], kv[0], cause)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _with_rows(x: torch.Tensor, rows: int) -> list[int]:
    return [*x.shape[:-2], rows, x.shape[-1]]


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _block_attention(qc, kj, vj, plan: RingPlan, j: int):
    """Block j's normalised output (*, H_q, S_q, D_v) and logsumexp (*, H_q, S_q)."""
    pieces = plan.fused(j, qc, vj)
    if pieces is not None:  # torch's fused kernel: no (S_q x S_kv_j) scores in memory
        o = qc.new_zeros((*qc.shape[:-1], vj.shape[-1]))  # (*, H_q, S_q, D_v)
        lse = qc.new_full(qc.shape[:-1], NEG_INF)  # (*, H_q, S_q)
        for qs, ks, causal in pieces:
            part = [x[..., r, :].contiguous() for x, r in ((qc, qs), (kj, ks), (vj, ks))]
            o_p, lse_p = _FLASH(*part, 0.0, causal, scale=plan.scale)
            o[..., qs, :], lse[..., qs] = _merge(o[..., qs, :], lse[..., qs], o_p, lse_p)
        return o, lse
    s = plan.scores(qc, kj, j)  # (*, H_q, S_q, S_kv_j), masked
    m = s.amax(-1)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)  # rows that see no key of block j
    p = s.sub_(m_safe[..., None]).exp_()  # in place
    z = p.sum(-1)
    o = (p @ vj) / z.masked_fill(z == 0, 1.0)[..., None]
    return o, m_safe + torch.log(z)  # lse -inf where no key is seen


def ring_forward(q, k, v, plan: RingPlan):
    """Returns out (*, H_q, S_q, D_v) and logsumexp (*, H_q, S_q)."""
    ct = _compute_dtype(q.dtype)
    qc = q.to(ct)  # (*, H_q, S_q, D)
    lse = q.new_full(q.shape[:-1], NEG_INF, dtype=ct)  # merged logsumexp  (*, H_q, S_q)
    o = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=ct)  # merged output (*, H_q, S_q, D_v)
    kv = [k, v]  # the block held now: (*, H_kv, S_kv_j, D)
    for t in range(plan.n):
        j = (plan.me - t) % plan.n
        # 1. post: pass the current block on, receive the next one (block j-1)
        nxt, works = _post_next_kv(plan, kv, j, t, "sdpa.ring forward")
        # 2. compute on the current block while the next one travels, and merge:
        #    o = (e^lse o + e^lse_j o_j) / (e^lse + e^lse_j), lse = log(e^lse + e^lse_j)
        if plan.visible(j, q.shape[-2]):
            kj, vj = _heads(kv[0].to(ct), plan.rep), _heads(kv[1].to(ct), plan.rep)
            o, lse = _merge(o, lse, *_block_attention(qc, kj, vj, plan, j))
        # 3. wait for the next block
        if t < plan.n - 1:
            _wait(works)
            kv = nxt
    # rows that saw no key are 0 (as torch's SDPA gives), their lse -inf
    return o.to(q.dtype), lse


def _block_grads(qc, kj, vj, dout, out, lse, lse_safe, delta, plan: RingPlan, j: int, ct):
    """Recompute block j's probabilities; return (dq part, dk_j, dv_j) of the block."""
    kr, vr = _heads(kj.to(ct), plan.rep), _heads(vj.to(ct), plan.rep)
    pieces = plan.fused(j, qc, vr)
    if pieces is not None:  # the fused kernel, with the *final* out and lse of the rows
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kr), torch.zeros_like(vr)
        for qs, ks, causal in pieces:
            rows = [x[..., qs, :].contiguous() for x in (dout, qc)]
            cols = [x[..., ks, :].contiguous() for x in (kr, vr)]
            o_rows, lse_rows = out[..., qs, :].contiguous(), lse[..., qs].contiguous()
            g = _FLASH_BACKWARD(*rows, *cols, o_rows, lse_rows, 0.0, causal, scale=plan.scale)
            dq[..., qs, :] += g[0]
            dk[..., ks, :] += g[1]
            dv[..., ks, :] += g[2]
        return dq, _fold(dk, plan.rep), _fold(dv, plan.rep)
    p = plan.scores(qc, kr, j).sub_(lse_safe[..., None]).exp_()  # exact softmax (final lse)
    dv = p.transpose(-2, -1) @ dout  # (*, H_q, S_kv_j, D_v)
    ds = (dout @ vr.transpose(-2, -1)).sub_(delta[..., None]).mul_(p).mul_(plan.scale)
    return ds @ kr, _fold(ds.transpose(-2, -1) @ qc, plan.rep), _fold(dv, plan.rep)


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """dq (local), dk, dv (of this rank's own K/V block, after their trip round the ring)."""
    ct = _compute_dtype(q.dtype)
    qc, dout, out = q.to(ct), dout.to(ct), out.to(ct)
    delta = (dout * out).sum(-1)  # (*, H_q, S_q)
    lse_safe = lse.masked_fill(lse == NEG_INF, 0.0)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv, acc, acc_works, own = [k, v], None, [], None
    for t in range(plan.n):
        j = (plan.me - t) % plan.n
        # 1. post the next K/V block (as in forward)
        nxt, kv_works = _post_next_kv(plan, kv, j, t, "sdpa.ring backward")
        # 2. this rank's contribution to block j's gradients (dQ stays here)
        if plan.visible(j, q.shape[-2]):
            dq_j, dk_j, dv_j = _block_grads(
                qc, kv[0], kv[1], dout, out, lse, lse_safe, delta, plan, j, ct
            )
            dq += dq_j
        else:
            dk_j = torch.zeros(kv[0].shape, dtype=ct, device=q.device)
            dv_j = torch.zeros(kv[1].shape, dtype=ct, device=q.device)
        # 3. add it to block j's travelling accumulator (own block: keep it here)
        if t == 0:
            own = [dk_j, dv_j]
        else:
            if t >= 2:
                _wait(acc_works)  # block j's accumulator, posted by the previous rank
                dk_j, dv_j = acc[0] + dk_j, acc[1] + dv_j
            # 4. send it on (at t = N-1 the next rank is its owner) and receive
            #    block j-1's (at t = N-1: my own block's, home from its trip)
            rows = plan.kv_sizes[(j - 1) % plan.n]
            shapes = [_with_rows(dk_j, rows), _with_rows(dv_j, rows)]
            acc, acc_works = _post(plan, [dk_j, dv_j], shapes, dk_j, "sdpa.ring.grad backward")
        if t < plan.n - 1:
            _wait(kv_works)
            kv = nxt
    if plan.n > 1:
        _wait(acc_works)
        own = [own[0] + acc[0], own[1] + acc[1]]
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


def _layout_like(t: torch.Tensor, strides) -> torch.Tensor:
    """``t`` laid out in memory in the order of ``strides`` (outer to inner). A query
    made by ``x.view(B, S, H, D).transpose(1, 2)`` gets an output and a gradient that
    are views again after the inverse ``.transpose(1, 2)``, as from torch's kernels
    (ShardTensor's views act on the local tensor, which must be viewable)."""
    order = sorted(range(t.ndim), key=lambda d: (-strides[d], d))
    if order == list(range(t.ndim)):
        return t.contiguous()
    return t.permute(order).contiguous().permute([order.index(d) for d in range(t.ndim)])


class RingAttention(torch.autograd.Function):
    """``out = RingAttention.apply(q, k, v, plan)`` on local blocks (B, H, S_local, D)."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        ctx.strides = [x.stride() for x in (q, k, v)]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return _layout_like(out, ctx.strides[0])

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan)
        return (*(_layout_like(g, st) for g, st in zip(grads, ctx.strides)), None)
