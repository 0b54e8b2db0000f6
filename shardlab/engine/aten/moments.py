"""Variance and standard deviation over a cut dim: one collective, never the whole tensor.

``var`` / ``std`` / ``var_mean`` / ``std_mean`` (``correction``, ``keepdim``) of ``x`` over
``dims``. Over dims no mesh dim cuts, each rank computes its block's (a plan, no message).
Over a cut dim, each rank holds some of the elements of every result entry::

    x (9, 5) rows cut [4, 3, 2], var over dim 0:
      rank 0: rows 0-3  ->  n = 4, mean_0, M2_0   (per column: (3, 5) numbers)
      rank 1: rows 4-6  ->  n = 3, mean_1, M2_1
      rank 2: rows 7-8  ->  n = 2, mean_2, M2_2

1. each rank: its count ``n``, mean and sum of squared deviations ``M2`` (torch's
   ``var_mean`` of its block, correction 0), stacked                  (3, *result_local)
2. one all-gather of that stack over each mesh dim that cuts a reduced dim
3. the pieces combined in rank order with Chan's update, as one device adds rows::

       n = n_a + n_b,  d = mean_b - mean_a,  mean = mean_a + d n_b / n,
       M2 = M2_a + M2_b + d^2 n_a n_b / n

4. ``var = M2 / max(n - correction, 0)`` (torch's divisor), ``std = sqrt(var)``; the
   result is Replicate on the mesh dims that cut the reduced dims, cut like ``x`` along
   the others.

Messages: one all-gather per cut mesh dim of ``3 x`` the result's block (a Partial input
is summed first, one all-reduce). Backward is autograd's formula for the op, in ops that
have rules (a mean over the cut dim, element-wise products).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout.elementwise import reduce_layout
from shardlab.trace import label

aten = torch.ops.aten

_OPS = (aten.var.correction, aten.std.correction, aten.var_mean.correction,
        aten.std_mean.correction)  # fmt: skip


@register(*_OPS)
def moments(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    correction = kwargs.get("correction")
    correction = 1 if correction is None else correction
    keepdim = kwargs.get("keepdim", False)
    n_dims = max(x.ndim, 1)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = list(range(x.ndim))
    else:
        dims = sorted({d % n_dims for d in ([dim] if isinstance(dim, int) else dim)})
    lay = c.without_partial(x._layout)
    cut = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim in dims]
    out = reduce_layout(lay, dims, keepdim)
    many = func in (aten.var_mean.correction, aten.std_mean.correction)
    if x.dtype.is_complex:
        return NotImplemented  # (|d|^2 in Chan's update: not written yet)
    if not cut:  # every reduced dim whole on each rank: the op on each block
        moves = None if lay == x._layout else (lay,) + (None,) * (len(args) + len(kwargs) - 1)
        return Plan(x.device_mesh, (out, out) if many else out, moves, f"{c.op_name(func)}.partial")
    if any(isinstance(p, Partial) for p in x._layout.placements):
        x = c.reduced(x, f"{c.op_name(func)}.partial")
    mesh, name = x.device_mesh, c.op_name(func)
    # 1. this rank's count, mean and M2 over the reduced dims
    local = x._local_tensor
    n = 1
    for d in dims:
        n *= local.shape[d]
    var, mean = torch.var_mean(local, dims, correction=0, keepdim=keepdim)
    count = torch.full_like(mean, float(n))
    if n == 0:  # an empty block adds nothing
        var, mean = torch.zeros_like(var), torch.zeros_like(mean)
    stats = torch.stack([count, mean, var * n])  # (3, *result_local)
    with label(f"{name}.reduce"):
        for m in cut:  # 2. one all-gather per cut mesh dim, 3. combined in rank order
            if mesh.shape[m] == 1:
                continue
            pieces = [torch.empty_like(stats) for _ in range(mesh.shape[m])]
            collectives.all_gather(pieces, stats.contiguous(), mesh.get_group(m))
            stats = pieces[0]
            for other in pieces[1:]:
                stats = _chan(stats, other)
    count, mean, m2 = stats
    var = m2 / (count - correction).clamp(min=0)  # 4. torch's divisor
    mean = torch.where(count == 0, torch.nan, mean)  # (no element at all: nan, as torch)
    first = var.sqrt() if func in (aten.std.correction, aten.std_mean.correction) else var
    places = tuple(Replicate() if m in cut else p for m, p in enumerate(out.placements))
    layout = out.replace(placements=places)
    if many:
        return c.wrap(first, mesh, layout), c.wrap(mean, mesh, layout)
    return c.wrap(first, mesh, layout)


def _chan(a, b):
    """Counts, means and M2s of two sets of elements -> those of their union."""
    na, ma, qa = a
    nb, mb, qb = b
    n = na + nb
    safe = n.clamp(min=1)
    d = mb - ma
    mean = ma + d * nb / safe
    m2 = qa + qb + d * d * na * nb / safe
    return torch.stack([n, mean, m2])
