"""``_unsafe_masked_index`` / ``_unsafe_masked_index_put_accumulate`` (what torch's
decompositions of ``interpolate`` and padding emit) as the ops they are made of.

Each is torch's own composition (indices clamped into range, then an ``index`` /
``index_put``, and the mask applied), dispatched op by op on ShardTensors::

    _unsafe_masked_index(x, mask, idx, fill)        = x[clamp(idx)].masked_fill(~mask, fill)
    _unsafe_masked_index_put_accumulate(x, m, i, v) = x.index_put(clamp(i), v * m, True)

so a cut ``x`` with whole indices takes the index family's rules (each rank the entries it
owns: :mod:`.scatter`), never the whole-tensor fallback. Messages: those of the ops.
"""

from __future__ import annotations

import torch

from shardlab.engine.registry import register

aten = torch.ops.aten


def _clamped(x, indices):
    out = []
    for idx, n in zip(indices, x.shape):
        if idx is not None and idx.dtype not in (torch.int64, torch.int32):
            return None  # (torch refuses it: the fallback raises its error)
        out.append(None if idx is None else idx.clamp(-n, n - 1))
    return out + list(indices[len(out) :])


@register(aten._unsafe_masked_index.default)
def masked_index(func, args, kwargs):
    x, mask, indices, fill = args
    got = _clamped(x, indices)
    if got is None or kwargs or x.numel() == 0:
        return NotImplemented
    return aten.index.Tensor(x, got).masked_fill(aten.logical_not(mask), fill)


@register(aten._unsafe_masked_index_put_accumulate.default)
def masked_index_put(func, args, kwargs):
    x, mask, indices, values = args
    got = _clamped(x, indices)
    if got is None or kwargs:
        return NotImplemented
    return aten.index_put(x, got, values.masked_fill(aten.logical_not(mask), 0), True)
