"""``F.dropout`` on a ShardTensor: every rank draws the mask of its own block only.

Two seeded schemes; both give every rank its block of ONE global mask, so the result is
the same for any mesh and any shard sizes (1 rank = single device)::

    global mask (N, C, H, W)      rank 0 [ rows 0-2 ]   rank 1 [ rows 3-4 ]   rank 2 ...
    element e (global flat index) keeps  <=>  u(seed, e) >= p

* ``"counter"`` (default): u(seed, e) = splitmix64(seed + e * golden) / 2^64
  (``_counter.py``, shared with attention dropout), computed for the local elements
  only (O(local) memory and work). ``seed`` is one draw of
  ``torch.randint`` from the default generator, so ``torch.manual_seed(s)`` on every rank
  makes the run reproducible, and the generator advances the same way on every rank
  (ranks whose generators differ draw different seeds: seed them alike). Not the bits of
  torch's own dropout.
* ``"torch"``: the same mask as torch's ``F.dropout`` on one device after the same
  ``torch.manual_seed``: every rank draws torch's full-size Bernoulli noise and keeps its
  block. Exact, but O(global) memory and work per rank: for checks and teaching.

``training=False`` or ``p=0``: the input itself. No communication ever; backward is the
mask times 1/(1-p) on the local block. ``inplace=True`` is accepted and returns a new
ShardTensor (the local block is not modified).
"""

from __future__ import annotations

import contextlib

import torch

from shardlab.ops._cnn_common import check_no_partial
from shardlab.ops._counter import counter_keep, draw_seed
from shardlab.ops.registry import register

SCHEMES = ("counter", "torch")
_SCHEME = ["counter"]


@contextlib.contextmanager
def mask_scheme(name: str):
    """``with shardlab.ops.dropout.mask_scheme("torch"):`` choose the scheme (see module)."""
    if name not in SCHEMES:
        raise ValueError(f"mask scheme must be one of {SCHEMES}, got {name!r}")
    old, _SCHEME[0] = _SCHEME[0], name
    try:
        yield
    finally:
        _SCHEME[0] = old


def _global_indices(input, device=None) -> list[torch.Tensor]:
    """Per dim, the global indices this rank's block holds, shaped to broadcast against
    each other: consecutive, strided (a flattened (B*S) dim) or cut by two mesh dims."""
    layout, coord = input.sharding, tuple(input.device_mesh.get_coordinate())
    out = []
    for d in range(input.ndim):
        view = [1] * input.ndim
        view[d] = -1
        idx = torch.as_tensor(layout.dim_indices(d, coord), dtype=torch.long, device=device)
        out.append(idx.view(view))
    return out


def _rows_and_cols(input, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's block as (rows, cols) of the global row-major flat index, ``index =
    rows[:, None] + cols[None, :]``: rows over the leading dims (times the last dim's
    length), cols the last dim's global indices; on ``device``."""
    idx = _global_indices(input, device)
    if not idx:  # a 0-d tensor: one element, index 0
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return zero, zero
    lead = torch.zeros((), dtype=torch.long, device=device)
    for n, i in zip(input.shape[:-1], idx[:-1]):
        lead = lead * n + i
    shape = input.to_local().shape
    rows = lead.expand(*shape[:-1], 1).reshape(-1) * input.shape[-1]
    return rows, idx[-1].reshape(-1)


@register("dropout", row_wise=True)
def dropout(input, p=0.5, training=True, inplace=False):
    from shardlab.tensor.create import from_layout

    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    check_no_partial("dropout", input)
    x = input.to_local()
    if p == 1.0:
        y = x * 0
    elif _SCHEME[0] == "torch":  # torch's own noise for the whole tensor, then my block
        noise = torch.empty(tuple(input.shape), dtype=x.dtype).bernoulli_(1 - p)
        keep = noise[tuple(_global_indices(input))]
        y = x * (keep.to(x.device) / (1 - p))
    else:
        seed = draw_seed()  # same generator state -> same seed
        # where the block is, a few rows at a time (the int64 hashing is ~40 B an element)
        keep = counter_keep(seed, *_rows_and_cols(input, x.device), p).view(x.shape)
        y = x * (keep.to(x.dtype) / (1 - p))
    return from_layout(y, input.device_mesh, input.sharding)
