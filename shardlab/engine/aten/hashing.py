"""``hash_tensor`` over a cut dim: the blocks' hashes XOR'ed, exact, never the tensor.

``torch.hash_tensor(x, dim, keepdim, mode=0)`` (torch's only mode): every element
upcast to its 64-bit float / integer, its bits read as a ``uint64``, XOR'ed over
``dim`` (every dim when empty). XOR is associative and commutative, so the hash of the
whole is the XOR of the blocks' hashes, bit for bit::

    x (9, 5) rows cut [4, 0, 5], hash over dim 0:
      rank 0: rows 0-3  ->  h_0 = hash(rows 0-3)      (5,) uint64
      rank 1: no row    ->  h_1 = 0                   (XOR's identity; torch refuses an
                                                       empty reduced dim, so no call)
      rank 2: rows 4-8  ->  h_2                       hash = h_0 ^ h_1 ^ h_2

Over dims no mesh dim cuts, each rank hashes its block (a plan, no message). Over a cut
dim:

1. each rank: ``hash_tensor`` of its block over ``dim`` (zeros for an empty one)
2. one all-gather of those hashes (read as int64: gloo carries no uint64) over each
   mesh dim that cuts a reduced dim
3. the pieces XOR'ed; the result Replicate on those mesh dims, cut like ``x`` along the
   others

Messages: one all-gather of the result's block (8 bytes an entry) per cutting mesh dim;
a Partial input summed first (one all-reduce). Not differentiable (a uint64).
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


@register(aten.hash_tensor.default)
def hash_tensor(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", [])
    keepdim = kwargs.get("keepdim", False)
    mode = kwargs.get("mode", 0)
    dim = [dim] if isinstance(dim, int) else list(dim or [])
    n_dims = max(x.ndim, 1)
    dims = sorted({d % n_dims for d in dim}) if dim else list(range(x.ndim))
    lay = c.without_partial(x._layout)
    cut = [m for m, p in enumerate(lay.placements) if isinstance(p, Shard) and p.dim in dims]
    out = reduce_layout(lay, dims, keepdim)
    if not cut:  # every reduced dim whole on each rank: the op on each block
        moves = None if lay == x._layout else (lay,) + (None,) * (len(args) + len(kwargs) - 1)
        return Plan(x.device_mesh, out, moves, "hash_tensor.partial")
    if any(isinstance(p, Partial) for p in x._layout.placements):
        x = c.reduced(x, "hash_tensor.partial")
    mesh, local = x.device_mesh, x._local_tensor
    places = tuple(Replicate() if m in cut else p for m, p in enumerate(out.placements))
    layout = out.replace(placements=places)
    if any(local.shape[d] == 0 for d in dims):  # 1. no element here: XOR's identity
        h = torch.zeros(layout.local_shape(c.me(mesh)), dtype=torch.uint64, device=local.device)
    else:
        h = torch.hash_tensor(local, dims, keepdim=keepdim, mode=mode)
    h = h.view(torch.int64)  # (gloo carries no uint64: the same bits)
    with label("hash_tensor.reduce"):
        for m in cut:  # 2. one all-gather per cut mesh dim, 3. XOR'ed
            if mesh.shape[m] == 1:
                continue
            pieces = [torch.empty_like(h) for _ in range(mesh.shape[m])]
            collectives.all_gather(pieces, h.contiguous(), mesh.get_group(m))
            h = pieces[0]
            for other in pieces[1:]:
                h = h ^ other
    return c.wrap(h.view(torch.uint64), mesh, layout)
