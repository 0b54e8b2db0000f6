"""Routing tokens to experts on other ranks, and their results back in token order.

What replaces an experts module's ``forward(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k))`` (transformers' fused experts: Mixtral, Qwen2-MoE, OLMoE,
DeepSeek-V3, ...) once its experts are spread over p ranks, E/p each, in rank order::

    rank r: T tokens, k experts each -> T*k (token, expert) pairs
    1. sort the pairs by expert (stable: token order within an expert); count them per
       expert, (E,); a capacity keeps the first C pairs of each expert
    2. counts all-to-all: who sends how many rows to each of my experts, (p, E/p)
    3. dispatch all-to-all: the pairs' token rows, uneven splits -> (R, H), by source rank
    4. my experts on the R rows (the module's own forward, k = 1, weight 1)
    5. combine all-to-all: the R results back to where their rows came from -> (S, H)
    6. back in token order, times the router's weights, summed over each token's k pairs

The router ran on this rank before (the module's own); its weights are applied at step 6
on this rank, so their gradient stays here (the router's parameters: data parallel).
"""

from __future__ import annotations

import math

import torch

from shardlab.experts.exchange import all_to_all, exchange_counts

__all__ = ["capacity_of", "route"]


def capacity_of(tokens: int, k: int, experts: int, factor: float) -> int:
    """The most pairs a rank sends one expert: ``ceil(factor * tokens * k / experts)``
    (``factor`` 1: the even share of this rank's ``tokens`` x ``k`` pairs)."""
    return math.ceil(factor * tokens * k / experts)


def route(hidden, top_k_index, top_k_weights, *, run_local, local: int, params, group,
          ranks: int, capacity):  # fmt: skip
    """Steps 1-6 of the module docstring. ``run_local(rows, index, weights)`` runs this
    rank's ``local`` experts (numbered ``0 .. E/p - 1``), whose weights are ``params``;
    ``capacity``: None (no pair dropped) or a factor (:func:`capacity_of`). Returns
    (T, H), in ``hidden``'s dtype."""
    tokens, k = top_k_index.shape
    width, device = hidden.shape[-1], hidden.device  # H
    experts = local * ranks  # E

    # 1. the (token, expert) pairs, grouped by expert, token order within
    expert_of = top_k_index.reshape(-1)  # (T*k,) pair i = (token i // k, its i % k-th expert)
    order = torch.argsort(expert_of, stable=True)  # (T*k,)
    per_expert = torch.bincount(expert_of, minlength=experts)  # (E,)
    weights = top_k_weights
    if capacity is not None:  # keep the first C pairs of each expert, drop the rest
        cap = capacity_of(tokens, k, experts, capacity)
        start = torch.cumsum(per_expert, 0) - per_expert  # (E,) first sorted pair of each
        sorted_ = torch.arange(order.numel(), device=device)  # (T*k,)
        place = sorted_ - start[expert_of[order]]  # (T*k,) each pair's place in its expert
        order = order[place < cap]  # (S,) the kept pairs, still grouped by expert
        per_expert = per_expert.clamp(max=cap)
        dropped = torch.ones(tokens * k, dtype=torch.bool, device=device)
        dropped[order] = False
        weights = weights.masked_fill(dropped.view(tokens, k), 0)  # (T, k)

    # 2. how many rows each rank sends each of my experts (metadata)
    got = exchange_counts(per_expert, group)  # (p, E/p)
    send_splits = per_expert.view(ranks, local).sum(1).tolist()  # rows to each rank
    recv_splits = got.sum(1).tolist()  # rows from each rank

    # 3. dispatch: each kept pair's token row to the rank of its expert
    rows = hidden[order // k]  # (S, H)
    recv = all_to_all(rows, send_splits, recv_splits, group, "experts.dispatch")  # (R, H)

    # 4. my experts; the rows from rank s come expert by expert, got[s, e] rows each
    ids = torch.arange(local, device=device).repeat(ranks)  # (p*E/p,) source-major
    ids = ids.repeat_interleave(got.reshape(-1))  # (R,) the local expert of each row
    if recv.shape[0]:
        ones = torch.ones(recv.shape[0], 1, dtype=top_k_weights.dtype, device=device)
        out = run_local(recv, ids[:, None], ones)  # (R, H)
    else:  # nothing came: an empty result that still reaches the rows and the weights,
        # so that every rank's backward runs the same messages
        out = recv * 0
        for p in params:
            out = out + p.reshape(-1)[:0].sum()

    # 5. combine: each result back to the rank its row came from, in the order it left
    back = all_to_all(out, recv_splits, send_splits, group, "experts.combine")  # (S, H)

    # 6. token order: pair i's result is row slot[i] of back (a zero row if dropped)
    slot = torch.full((tokens * k,), back.shape[0], dtype=torch.long, device=device)  # (T*k,)
    slot[order] = torch.arange(order.numel(), device=device)
    padded = torch.cat([back, back.new_zeros(1, width)])  # (S + 1, H)
    pairs = padded[slot].view(tokens, k, width)  # (T, k, H)
    return (pairs * weights[..., None]).sum(1).to(hidden.dtype)  # (T, H)
