"""A small GPT-style decoder in plain torch (learned positions, LayerNorm, GELU MLP).

Nothing in it knows about shardlab: the LM demo, the benchmark and the tests run it
unchanged on ShardTensors. Head counts come from the tensors (``view(B, S, -1, D)``),
so the same code runs with all heads or with the heads of one tensor-parallel rank.

``attention="allgather"`` is the baseline the ring is measured against: every rank
gathers the whole K and V along the sequence (a ``redistribute`` to Replicate) and
attends its own query rows to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPT", "tp_plan"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, mode: str):
        super().__init__()
        self.head_dim, self.mode = dim // heads, mode
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x, mask=None):  # x (B, S, C)
        b, s = x.shape[:2]
        q, k, v = (
            p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        if self.mode == "allgather":  # the baseline: whole K and V on every rank
            k, v = _gather_sequence(k), _gather_sequence(v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))  # (B, S, C)


def _gather_sequence(t):
    """A ShardTensor (B, H, S, D) with S cut -> S whole (Replicate on that mesh dim)."""
    from torch.distributed.tensor import Replicate, Shard

    from shardlab.tensor import ShardTensor

    if not isinstance(t, ShardTensor):
        return t
    places = [Replicate() if p == Shard(2) else p for p in t.sharding.placements]
    return t.redistribute(t.device_mesh, places)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mode: str):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, mode)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """``forward(input_ids, position_ids=None, attention_mask=None, labels=None,
    shift_labels=None) -> (logits, loss)``; ``attention_mask``: None (causal) or a
    boolean (B, 1, S, S) mask (``shardlab.lm.shard_batch(..., causal=True)`` builds it)."""

    def __init__(self, vocab=128, dim=32, heads=4, layers=2, max_len=8192, attention="ring"):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(
        self, input_ids, position_ids=None, attention_mask=None, labels=None, shift_labels=None
    ):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.tok(input_ids) + self.pos(position_ids)  # (B, S, C)
        for block in self.blocks:
            x = block(x, attention_mask)
        logits = self.head(self.norm(x))  # (B, S, V)
        if labels is None:
            return logits, None
        if shift_labels is None:  # token t predicts token t + 1
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        loss = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
        return logits, loss


def tp_plan(model: TinyGPT, loss_parallel: bool = True) -> dict:
    """torch's tensor-parallel plan: q, k, v, up column-wise; o, down row-wise; the head
    column-wise with class-sharded logits kept sharded (vocab-parallel loss)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        plan.update({p + f"attn.{n}": ColwiseParallel() for n in "qkv"})
        plan.update({p + "attn.o": RowwiseParallel(), p + "up": ColwiseParallel()})
        plan[p + "down"] = RowwiseParallel()
    if loss_parallel:
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan
