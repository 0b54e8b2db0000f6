"""``embedding_bag`` over a table cut along its rows (the vocabulary) or its columns.

``F.embedding_bag(idx, W, offsets)``: each bag the sum (mean, max) of the rows of ``W``
its indices name. The indices, offsets and ``per_sample_weights`` whole on every rank::

    W (V=10, D) rows cut [4, 0, 6]      rank 0 sums the rows 0-3 its bags name: Partial(sum)
    W (V, D=5) columns cut [2, 3, 0]    rank 0 its 2 columns of every bag, no message

- columns cut (every mode): each rank runs torch's kernel on its columns, the result cut
  alike (``max``'s indices too), no message;
- rows cut (``sum`` and ``mean``, no ``padding_idx``): each rank's indices into its own
  rows, the others weighted 0 (``mean``: divided by the bag's whole count); the result
  Partial(sum), no message (the sum when it is read).

``_embedding_bag_backward``, the same cuts: the gradient of each rank's rows (or columns)
of ``W``, from the whole (or column-cut) gradient of the result, no message. Else
``NotImplemented``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout

aten = torch.ops.aten
_SUM, _MEAN = 0, 1


def _cut(w):
    """('rows' | 'cols', the mesh dims cutting) of a table cut along one dim, else None."""
    if type(w) is not c.ShardTensor or w.ndim != 2 or not w._layout.is_block():
        return None
    lay = w._layout
    if any(isinstance(p, Partial) for p in lay.placements):
        return None
    dims = {p.dim for k, p in enumerate(lay.placements)
            if isinstance(p, Shard) and lay.mesh_shape[k] > 1}  # fmt: skip
    if len(dims) != 1:
        return None
    cuts = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard)]
    return ("rows" if dims == {0} else "cols"), cuts


def _whole(*ts) -> bool:
    return all(t is None or type(t) is not c.ShardTensor or t._layout.is_whole() for t in ts)


def _remapped(w, idx, psw):
    """This rank's indices into its rows and the weights that keep only those."""
    lo, hi = w._layout.local_box(c.me(w.device_mesh))[0]
    mine = (idx >= lo) & (idx < hi)
    local = torch.where(mine, idx - lo, 0)
    weight = mine.to(w.dtype) if psw is None else torch.where(mine, psw, 0.0)
    return local, weight


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(func, args, kwargs):
    kw = c.schema_args(func, args, kwargs)
    w, idx, off, psw = kw["weight"], kw["indices"], kw["offsets"], kw["per_sample_weights"]
    if type(w) is c.ShardTensor and w._layout.is_whole() and _whole(idx, off, psw):
        # every rank holds it: torch's kernel (the meta kernel's shapes of the bags'
        # bookkeeping results differ from the CPU kernel's: each wrapped as it comes)
        outs = func(*[c.local(a) for a in args], **{k: c.local(v) for k, v in kwargs.items()})
        return tuple(c.as_shard(o, w.device_mesh) for o in outs)
    got = _cut(w)
    if got is None or not _whole(idx, off, psw):
        return NotImplemented
    kind, cuts = got
    mesh, rest = w.device_mesh, (kw["scale_grad_by_freq"], kw["mode"], kw["sparse"])
    idx, off, psw = c.local(idx), c.local(off), c.local(psw)
    if kind == "cols":
        outs = func(w._local_tensor, idx, off, *rest, psw, kw["include_last_offset"],
                    kw["padding_idx"])  # fmt: skip
        sizes = [w._layout.sizes_arg(k) for k in range(mesh.ndim)]

        def laid(i, o):  # the result and max's indices cut as the table's columns
            if o.ndim == 2 and i in (0, 3) and o.shape[0] == outs[0].shape[0]:
                shape = (o.shape[0], w.shape[1])
                lay = ShardLayout.build(shape, tuple(mesh.shape), w._layout.placements, sizes)
                return c.wrap(o, mesh, lay)
            return c.as_shard(o, mesh)

        return tuple(laid(i, o) for i, o in enumerate(outs))
    mode, pad = kw["mode"], kw["padding_idx"]
    if mode not in (_SUM, _MEAN) or pad not in (None, -1) or kw["scale_grad_by_freq"]:
        return NotImplemented
    local, weight = _remapped(w, idx, psw)
    table = w._local_tensor
    if not table.shape[0]:
        table = table.new_zeros(1, w.shape[1])
    last = kw["include_last_offset"]
    outs = func(table, local, off, rest[0], _SUM, rest[2], weight, last, -1)
    if mode == _MEAN:  # each part over the bag's whole count; the other results a mean's
        _, *others = func(table, local, off, rest[0], _MEAN, rest[2], None, last, -1)
        count = others[1].to(outs[0].dtype).clamp_min(1)  # bag_size
        outs = (outs[0] / count[:, None], *others)
    places = [Partial() if k in cuts else Replicate() for k in range(mesh.ndim)]
    first = c.wrap(
        outs[0], mesh, ShardLayout.build(tuple(outs[0].shape), tuple(mesh.shape), places)
    )
    return (first, *(c.as_shard(o, mesh) for o in outs[1:]))


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward(func, args, kwargs):
    """A column-cut table's: the result's gradient (whole: sliced; or cut alike) and
    ``max``'s indices cut along the columns; each rank the gradient of its columns of the
    table, no message."""
    if kwargs:
        return NotImplemented
    cut = next((a for a in args if type(a) is c.ShardTensor and a.ndim == 2
                and (_cut(a) or ("",))[0] == "cols"), None)  # fmt: skip
    if cut is None:
        return NotImplemented
    lay, mesh = cut._layout, cut.device_mesh
    lo, hi = lay.local_box(c.me(mesh))[1]
    local = []
    for a in args:
        if type(a) is c.ShardTensor and a._layout == lay:
            local.append(a._local_tensor)
        elif a is args[0] and _whole(a):
            local.append(c.local(a)[:, lo:hi])  # the gradient whole: its columns
        elif _whole(a):
            local.append(c.local(a))
        else:
            return NotImplemented
    out = func(*local)
    sizes = [lay.sizes_arg(k) for k in range(mesh.ndim)]
    shape = (out.shape[0], cut.shape[1])
    return c.wrap(out, mesh, ShardLayout.build(shape, tuple(mesh.shape), lay.placements, sizes))
