"""Ops that build tensors from pieces: cat, constant padding, new tensors, the backward of
slicing, tril/triu (embedding and indexing: :mod:`.indexing`).

``cat`` along a cut dim (uneven sizes too)::

    a sizes [3, 1], b sizes [2, 2]   ->  out sizes [5, 3]  (rank k: a's part + b's part)
    out rows 0-4 on rank 0 = a[0:3] + a[3:4] + b[0:1]: each input first moves to the
    sizes that tile its stretch of the output (point to point, only what changes owner)

``constant_pad_nd`` along a cut dim grows the first and the last rank only (no message).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard

from shardlab.engine import _common as c
from shardlab.engine import plans
from shardlab.engine.registry import register
from shardlab.engine.rule import BLOCKS, Plan
from shardlab.layout import ShardLayout, chunk_sizes, moves
from shardlab.layout.elementwise import restrict
from shardlab.layout.strides import stride_like
from shardlab.layout.views import clamp_index

from .views import slice_of

aten = torch.ops.aten


def _cutters(layout, dim):
    return [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]


@register(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    shards = c.shards_in(tensors)
    mesh = c.the_mesh(shards)
    ref = max(shards, key=lambda s: s.numel())
    dim %= ref.ndim
    cause = "cat.align"
    given = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and ref.ndim > 1)]
    tensors = given  # torch.cat skips 1-D empty tensors (a cache's first step), so do we
    lay = c.without_partial(ref._layout)
    cut = _cutters(lay, dim)
    if cut and (len(cut) > 1 or not lay.is_block(dim)):
        lay = moves.replicated(lay, cut)
        cut = []
    if not cut:
        out_layout = lay.replace(global_shape=_cat_shape(tensors, dim))
        if all(
            type(t) is c.ShardTensor and t._layout == restrict(lay, t.shape, [False] * mesh.ndim)
            for t in tensors
        ):  # every block as it is (a skipped empty tensor is skipped by torch.cat on the
            # blocks too): the op on the lists of blocks
            return Plan(mesh, out_layout, [BLOCKS] + [None] * (len(args) - 1 + len(kwargs)))
        tensors = [
            c.reduced(t if isinstance(t, c.ShardTensor) else c.as_shard(t, mesh), "cat.partial")
            for t in tensors
        ]
        moved = [c.move(t, restrict(lay, t.shape, [False] * mesh.ndim), cause) for t in tensors]
        return c.wrap(torch.cat([t._local_tensor for t in moved], dim), mesh, out_layout)
    tensors = [
        c.reduced(t if isinstance(t, c.ShardTensor) else c.as_shard(t, mesh), "cat.partial")
        for t in tensors
    ]
    (m,) = cut
    # 1. output sizes: rank k keeps as many rows as it holds of the inputs cut like ref
    parts = []
    for t in tensors:
        tc = _cutters(t._layout, dim)
        if tc == [m] and t._layout.is_block(dim) and len(t._layout.sizes[m]) == 1:
            parts.append(t._layout.sizes[m][0])
        else:
            parts.append(chunk_sizes(t.shape[dim], mesh.shape[m]))
    out_sizes = tuple(map(sum, zip(*parts)))
    bounds = [0]
    for n in out_sizes:
        bounds.append(bounds[-1] + n)
    # 2. each input moves to the sizes that tile its stretch [base, base + n) of the output
    locs, base = [], 0
    for t in tensors:
        n = t.shape[dim]
        sizes = tuple(
            max(0, min(b1, base + n) - max(b0, base)) for b0, b1 in zip(bounds, bounds[1:])
        )
        shape = list(lay.global_shape)
        shape[dim] = n
        entry = list(lay.sizes)
        entry[m] = (sizes,)
        template = lay.replace(global_shape=tuple(shape), sizes=tuple(entry))
        want = restrict(template, t.shape, [False] * mesh.ndim)
        locs.append(c.move(t, want, cause)._local_tensor)
        base += n
    out_entry = list(lay.sizes)
    out_entry[m] = (out_sizes,)
    out = lay.replace(global_shape=_cat_shape(tensors, dim), sizes=tuple(out_entry))
    return c.wrap(torch.cat(locs, dim), mesh, out)


def _cat_shape(tensors, dim):
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return tuple(shape)


@register(aten.constant_pad_nd.default)
def _pad(func, args, kwargs):
    x, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    local_pad = [0] * len(pad)
    for j in range(len(pad) // 2):
        dim = x.ndim - 1 - j
        left, right = pad[2 * j], pad[2 * j + 1]
        if left < 0 or right < 0:  # cropping is slicing
            x = slice_of(x, dim, max(0, -left), x.shape[dim] - max(0, -right))
            left, right = max(left, 0), max(right, 0)
        cut = _cutters(x._layout, dim)
        nested = len(cut) == 2 and x._layout.nested_outer(cut[1]) == cut[0]
        if cut and ((len(cut) > 1 and not nested) or not x._layout.is_block(dim)):
            x = c.move(x, moves.replicated(x._layout, cut), "auto-redistribute for pad")
            cut = []
        if not cut:
            local_pad[2 * j], local_pad[2 * j + 1] = left, right
            continue
        # the fill goes to the first and the last piece (cut twice: at (0, 0), at the end)
        coord, mesh_shape = c.me(x.device_mesh), x.device_mesh.shape
        local_pad[2 * j] = left if all(coord[m] == 0 for m in cut) else 0
        local_pad[2 * j + 1] = right if all(coord[m] == mesh_shape[m] - 1 for m in cut) else 0
        entry = list(x._layout.sizes)
        for m in cut:  # the outer pieces, then the inner ones per outer piece
            rows = [list(r) for r in entry[m]]
            rows[0][0] += left
            rows[-1][-1] += right
            entry[m] = tuple(map(tuple, rows))
        shape = list(x.shape)
        shape[dim] += left + right
        new = x._layout.replace(global_shape=tuple(shape), sizes=tuple(entry))
        x = c.ShardTensor._wrap(
            torch.constant_pad_nd(
                x._local_tensor, [0] * (2 * j) + local_pad[2 * j : 2 * j + 2], value
            ),
            x.device_mesh,
            new,
        )
        local_pad[2 * j] = local_pad[2 * j + 1] = 0
    shape = list(x.shape)
    for j in range(len(local_pad) // 2):
        shape[x.ndim - 1 - j] += local_pad[2 * j] + local_pad[2 * j + 1]
    y = (
        torch.constant_pad_nd(x._local_tensor, local_pad, value)
        if any(local_pad)
        else (x._local_tensor.clone())
    )
    return c.wrap(y, x.device_mesh, x._layout.replace(global_shape=tuple(shape)))


@register(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def _new(func, args, kwargs):
    """A new tensor of a given (global) shape: whole on every rank. ``new_empty_strided``
    of ``x``'s own shape (autograd's copy of a gradient into its parameter's strides) is
    laid out like ``x`` instead: the gradient stays on its blocks, not gathered."""
    x = args[0]
    lay = x._layout
    if (
        func is aten.new_empty_strided.default
        and tuple(args[1]) == tuple(x.shape)
        and not any(isinstance(p, Partial) for p in lay.placements)
    ):
        mesh = x.device_mesh
        local = lay.local_shape(c.me(mesh))
        stride = tuple(args[2])  # the global stride asked for; the block's in its order
        y = func(x._local_tensor, local, stride_like(stride, local), *args[3:], **kwargs)
        y.zero_()  # every rank the same values
        return c.ShardTensor._wrap(y, mesh, lay, stride=stride)
    y = func(x._local_tensor, *args[1:], **kwargs)
    if func is aten.new_empty.default or func is aten.new_empty_strided.default:
        y.zero_()  # every rank must hold the same values of a Replicate tensor
    return c.wrap(y, x.device_mesh, c.replicate_layout(y.shape, x.device_mesh))


@register(aten._local_scalar_dense.default, aten.is_nonzero.default)
def _scalar(func, args, kwargs):
    return func(c.replicated(args[0], "item")._local_tensor)


@register(aten.slice_backward.default)
def _slice_backward(func, args, kwargs):
    """Gradient of a slice: zeros around each rank's block of the gradient, no message.
    Along a cut dim, rank k's piece runs from its first sliced row to the next rank's."""
    grad, sizes, dim, start, end, step = args[:6]
    given = grad
    dim %= grad.ndim
    n = sizes[dim]
    start, end = clamp_index(start, n), clamp_index(end, n)
    grad = c.reduced(grad, "slice_backward.partial")
    lay = grad._layout
    cut = _cutters(lay, dim)
    if cut and (len(cut) > 1 or not lay.is_block(dim)):
        grad = c.move(grad, moves.replicated(lay, cut), "auto-redistribute for slice_backward")
        lay, cut = grad._layout, []
    mesh = grad.device_mesh
    coord = c.me(mesh)
    entry = list(lay.sizes)
    if cut:
        (m,) = cut
        counts = lay.sizes[m][0]
        bounds = [0]
        acc = 0
        for k in range(1, len(counts)):
            acc += counts[k - 1]
            bounds.append(min(n, start + acc * step))
        bounds.append(n)
        bounds = [max(bounds[: i + 1]) for i in range(len(bounds))]
        entry[m] = (tuple(b - a for a, b in zip(bounds, bounds[1:])),)
        lo = bounds[coord[m]]
    else:
        lo = 0
    out = lay.replace(global_shape=tuple(sizes), sizes=tuple(entry))
    got, idx = grad._local_tensor.shape[dim], None
    if got:
        first = (start - lo) if not cut else (start + _first_index(lay, dim, coord) * step - lo)
        idx = (slice(None),) * dim + (slice(first, first + (got - 1) * step + 1, step),)
    local = plans.LocalSliceBackward(out.local_shape(coord), idx)
    if grad is given:  # the gradient's block as it is: the plan
        return Plan(mesh, out, local=local)
    return c.wrap(local([grad._local_tensor], {}), mesh, out)


def _first_index(lay, dim, coord) -> int:
    return lay._piece(dim, tuple(coord))[0]


@register(aten.select_backward.default)
def _select_backward(func, args, kwargs):
    """Gradient of a select: zeros with the row put back, no message. The new dim is
    whole on every rank, as the input's was where its select sent nothing (``x[:, 0]``
    of a whole dim): the gradient comes back in the input's layout, and one that is cut
    there takes its rows locally (Replicate -> Shard sends nothing). Cut into chunks,
    it would have to be gathered again (a view of ``(B, 1, D)`` as ``(B, D)``)."""
    grad, sizes, dim, index = args[:4]
    grad = c.reduced(grad, "select_backward.partial")
    dim %= len(sizes)
    n = sizes[dim]
    index = index + n if index < 0 else index
    lay, mesh = grad._layout, grad.device_mesh
    places = [Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in lay.placements]
    atoms = None if lay.atoms is None else lay.atoms[:dim] + (None,) + lay.atoms[dim:]
    out = ShardLayout(
        tuple(sizes),
        lay.mesh_shape,
        tuple(places),
        lay.sizes,
        atoms,
        None if atoms is None else tuple(lay.cut_of(m) for m in range(mesh.ndim)),
    )
    y = grad._local_tensor.new_zeros(out.local_shape(c.me(mesh)))  # (..., n, ...)
    y.select(dim, index).copy_(grad._local_tensor)
    return c.wrap(y, mesh, out)


@register(aten.tril.default, aten.triu.default)
def _tril(func, args, kwargs):
    """tril / triu keep (row, col) pairs by their *global* positions."""
    x = c.reduced(args[0], "tril.partial")
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    lay, mesh = x._layout, x.device_mesh
    r, k = x.ndim - 2, x.ndim - 1
    if not _cutters(lay, r) and not _cutters(lay, k):
        return c.wrap(func(x._local_tensor, diagonal), mesh, lay)
    coord = c.me(mesh)
    rows = torch.as_tensor(lay.dim_indices(r, coord), device=x._local_tensor.device)
    cols = torch.as_tensor(lay.dim_indices(k, coord), device=x._local_tensor.device)
    keep = (cols[None, :] - rows[:, None]) <= diagonal
    if func is aten.triu.default:
        keep = (cols[None, :] - rows[:, None]) >= diagonal
    local = x._local_tensor
    return c.wrap(torch.where(keep, local, local.new_zeros(())), mesh, lay)
