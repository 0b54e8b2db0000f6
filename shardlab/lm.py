"""A language-model batch, sharded along the sequence: ``model(**batch)`` runs unchanged.

:func:`shard_batch` cuts ``input_ids`` (B, S), ``attention_mask`` and ``labels`` the same
way along S, checks that they agree (the same error on every rank: every check reads
global shapes only), and adds what a decoder needs to see global positions::

    S = 10 on 3 ranks, sizes [4, 3, 3]      contiguous            head-tail (2N chunks)
        rank 0                              tokens 0-3            chunks 0 and 5
        rank 1                              tokens 4-6            chunks 1 and 4
        rank 2                              tokens 7-9            chunks 2 and 3

* ``position_ids``: the true position of every stored token (RoPE reads them);
* ``attention_mask`` (B, S) with zeros (padding) becomes the boolean 4-D mask a decoder
  would build, (B, 1, S, S) = causal AND key-not-padded, **cut along the query rows**:
  a rank holds (B, 1, S_local, S), never the whole S x S mask; the ring attention then
  uses, at each step, the columns of the visiting K/V block;
* ``labels``: with contiguous blocks the decoder's own shift (``labels[..., 1:]``) crosses
  the shard boundaries: shardlab moves one label per boundary. Head-tail stored tokens
  are not in order, so the shift is done here on the full labels and handed to the
  loss as ``shift_labels`` (transformers' causal-LM loss takes it).

Head-tail (``head_tail=True``): with a causal mask, rank r of N holds chunks r and
2N-1-r of 2N, so every rank does the same attention work. Run the model inside
``shardlab.ops.attention.head_tail()`` (the causal ring reads the true positions).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.layout import chunk_sizes

__all__ = ["shard_batch"]


def shard_batch(
    mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    mesh_dim: int = 0,
    sizes=None,
    head_tail: bool = False,
    ignore_index: int = -100,
) -> dict:
    """``input_ids`` (B, S) and friends, the same full tensors on every rank, sharded
    along S over mesh dim ``mesh_dim`` (Replicate on the other mesh dims); returns the
    keyword arguments of ``model(**batch)``: ``input_ids``, ``position_ids``, and
    ``attention_mask`` / ``labels`` (+ ``shift_labels`` when ``head_tail``) when given.

    ``sizes``: rows of each rank along S (default ``torch.chunk``'s); with
    ``head_tail`` they are :func:`~shardlab.ops.attention.head_tail_sizes`.
    No communication: every rank keeps its own block.
    """
    from shardlab.ops.attention import head_tail_order, head_tail_sizes
    from shardlab.tensor import ShardTensor, distribute

    # 1. arguments: full (B, S) tensors, alike, long enough
    for name, t in (
        ("input_ids", input_ids),
        ("attention_mask", attention_mask),
        ("labels", labels),
    ):
        if isinstance(t, ShardTensor) or (t is not None and not isinstance(t, torch.Tensor)):
            raise TypeError(
                f"shard_batch: {name} must be a plain (B, S) tensor, the same on every rank "
                f"(shard_batch cuts it), got {type(t).__name__}"
            )
    if input_ids.ndim != 2:
        raise ValueError(f"shard_batch: input_ids must be (B, S), got {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("labels", labels)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"shard_batch: {name} of shape {tuple(t.shape)} must have input_ids' shape "
                f"{tuple(input_ids.shape)} (it is cut along the sequence the same way)"
            )
    if not 0 <= mesh_dim < mesh.ndim:
        raise ValueError(f"shard_batch: mesh_dim={mesh_dim} for a {mesh.ndim}-D mesh")
    b, s = input_ids.shape
    parts = mesh.shape[mesh_dim]
    if s < parts:
        raise ValueError(
            f"shard_batch: a sequence of {s} tokens on {parts} ranks (mesh dim {mesh_dim}): "
            "each rank needs at least one token"
        )
    if head_tail:
        want = head_tail_sizes(s, parts)
        if sizes is not None and list(sizes) != want:
            raise ValueError(f"shard_batch: head_tail needs sizes {want}, got {list(sizes)}")
        sizes = want
    sizes = list(chunk_sizes(s, parts) if sizes is None else sizes)
    if len(sizes) != parts or sum(sizes) != s or min(sizes) < 1:
        raise ValueError(
            f"shard_batch: sizes {sizes} must be {parts} positive numbers adding up to {s}"
        )

    # 2. the stored order of the tokens (head-tail permutes them)
    device = input_ids.device
    order = head_tail_order(s, parts, device) if head_tail else torch.arange(s, device=device)
    places = [Replicate()] * mesh.ndim
    places[mesh_dim] = Shard(1)
    cut = [None] * mesh.ndim
    cut[mesh_dim] = sizes

    def shard(t):  # (B, S) in true order -> stored order -> this rank's tokens
        return distribute(t.index_select(1, order), mesh, places, cut)

    positions = distribute(order.expand(b, s), mesh, places, cut)  # already stored order
    batch = {"input_ids": shard(input_ids), "position_ids": positions}

    # 3. the 4-D mask, cut along the query rows (only when there is padding to say)
    if attention_mask is not None:
        keep = attention_mask.to(torch.bool)  # (B, S), False = padding
        if bool(keep.all()) and not head_tail:
            pass  # causal only: the decoder passes is_causal, no mask is built
        else:
            batch["attention_mask"] = _row_mask(keep, order, mesh, mesh_dim, sizes)
    # 4. labels: the decoder shifts them itself unless the tokens are permuted
    if labels is not None:
        batch["labels"] = shard(labels)
        if head_tail:
            shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
            batch["shift_labels"] = shard(shifted)
    return batch


def _row_mask(keep, order, mesh, mesh_dim, sizes):
    """This rank's rows of the (B, 1, S, S) boolean mask: query i sees key j iff
    pos(j) <= pos(i) and key j is not padding (positions: true ones, stored order)."""
    from shardlab.tensor import ShardTensor

    coord = mesh.get_coordinate()[mesh_dim]
    start = sum(sizes[:coord])
    rows = order[start : start + sizes[coord]]  # true positions of my queries
    causal = order[None, :] <= rows[:, None]  # (S_local, S), keys in stored order
    mask = causal[None, None] & keep.index_select(1, order)[:, None, None, :]  # (B,1,S_l,S)
    places = [Replicate()] * mesh.ndim
    places[mesh_dim] = Shard(2)
    cut = [None] * mesh.ndim
    cut[mesh_dim] = sizes
    return ShardTensor.from_local(mask, mesh, places, cut, validate=False)
