"""A language-model batch, sharded along the sequence: ``model(**batch)`` runs unchanged.

:func:`shard_batch` cuts ``input_ids`` (B, S), ``attention_mask`` and ``labels`` the same
way along S and checks that they agree (the same error on every rank: every check reads
global shapes only)::

    S = 10 on 3 ranks, sizes [4, 3, 3]      contiguous            head-tail (2N chunks)
        rank 0                              tokens 0-3            chunks 0 and 5
        rank 1                              tokens 4-6            chunks 1 and 4
        rank 2                              tokens 7-9            chunks 2 and 3

Two ways to hand the model its batch:

* default (``causal=False``): exactly what one device would get, cut along S. The model
  computes its positions and masks itself from the global shapes, so any model is exact:
  encoders (BERT), decoders, positions counted from the padding (OPT, RoBERTa), ALiBi
  (BLOOM). A model that turns a padding mask into a 4-D mask builds all (B, 1, S, S) of
  it on every rank.
* ``causal=True``, for causal decoders whose positions are 0..S-1 whatever the padding
  (Llama, Qwen2, Mistral, GPT-2, ...): adds

  - ``position_ids``: the true position of every stored token (RoPE reads them);
  - an ``attention_mask`` (B, S) with zeros (padding) becomes the boolean 4-D mask the
    decoder would build, (B, 1, S, S) = causal AND key-not-padded, **cut along the query
    rows**: a rank holds (B, 1, S_local, S), never the whole S x S mask; the ring
    attention then uses, at each step, the columns of the visiting K/V block.

  It is not the one-device result for a model that is not causal (BERT) or that counts
  positions from the mask (OPT): leave ``causal`` off for those.

``labels``: with contiguous blocks the model's own shift (``labels[..., 1:]``) crosses the
shard boundaries: shardlab moves one label per boundary. Head-tail stored tokens are not in
order, so the shift is done here on the full labels and handed to the loss as
``shift_labels`` (transformers' causal-LM loss takes it).

Head-tail (``head_tail=True``, which implies ``causal=True``): with a causal mask, rank r
of N holds chunks r and 2N-1-r of 2N, so every rank does the same attention work. Run the
model inside ``shardlab.ops.attention.head_tail()`` (the causal ring reads the true
positions).
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
    causal: bool | None = None,
    ignore_index: int = -100,
) -> dict:
    """``input_ids`` (B, S) and friends, the same full tensors on every rank, sharded
    along S over mesh dim ``mesh_dim`` (Replicate on the other mesh dims); returns the
    keyword arguments of ``model(**batch)``: ``input_ids`` and, when given,
    ``attention_mask`` / ``labels``; with ``causal`` also ``position_ids`` (and the
    mask as the causal-and-padding rows, see the module), with ``head_tail`` also
    ``shift_labels``.

    ``sizes``: rows of each rank along S (default ``torch.chunk``'s); with
    ``head_tail`` they are :func:`~shardlab.ops.attention.head_tail_sizes`.
    ``causal``: default ``head_tail``; ``head_tail`` needs it.
    No communication: every rank keeps its own block.

    Args:
        mesh: the DeviceMesh (1-D, or 2-D such as ``("seq", "tp")``).
        input_ids: (B, S) token ids, the same full tensor on every rank.
        attention_mask: (B, S) padding mask, or None.
        labels: (B, S) labels for the causal-LM loss, or None.
        mesh_dim: the mesh dim the sequence is cut along.
        sizes: rows of each rank along S, or None.
        head_tail: rank r holds chunks r and 2N-1-r of 2N (equal causal work).
        causal: global ``position_ids`` and a causal-and-padding mask cut along the query
            rows (for causal decoders; not for encoders or models that count positions from
            the mask).
        ignore_index: the label that the loss ignores (the padding of ``shift_labels``).

    Communicates:
        Nothing here. The model then sends one label per shard boundary (the label shift),
        the ring's K/V in attention, and one all-reduce of 3 numbers for the loss's mean.
        Bad input raises the same ``ValueError`` on every rank.

    Example::

        from shardlab.lm import shard_batch

        with shardlab.patched():
            batch = shard_batch(mesh, input_ids, attention_mask, labels, causal=True)
            out = model(**batch)                  # an unchanged transformers decoder
            out.loss.backward()
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
    if causal is None:
        causal = head_tail
    if head_tail and not causal:
        raise ValueError(
            "shard_batch: head_tail=True permutes the tokens, which only a causal decoder "
            "with positions 0..S-1 can take (it needs causal=True)"
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

    batch = {"input_ids": shard(input_ids)}
    if not causal:
        # 3a. what one device gets, cut: the model makes its positions and masks itself
        if attention_mask is not None:
            batch["attention_mask"] = shard(attention_mask)
    else:
        # 3b. true positions, and the 4-D mask cut along the query rows (when there is
        #     padding to say; without, the decoder passes is_causal and builds no mask)
        batch["position_ids"] = distribute(order.expand(b, s), mesh, places, cut)
        keep = None if attention_mask is None else attention_mask.to(torch.bool)  # (B, S)
        if keep is not None and (head_tail or not bool(keep.all())):
            batch["attention_mask"] = _row_mask(keep, order, mesh, mesh_dim, sizes)
    # 4. labels: the model shifts them itself unless the tokens are permuted
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
