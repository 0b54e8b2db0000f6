"""``diagonal`` (``diagonal_copy``, ``linalg.diagonal``, ``trace``), its backward and
``diagonal_scatter``: each rank reads or writes the diagonal entries inside its own block,
no message.

With the two diagonal dims whole, each rank takes the diagonals of its own matrices::

    A (6, n, n) Shard(0) sizes [4, 2]   ->   diagonal(A, dim1=-2, dim2=-1) (6, n) Shard(0) [4, 2]

With a diagonal dim cut (a matrix cut along its rows or its columns), each rank owns the
entries of the diagonal that fall in its block: the diagonal (a new last dim) is cut in
the pieces the global layout and the offset give, and each rank takes its block's
diagonal at the offset moved by the block's start::

    A (5, 5) rows cut [2, 1, 2], diagonal(A, offset=1):  entries (i, i + 1), i = 0..3
        rank 0: rows 0-1 -> entries 0, 1 (local offset 1)
        rank 1: row  2   -> entry  2     (local offset 1 + 2 = 3)
        rank 2: rows 3-4 -> entry  3     (local offset 1 + 3 = 4; row 4 has none)
    result (4,) Shard(0) sizes [2, 1, 1]

``trace`` is torch's decomposition, ``diagonal(A).sum()``: the local sums, Partial (one
all-reduce when made whole). The result's dims are the input's without ``dim1`` and
``dim2``, then the diagonal; each cut kept dim keeps its sizes. At most two mesh dims may
cut the diagonal dims (a row and a column cut on a 2-D mesh nest: the diagonal pieces of
a row piece, cut again by the columns).

Backward (``diagonal_backward``) puts each rank's gradient entries back on its own
block's diagonal. It sees the gradient and the input's global sizes only, so a cut
diagonal comes back cut along ``dim1`` (the rows) in the diagonal's pieces, the rows
before and after the diagonal on the first and last rank: a row-cut square input gets
its gradient in its own layout; a column-cut one gets it row-cut (exact, a later op
moves it if it must). ``diagonal_scatter`` writes ``src`` (moved to the input's
diagonal layout, ``diagonal_scatter.align``) into each block. A strided layout keeps
torch's decomposition and the fallback.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardlab.engine import _common as c
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _args(func, args, kwargs, skip: int):
    """(offset, dim1, dim2) after the first ``skip`` arguments, torch's defaults."""
    names = [a.name for a in func._schema.arguments][skip:]
    given = dict(zip(names, args[skip:]), **kwargs)
    return given.get("offset", 0), given.get("dim1", 0), given.get("dim2", 1)


def _piece(layout, coord, d1, d2, offset, length, only=None) -> tuple[int, int]:
    """The diagonal entries ``[lo, hi)`` inside ``coord``'s block (only the cuts of mesh
    dims ``only``, when given: an outer piece)."""
    r0, c0 = max(-offset, 0), max(offset, 0)
    lo, hi = 0, length
    for d, shift in ((d1, r0), (d2, c0)):
        a, b = 0, layout.global_shape[d]
        for m, p in enumerate(layout.placements):
            if isinstance(p, Shard) and p.dim == d and (only is None or m in only):
                a, b = layout.local_box(coord)[d] if only is None else _outer(layout, m, coord)
                break
        lo, hi = max(lo, a - shift), min(hi, b - shift)
    return lo, max(lo, hi)


def _outer(layout, m, coord) -> tuple[int, int]:
    sizes = layout.shard_sizes(m)
    start = sum(sizes[: coord[m]])
    return start, start + sizes[coord[m]]


def diagonal_layout(layout: ShardLayout, d1: int, d2: int, shape, offset=0):
    """The layout of ``diagonal`` (result ``shape``) of a tensor in ``layout``: its dims
    without ``d1``, ``d2`` keep their cuts; a cut of ``d1`` or ``d2`` cuts the diagonal
    (the last dim) in the entries each block holds. None where that is not a layout
    (three mesh dims cutting the two, or a strided layout)."""
    if not layout.is_block():
        return None
    keep = [d for d in range(len(layout.global_shape)) if d not in (d1, d2)]
    cutting = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard)
               and p.dim in (d1, d2)]  # fmt: skip
    if len(cutting) > 2:
        return None
    length, places, sizes = shape[-1], [], []
    for m, p in enumerate(layout.placements):
        if m in cutting:
            zero = (0,) * len(layout.mesh_shape)
            coords = [_at(zero, m, i) for i in range(layout.mesh_shape[m])]
            if m == cutting[0]:
                pieces = [_piece(layout, q, d1, d2, offset, length, only={m}) for q in coords]
                sizes.append([hi - lo for lo, hi in pieces])
            else:  # nested in the first one's pieces
                outer = cutting[0]
                sizes.append(
                    [
                        [
                            _len(_piece(layout, _at(q, outer, j), d1, d2, offset, length))
                            for q in coords
                        ]
                        for j in range(layout.mesh_shape[outer])
                    ]
                )
            places.append(Shard(len(keep)))
            continue
        if isinstance(p, Shard):
            p = Shard(keep.index(p.dim))
        places.append(p)
        sizes.append(layout.sizes_arg(m))
    try:
        return ShardLayout.build(tuple(shape), layout.mesh_shape, places, sizes)
    except ValueError:
        return None


def _at(coord, m, i) -> tuple[int, ...]:
    return tuple(i if k == m else v for k, v in enumerate(coord))


def _len(piece) -> int:
    return piece[1] - piece[0]


