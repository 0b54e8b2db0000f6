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
running (output, logsumexp). A block without a mask (every key visible, or the
causal diagonal) runs in a fused kernel, which holds no score matrix: torch's CPU
flash kernel, or on CUDA FlashAttention-2 or the memory-efficient kernel
(``_ring_kernels.py`` chooses; the messages' tracer label names it, e.g.
``sdpa.ring forward [flash]``); other blocks hold scores of (S_local_q x S_local_kv)
only (``[explicit]``).

Messages per rank (blocks of size 0 are never sent; K and V of a block travel as one
message, end to end in one buffer, as do dK and dV):

* forward:  N-1 K/V blocks received (every other rank's, once);
* backward: the same K/V blocks again, plus N-1 dK/dV accumulators. The
  accumulator of block j is born at rank j+1 (step 1), picks up each rank's
  contribution on its way round, and its last hop (step N-1) brings it home
  to rank j, which adds its own contribution. dQ never leaves the rank.

An additive ``attn_mask`` that requires grad (a learned bias: BEiT's relative positions)
gets its gradient on the rank that holds its query rows: dMask = dS, the score gradient
before the scale, block j's columns at the step that computes block j (no message).

Attention dropout (``plan.drop``, ``_attn_dropout.py``): every visible block runs in the
explicit path, masking P in the P @ V product only (z and the logsumexp see every key),
the same mask again in backward; the messages are exactly those without dropout. The
per-block math is in ``_ring_blocks.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab.comm import collectives
from shardlab.comm._once import first_order
from shardlab.comm.p2p import post
from shardlab.comm.recompute import fenced, kept
from shardlab.comm.traced import cpu_numbers
from shardlab.ops import _ring_kernels as kernels
from shardlab.ops._attn_dropout import AttnDropout
from shardlab.ops._ring_blocks import (
    NEG_INF,
    block_attention,
    block_grads,
    compute_dtype,
    heads,
    merge,
    once,
)
from shardlab.trace import label


def _on(pos: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """CPU positions on ``like``'s device; while torch.compile traces (``like`` a traced
    tensor), a constant of the graph."""
    if type(like) is torch.Tensor:
        return pos.to(like.device)
    with cpu_numbers():
        values = pos.tolist()
    return torch.tensor(values, dtype=pos.dtype, device=like.device)


@dataclass
class RingPlan:
    """What every rank knows about the ring (the same numbers on every rank).

    ``kv_sizes[j]`` / ``kv_starts[j]``: rows of K/V block j along the sequence.
    ``q_pos`` / ``kv_pos[j]``: true sequence positions (for ``is_causal``; on the CPU:
    every decision reads them there, never waiting for a device).
    ``mask``: additive or boolean, already cut to the local query rows and
    broadcastable to (*, H_q, S_local_q, S_kv) (columns: the global K/V rows).
    ``kernel``: what an unmasked block runs in (:func:`_ring_kernels.choose`).
    ``drop``: attention dropout (``_attn_dropout.py``): every block runs explicitly.
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
    kernel: str = "explicit"
    drop: AttnDropout | None = None

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
        with cpu_numbers():  # (also while torch.compile traces)
            return bool(self.q_pos.max() >= self.kv_pos[j].min())

    def how(self, j: int, q: torch.Tensor, v: torch.Tensor) -> tuple[str, list | None]:
        """(what block j runs in, its fused pieces): ``("skipped", None)``,
        ``("explicit", None)`` or (a fused kernel, :meth:`fused`'s pieces)."""
        if not self.visible(j, q.shape[-2]):
            return "skipped", None
        pieces = self.fused(j, q, v)
        return ("explicit", None) if pieces is None else (self.kernel, pieces)

    def fused(self, j: int, q: torch.Tensor, v: torch.Tensor) -> list | None:
        """How block j runs in a fused kernel (no score matrix in memory): a list of
        (query rows, key rows, is_causal) pieces, one per pair of contiguous position
        runs that sees anything (head-tail balancing gives two runs each); or None:
        explicit masked scores (a mask, dropout, no fused kernel for this device, dtype or
        head dim, or a run pair that is neither all visible nor the same positions)."""
        if self.kernel not in kernels.FUSED or self.drop is not None:
            return None
        m = self.block_mask(j)  # a boolean mask showing every key of block j: no mask
        if m is not None and (m.dtype != torch.bool or not bool(m.all())):
            return None
        if q.numel() == 0 or v.numel() == 0:  # no batch or no heads here (the kernel crashes)
            return None
        everything = slice(0, q.shape[-2]), slice(0, v.shape[-2])
        if self.q_pos is None:
            return [(*everything, False)]
        with cpu_numbers():  # (also while torch.compile traces)
            return self._pieces(j)

    def _pieces(self, j: int) -> list:
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
            q_pos, kv_pos = (_on(x, s) for x in (self.q_pos, self.kv_pos[j]))
            s = s.masked_fill_(kv_pos[None, :] > q_pos[:, None], NEG_INF)  # (S_q, S_kv_j)
        return s


def _runs(pos: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """The contiguous runs of increasing positions: (index slice, positions) each."""
    breaks = [0, *((torch.diff(pos) != 1).nonzero().flatten() + 1).tolist(), len(pos)]
    return [(slice(a, b), pos[a:b]) for a, b in zip(breaks, breaks[1:]) if b > a]


def _post(plan: RingPlan, send: list, recv_shapes: list, like: torch.Tensor, cause: str):
    """Post sends of ``send`` to the next rank and receives (new buffers) from the
    previous one; return (buffers, works). Nothing is posted for empty tensors.

    K and V (dK and dV) of one dtype travel as one message each way: one flat buffer,
    sent whole and received whole, split into the blocks (half the messages, each one's
    latency paid once, as in torch's own ring)."""
    collectives.sending(like, plan.group)  # (under torch.compile: never inside a graph)
    nxt, prv = plan.peers[(plan.me + 1) % plan.n], plan.peers[(plan.me - 1) % plan.n]
    if len(send) > 1 and all(t.dtype == like.dtype and t.device == like.device for t in send):
        numels = [math.prod(s) for s in recv_shapes]
        out = like.new_empty(sum(numels))  # the blocks received, end to end
        bufs = [b.view(s) for b, s in zip(out.split(numels), recv_shapes)]
        flat = _one_buffer(send)  # blocks that came as one message go on as they are
        send = [flat if flat is not None else torch.cat([t.reshape(-1) for t in send])]
        recv = [out]
    else:
        bufs = recv = [like.new_empty(s) for s in recv_shapes]
    ops = [dist.P2POp(dist.isend, t, nxt, plan.group) for t in send if t.numel()]
    ops += [dist.P2POp(dist.irecv, b, prv, plan.group) for b in recv if b.numel()]
    if not ops:
        return bufs, []
    with label(cause):
        return bufs, [*post(ops), _Keep(send)]


def _one_buffer(send: list):
    """The 1-D buffer the tensors of ``send`` fill end to end, in order (K and V received
    as one message at the step before), or None."""
    base = send[0]._base
    if base is None or base.ndim != 1 or base.numel() != sum(t.numel() for t in send):
        return None
    at = base.storage_offset()  # (offsets, not data pointers: fake blocks have none)
    for t in send:
        if t._base is not base or not t.is_contiguous() or t.storage_offset() != at:
            return None
        at += t.numel()
    return base


class _Keep:
    """Holds the sent buffers until the messages are waited for (a ``wait`` that waits
    for nothing: the works posted beside it do)."""

    def __init__(self, tensors: list):
        self.tensors = tensors

    def wait(self, *args) -> bool:
        self.tensors = []
        return True


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


def ring_forward(q, k, v, plan: RingPlan, rng: dict):
    """Returns out (*, H_q, S_q, D_v) and logsumexp (*, H_q, S_q). ``rng``: what the
    CUDA kernels hand from forward to backward (filled here)."""
    ct = compute_dtype(q.dtype)
    it = kernels.input_dtype(plan.kernel, q.dtype)
    qi = q.to(it)  # (*, H_q, S_q, D)
    o = lse = None  # merged output (*, H_q, S_q, D_v) and logsumexp (*, H_q, S_q), in ct
    kv = [k, v]  # the block held now: (*, H_kv, S_kv_j, D)
    for t in range(plan.n):
        j = (plan.me - t) % plan.n
        how = plan.how(j, q, kv[1])
        # 1. post: pass the current block on, receive the next one (block j-1)
        nxt, works = _post_next_kv(plan, kv, j, t, f"sdpa.ring forward [{how[0]}]")
        # 2. compute on the current block while the next one travels, and merge:
        #    o = (e^lse o + e^lse_j o_j) / (e^lse + e^lse_j), lse = log(e^lse + e^lse_j)
        if how[0] != "skipped":
            kj, vj = heads(kv[0].to(it), plan.rep), heads(kv[1].to(it), plan.rep)
            o, lse = merge(o, lse, *block_attention(qi, kj, vj, plan, j, how, ct, rng))
        # 3. wait for the next block
        if t < plan.n - 1:
            _wait(works)
            kv = nxt
    if o is None:  # no block seen: rows that see no key are 0 (as torch's SDPA), lse -inf
        o = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=ct)
        lse = q.new_full(q.shape[:-1], NEG_INF, dtype=ct)
    return o.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, rng: dict, mask_grad: bool = False):
    """dq (local), dk, dv (of this rank's own K/V block, after their trip round the ring),
    and, with ``mask_grad``, the gradient of ``plan.mask`` (its shape; else None)."""
    ct = compute_dtype(q.dtype)
    it = kernels.input_dtype(plan.kernel, q.dtype)
    ins = {"q": q.to(it), "dout": dout.to(it), "out": out.to(it)}

    def explicit():  # q, dout, delta (*, H_q, S_q), lse (-inf as 0) in ct
        qc, dc, oc = q.to(ct), dout.to(ct), out.to(ct)
        return qc, dc, (dc * oc).sum(-1), lse.masked_fill(lse == NEG_INF, 0.0)

    ins["explicit"] = once(explicit)
    dq = None
    dmask = torch.zeros(plan.mask.shape, dtype=ct, device=q.device) if mask_grad else None
    kv, acc, acc_works, own = [k, v], None, [], None
    for t in range(plan.n):
        j = (plan.me - t) % plan.n
        how = plan.how(j, q, kv[1])
        # 1. post the next K/V block (as in forward)
        nxt, kv_works = _post_next_kv(plan, kv, j, t, f"sdpa.ring backward [{how[0]}]")
        # 2. this rank's contribution to block j's gradients (dQ stays here)
        if how[0] != "skipped":
            dq_j, dk_j, dv_j, ds_j = block_grads(ins, kv[0], kv[1], lse, plan, j, how, ct, rng)
            dq = dq_j if dq is None else dq.add_(dq_j)
            if dmask is not None:  # the mask's columns of block j (its one, if broadcast)
                cols = dmask
                if dmask.shape[-1] != 1:
                    cols = dmask.narrow(-1, plan.kv_starts[j], plan.kv_sizes[j])
                cols += ds_j.sum_to_size(cols.shape)
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
    if dq is None:
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dmask = None if dmask is None else dmask.to(plan.mask.dtype)
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), dmask


def _layout_like(t: torch.Tensor, strides) -> torch.Tensor:
    """``t`` laid out in memory in the order of ``strides`` (outer to inner). A query
    made by ``x.view(B, S, H, D).transpose(1, 2)`` gets an output and a gradient that
    are views again after the inverse ``.transpose(1, 2)``, as from torch's kernels
    (ShardTensor's views act on the local tensor, which must be viewable)."""
    order = sorted(range(t.ndim), key=lambda d: (-strides[d], d))
    if order == list(range(t.ndim)):
        return t.contiguous()
    return t.permute(order).contiguous().permute([order.index(d) for d in range(t.ndim)])


@fenced
class RingAttention(torch.autograd.Function):
    """``out = RingAttention.apply(q, k, v, plan, mask)`` on local blocks (B, H, S_local, D);
    ``mask``: ``plan.mask`` again when it needs a gradient (else None)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, mask=None):
        ctx.strides = [x.stride() for x in (q, k, v)]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.rng = {}  # what the CUDA kernels hand from forward to backward
        out, lse = ring_forward(q, k, v, plan, ctx.rng)
        # a learned mask is saved too: written in place before backward, torch says so
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        ctx.plan = plan
        return _layout_like(out, ctx.strides[0])

    @staticmethod
    @first_order("ring attention (scaled_dot_product_attention)")
    def backward(ctx, dout):
        q, k, v, out, lse = kept(ctx)[:5]
        mask_grad = ctx.needs_input_grad[4]
        *grads, dmask = ring_backward(
            dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.rng, mask_grad
        )
        return (*(_layout_like(g, st) for g, st in zip(grads, ctx.strides)), None, dmask)
