"""``nn.MultiheadAttention`` on a sequence-sharded input: ``F.multi_head_attention_forward``.

torch's own version flattens (S, B, E) to (S*B, E) for the projections, which merges
the sharded sequence dim. This one keeps (B, H, S_local, head_dim) blocks throughout::

    query/key/value (S, B, E) sharded on S
      1. projections on local rows                      (B, H, S_local, hd)   no messages
      2. ring attention (shardlab.ops.attention)        (B, H, S_local, hd)   K/V ring
      3. output projection on local rows                (S, B, E) sharded on S
      need_weights=True: the weights of the local queries against all keys
      (B, S_local, S), from one all-gather of K (the weights are O(S_local x S) anyway)

Supported: self- and cross-attention (a plain query, such as a learned probe, is read as
replicated), packed or separate projection weights, biases,
attn_mask (2-D or 3-D, bool or float), key_padding_mask, is_causal, need_weights and
average_attn_weights, dropout in training (the ring's attention dropout, one global mask
indexed by (batch, head, query, key): the same for any world size and shard sizes, not
torch's own bits; the weights returned with ``need_weights`` are the dropped ones, as
torch's, from the same mask). Not supported (clear error): bias_k/bias_v,
add_zero_attn, static_k/static_v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

from shardlab.ops.registry import register


@register("multi_head_attention_forward")
def multi_head_attention_forward(
    query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
    bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
    training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
    use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
    v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
    is_causal=False,
):  # fmt: skip
    from shardlab.ops._attn_args import whole_if_plain
    from shardlab.ops._attn_dropout import check_p
    from shardlab.ops._counter import draw_seed
    from shardlab.ops.attention import attend

    for name, bad in (
        ("bias_k/bias_v", bias_k is not None or bias_v is not None),
        ("add_zero_attn", add_zero_attn),
        ("static_k/static_v", static_k is not None or static_v is not None),
    ):
        if bad:
            raise NotImplementedError(
                f"multi_head_attention_forward on a ShardTensor: {name} "
                "is not supported; redistribute the input to Replicate()"
            )
    if query.shape[-1] != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {query.shape[-1]}"
        )
    dropout_p = dropout_p if training else 0.0  # as torch, which with need_weights drops
    dropout_p = max(dropout_p, 0.0) if need_weights else dropout_p  # only for p > 0
    if dropout_p:  # torch's error: F.dropout's (need_weights) or SDPA's
        check_p(dropout_p, ValueError if need_weights else RuntimeError)
    seed = draw_seed() if dropout_p else None  # one mask for the output and the weights
    query = whole_if_plain(query, key, value)  # SigLIP's learned probe: one query, whole
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None,) * 3

    def project(x, w, b):  # (S, B, E) -> (B, H, S_local, hd), local rows only
        return F.linear(x.transpose(0, 1), w, b).unflatten(-1, (num_heads, -1)).transpose(1, 2)

    q, k, v = (project(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    batch, length = q.shape[0], k.shape[2]
    mask = _merged_mask(
        attn_mask, key_padding_mask, batch, num_heads, q.shape[2], length, is_causal
    )
    causal = is_causal and attn_mask is None
    attn = attend(q, k, v, mask, dropout_p, causal, None, False, seed)  # (B, H, S_local, hd)
    out = F.linear(attn.transpose(1, 2).flatten(-2), out_proj_weight, out_proj_bias)
    out = out.transpose(0, 1)  # (S, B, E) sharded on S
    if not need_weights:
        return out, None
    return out, _weights(q, k, mask, causal, average_attn_weights, dropout_p, seed)


def _merged_mask(attn_mask, key_padding_mask, batch, heads, lq, lk, is_causal):
    """torch's masks (True = masked out) as one SDPA mask (True = attend, or additive)."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, heads, lq, lk)
        mask = ~mask if mask.dtype == torch.bool else mask
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, S_k)
        if kpm.dtype == torch.bool:
            kpm = ~kpm
            if mask is not None and mask.dtype != torch.bool:
                kpm = torch.zeros_like(kpm, dtype=mask.dtype).masked_fill(~kpm, float("-inf"))
        elif mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=kpm.dtype).masked_fill(~mask, float("-inf"))
        if mask is None:
            mask = kpm
        elif mask.dtype == torch.bool:
            mask = mask & kpm
        else:
            mask = mask + kpm
    return mask


def _weights(q, k, mask, causal, average, dropout_p, seed):
    """Attention weights of the local queries against all keys: (B, S_local, S_k);
    with dropout the dropped ones (the ring's mask, from the same seed), as torch's."""
    from shardlab.comm.p2p import my_coord
    from shardlab.ops._attn_args import layout_of
    from shardlab.ops.attention import dropout_mask
    from shardlab.tensor import ShardTensor

    mesh = q.device_mesh
    k_all = k.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()  # (B, H, S_k, hd)
    q_local = q.to_local()  # (B, H, S_local, hd)
    scores = q_local @ k_all.transpose(-1, -2) / q_local.shape[-1] ** 0.5
    if mask is not None or causal:
        lay = q.sharding
        start = lay.local_offset(my_coord(mesh))[2]
        rows = torch.arange(start, start + q_local.shape[2], device=scores.device)
        if causal:
            cols = torch.arange(k_all.shape[2], device=scores.device)
            scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        if mask is not None:
            m = mask.full_tensor() if isinstance(mask, ShardTensor) else mask
            m = m[..., rows, :] if m.dim() >= 2 and m.shape[-2] > 1 else m
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    w = scores.softmax(-1)  # (B, H, S_local, S_k)
    if dropout_p:
        drop = dropout_mask(dropout_p, seed, q.sharding, layout_of(k, mesh), mesh, my_coord(mesh))
        w = w * drop.keep(0, k_all.shape[2], w) * drop.factor
    w = w.mean(1) if average else w
    seq_dim = 1 if average else 2
    sizes = [
        list(q.sharding.sizes_along(2)) if p.is_shard() and p.dim == 2 else None
        for p in q.placements
    ]
    placements = [type(p)(seq_dim) if p.is_shard() and p.dim == 2 else p for p in q.placements]
    shape = (
        (q.shape[0], q.shape[2], k.shape[2])
        if average
        else (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    )
    if any(p.is_shard() and p.dim != 2 for p in q.placements):
        raise NotImplementedError(
            "need_weights with q sharded on batch/heads: pass need_weights=False"
        )
    return ShardTensor.from_local(w, mesh, placements, sizes, shape=shape, validate=False)