def _local_offset(layout, coord, d1, d2, offset) -> int:
    """The offset of the global diagonal in ``coord``'s block (its start moves it)."""
    box = layout.local_box(coord)
    return offset + box[d1][0] - box[d2][0]


class _AtOffset:
    """The op on this rank's block with the diagonal offset its block needs."""

    __slots__ = ("func", "offset", "d1", "d2", "lead")

    def __init__(self, func, offset, d1, d2, lead=1):
        self.func, self.offset, self.d1, self.d2, self.lead = func, offset, d1, d2, lead

    def __call__(self, args, kwargs):
        return self.func(*args[: self.lead], self.offset, self.d1, self.d2)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(func, args, kwargs):
    x = args[0]
    offset, d1, d2 = _args(func, args, kwargs, 1)
    n = max(x.ndim, 1)
    d1, d2 = d1 % n, d2 % n
    meta = meta_call(func, args, kwargs)
    out = diagonal_layout(x._layout, d1, d2, tuple(meta.shape), offset)
    if out is None:
        return NotImplemented
    mine = _local_offset(x._layout, c.me(x.device_mesh), d1, d2, offset)
    if mine == offset:
        return Plan(x.device_mesh, out)  # (the block's own diagonal)
    return Plan(x.device_mesh, out, local=_AtOffset(func, mine, d1, d2))


class _LocalBackward:
    """``diagonal_backward`` on a block: the input sizes made this rank's block's, the
    offset moved by its start."""

    __slots__ = ("sizes", "offset", "d1", "d2")

    def __init__(self, sizes, offset, d1, d2):
        self.sizes, self.offset, self.d1, self.d2 = list(sizes), offset, d1, d2

    def __call__(self, args, kwargs):
        return aten.diagonal_backward.default(args[0], self.sizes, self.offset, self.d1, self.d2)


def _rows_layout(lay, keep, input_sizes, d1, d2, offset) -> ShardLayout:
    """The input layout whose diagonal is ``lay`` (the gradient's): each kept dim's cut
    as it is, a cut of the diagonal as a cut of ``d1`` in the same pieces (the rows
    before the diagonal on the first rank, those after it on the last)."""
    last = None
    r0 = max(-offset, 0)
    length = lay.global_shape[-1]
    tail = input_sizes[d1] - r0 - length
    places, sizes = [], []
    for m, p in enumerate(lay.placements):
        entry = lay.sizes_arg(m)
        if isinstance(p, Shard) and p.dim == len(keep):  # the diagonal
            if last is None:  # the outer (or only) cut of the diagonal
                entry = list(entry)
                entry[0] += r0
                entry[-1] += tail
            else:
                entry = [list(e) for e in entry] if isinstance(entry[0], list) else \
                    [list(entry) for _ in range(lay.mesh_shape[last])]  # fmt: skip
                entry[0][0] += r0
                entry[-1][-1] += tail
            last = m
            p = Shard(d1)
        elif isinstance(p, Shard):
            p = Shard(keep[p.dim])
        places.append(p)
        sizes.append(entry)
    return ShardLayout.build(tuple(input_sizes), lay.mesh_shape, places, sizes)


@register(aten.diagonal_backward.default)
def _diagonal_backward(func, args, kwargs):
    grad, input_sizes = args[0], list(args[1])
    if type(grad) is not c.ShardTensor or not grad._layout.is_block():
        return NotImplemented
    offset, d1, d2 = _args(func, args, kwargs, 2)
    n = len(input_sizes)
    d1, d2 = d1 % n, d2 % n
    keep = [d for d in range(n) if d not in (d1, d2)]
    lay = grad._layout
    try:
        out = _rows_layout(lay, keep, input_sizes, d1, d2, offset)
    except ValueError:
        return NotImplemented
    if diagonal_layout(c.without_partial(out), d1, d2, lay.global_shape, offset) != \
            c.without_partial(lay):  # fmt: skip
        return NotImplemented  # (no input layout has this diagonal: not here)
    me = c.me(grad.device_mesh)
    local = _LocalBackward(out.local_shape(me), _local_offset(out, me, d1, d2, offset), d1, d2)
    return Plan(grad.device_mesh, out, local=local)  # each block's own


@register(aten.diagonal_scatter.default)
def _diagonal_scatter(func, args, kwargs):
    x, src = args[0], args[1]
    if type(x) is not c.ShardTensor:
        return NotImplemented
    offset, d1, d2 = _args(func, args, kwargs, 2)
    n = max(x.ndim, 1)
    d1, d2 = d1 % n, d2 % n
    lay = c.without_partial(x._layout)
    meta = meta_call(aten.diagonal.default, (x, offset, d1, d2), {})
    want = diagonal_layout(lay, d1, d2, tuple(meta.shape), offset)
    if want is None:
        return NotImplemented
    cause = "diagonal_scatter.align"
    first = None if lay == x._layout else ((lay, "diagonal_scatter.partial"),)
    second = None
    if isinstance(src, c.ShardTensor):
        part = c.without_partial(src._layout)
        steps = ((part, "diagonal_scatter.partial"),) if part != src._layout else ()
        steps += ((want, cause),) if want != part else ()
        second = steps or None
    elif isinstance(src, torch.Tensor):
        second = want  # a plain tensor: cut to it (a slice, no message)
    moves = [first, second] + [None] * (len(args) - 2 + len(kwargs))
    mine = _local_offset(lay, c.me(x.device_mesh), d1, d2, offset)
    return Plan(x.device_mesh, lay, moves, cause, local=_AtOffset(func, mine, d1, d2, lead=2))
