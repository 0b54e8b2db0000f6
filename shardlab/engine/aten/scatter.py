"""Scatter and index ops along a cut dim, with a whole index: each rank its own rows.

A target cut along the dim an index addresses, the index (and the source) whole on
every rank: each rank holds every entry, and writes those whose target row it owns. No
message. The entries addressed elsewhere go to one spare row past the block's end,
dropped after (so every reduction, ``mean`` and overwrite included, sees exactly the
entries of its rows)::

    self (6, 3) rows cut [4, 2], self.index_add(0, index=[5, 0, 5], source (3, 3)):
      rank 0 rows 0-3: local index [4, 0, 4]  (4 = the spare row)  -> rows 0-3
      rank 1 rows 4-5: local index [1, 2, 1]  (2 = the spare row)  -> rows 4-5

``gather`` / ``index_select`` of a cut input, the other way round: each rank picks the
entries it owns and zeros elsewhere, a ``Partial(sum)`` result (every entry owned by
exactly one rank, so the sum is exact; summed where a later op needs it whole).

1. the index moved into the block's rows (``index - start``; elsewhere: the spare row,
   or a placeholder whose pick is zeroed)
2. torch's op on the block (+ the spare row)
3. the spare row dropped / the picks not owned zeroed

Messages: none (the ``Partial`` result: one all-reduce when it is needed whole; a
Partial value written, ``x[i] += v``, is summed first: one all-reduce of the values). The
layouts read: the target (input) cut along ``dim`` by one mesh dim in blocks, nothing
else cut; the index and source plain tensors or Replicate. Others: the next stage.
An index out of range raises torch's error on every rank (the index is whole there).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.aten.scatter_sources import by_cut_index, from_cut_sources
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten

_WRITES = (
    aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce,
    aten.scatter_reduce_, aten.index_add, aten.index_add_, aten.index_copy, aten.index_copy_,
    aten.index_fill, aten.index_fill_, aten.index_reduce, aten.index_reduce_,
)  # fmt: skip
_PICKS = (aten.index_select,)  # (and gather: indexing._gather asks picks first)


def _cut_along(x, dim):
    """The one mesh dim of more than one rank that cuts ``dim`` of ``x`` in blocks, with
    nothing else cut or Partial; else None."""
    cut = _the_cut(x)
    return cut[0] if cut is not None and cut[1] == dim else None


def _the_cut(x):
    """(mesh dim, tensor dim) of the one cut of ``x`` (one mesh dim of more than one rank,
    in blocks; nothing else cut or Partial); else None."""
    cut = None
    for m, p in enumerate(x._layout.placements):
        if isinstance(p, Partial):
            return None
        if isinstance(p, Shard) and x.device_mesh.shape[m] > 1:
            if cut is not None:
                return None
            cut = (m, p.dim)
    if cut is None or not x._layout.is_block(cut[1]):
        return None
    return cut


def _whole(t) -> bool:
    """A plain tensor, a scalar, or a ShardTensor whole on every rank."""
    if not isinstance(t, c.ShardTensor):
        return True
    return all(isinstance(p, Replicate) for p in t._layout.placements)


def _read(func, args, kwargs):
    """(x, dim, index) of the call, or None when it is not one this file takes."""
    if "out" in kwargs or len(args) < 3 or not isinstance(args[0], c.ShardTensor):
        return None
    x, dim, index = args[0], args[1], args[2]
    if not isinstance(dim, int) or not isinstance(index, torch.Tensor):
        return None
    if not all(_whole(a) for a in (*args[2:], *kwargs.values())):
        return None
    return x, dim % max(x.ndim, 1), index


@register(*_WRITES)
def _writes(func, args, kwargs):
    sources = from_cut_sources(func, args, kwargs)  # cut entries into a whole target
    if sources is not NotImplemented:
        return sources
    lines = _lines(func, args, kwargs)  # another dim cut: each rank its own lines
    if lines is not NotImplemented:
        return lines
    read = _read(func, args, kwargs)
    if read is None:
        return NotImplemented
    x, dim, _ = read
    if _cut_along(x, dim) is None:
        return NotImplemented
    lo, n = _my_rows(x, dim)
    local = _OwnRows(func, dim, lo, n, x.shape[dim], c.is_inplace(func))
    return Plan(x.device_mesh, x._layout, None, c.op_name(func), local, inplace=local.inplace)


@register(*_PICKS)
def picks(func, args, kwargs):
    by_index = by_cut_index(func, args, kwargs)  # a whole input, a cut index
    if by_index is not NotImplemented:
        return by_index
    read = _read(func, args, kwargs)
    if read is None:
        return NotImplemented
    x, dim, index = read
    m = _cut_along(x, dim)
    if m is None:
        return NotImplemented
    shape = list(x.shape)
    if func.overloadpacket is aten.gather:
        shape = list(index.shape)
    else:
        shape[dim] = index.numel()
    places = [Partial() if k == m else Replicate() for k in range(x.device_mesh.ndim)]
    out = ShardLayout.build(tuple(shape), x._layout.mesh_shape, places)
    lo, n = _my_rows(x, dim)
    local = _OwnPicks(func, dim, lo, n, x.shape[dim], tuple(shape))
    return Plan(x.device_mesh, out, None, c.op_name(func), local)


def _my_rows(x, dim):
    """(start, length) of this rank's rows along ``dim``."""
    coord = c.me(x.device_mesh)
    return x._layout.local_offset(coord)[dim], x._layout.local_shape(coord)[dim]


_INDEX_ERRORS = {aten.index_copy, aten.index_copy_, aten.index_select, aten.index_reduce,
                 aten.index_reduce_, aten.index_fill, aten.index_fill_, aten.index,
                 aten.index_put, aten.index_put_, aten._index_put_impl_}  # fmt: skip
# (those that wrap a negative index, as torch does: x[-1], x[:, [-1, 0]] = v)
_WRAPPING = {aten.index_fill, aten.index_fill_, aten.index, aten.index_put, aten.index_put_,
             aten._index_put_impl_}  # fmt: skip


def _checked(func, index, size, dim):
    """``index`` in ``[0, size)``, or torch's error for it (every rank: the index is
    whole); ``index_fill``, ``x[index]`` and ``index_put`` wrap negative indices, as
    torch does."""
    low = -size if func.overloadpacket in _WRAPPING else 0
    wrong = (index < low) | (index >= size)
    if index.numel() and bool(wrong.any()):
        bad = index[wrong].flatten()[0].item()
        error = IndexError if func.overloadpacket in _INDEX_ERRORS else RuntimeError
        raise error(f"index {bad} is out of bounds for dimension {dim} with size {size}")
    return index % max(size, 1)


def _in_block(index, lo, n, elsewhere):
    """(which entries of ``index`` fall in this rank's rows ``[lo, lo + n)``, the index
    moved into the block's rows, ``elsewhere`` for the others)."""
    inside = (index >= lo) & (index < lo + n)
    return inside, torch.where(inside, index - lo, elsewhere)


def _with_spare_row(x, dim):
    """``x`` with one row of zeros past its end along ``dim`` (the spare row)."""
    spare = list(x.shape)
    spare[dim] = 1
    return torch.cat([x, x.new_zeros(spare)], dim)


class _OwnRows:
    """Steps 1-3 of a scatter / index write on this rank's rows (+ one spare row)."""

    __slots__ = ("func", "dim", "lo", "n", "size", "inplace")

    def __init__(self, func, dim, lo, n, size, inplace):
        self.func, self.dim, self.lo, self.n = func, dim, lo, n
        self.size, self.inplace = size, inplace

    def __call__(self, args, kwargs):
        x, index = args[0], args[2]
        index = _checked(self.func, index, self.size, self.dim)
        _, local = _in_block(index, self.lo, self.n, self.n)  # 1. (self.n: the spare row)
        grown = _with_spare_row(x, self.dim)
        if self.inplace:
            self.func(grown, self.dim, local, *args[3:], **kwargs)  # 2.
            return x.copy_(grown.narrow(self.dim, 0, self.n))  # 3.
        out = self.func(grown, self.dim, local, *args[3:], **kwargs)  # 2.
        return out.narrow(self.dim, 0, self.n).contiguous()  # 3.


_SCATTERS = {aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_,
             aten.scatter_reduce, aten.scatter_reduce_}  # fmt: skip


def _lines(func, args, kwargs):
    """A write on a target cut along another dim ``k`` than ``dim``: the index and the
    source whole (each rank reads its lines) or cut alike (their blocks are its lines)."""
    x, dim = args[0], args[1]
    if not isinstance(x, c.ShardTensor) or not isinstance(dim, int) or "out" in kwargs:
        return NotImplemented
    cut = _the_cut(x)
    if cut is None or cut[1] == dim % max(x.ndim, 1) or len(args) < 3:
        return NotImplemented
    (m, k), alike = cut, []
    for a in args[2:4]:
        if _whole(a):
            alike.append(False)
        elif (a._layout.placements[m] == Shard(k) and _the_cut(a) == (m, k)
              and a._layout.sizes_along(k) == x._layout.sizes_along(k)):  # fmt: skip
            alike.append(True)
        else:
            return NotImplemented
    if not all(_whole(a) for a in (*args[4:], *kwargs.values())):
        return NotImplemented
    index = args[2]
    extent = index.shape[k] if isinstance(index, torch.Tensor) and index.ndim > k else 0
    lo, n = _my_rows(x, k)
    local = _OwnLines(func, dim % x.ndim, k, lo, n, extent, tuple(alike))
    return Plan(x.device_mesh, x._layout, None, c.op_name(func), local, inplace=c.is_inplace(func))


class _OwnLines:
    """A scatter / index write on a target cut along another dim ``k``: this rank's
    lines along ``k`` of the index and the source, where they are whole (a scatter's
    index and source are read up to the index's ``extent``; an index op's source is as
    long as the target); a cut one's block already is."""

    __slots__ = ("func", "dim", "k", "lo", "n", "extent", "alike")

    def __init__(self, func, dim, k, lo, n, extent, alike):
        self.func, self.dim, self.k, self.lo, self.n = func, dim, k, lo, n
        self.extent, self.alike = extent, alike

    def __call__(self, args, kwargs):
        x, rest = args[0], list(args[2:])
        k, lo = self.k, self.lo
        if self.func.overloadpacket in _SCATTERS:  # index and src: the index's extent
            start = min(lo, self.extent)
            length = max(0, min(lo + self.n, self.extent) - start)
            for i in (0, 1):
                t = rest[i] if i < len(rest) else None
                if isinstance(t, torch.Tensor) and t.ndim and not self.alike[i]:
                    rest[i] = t.narrow(k, start, length)
                elif isinstance(t, torch.Tensor) and t.ndim:  # (a block: the index's part)
                    rest[i] = t.narrow(k, 0, min(t.shape[k], length))
        elif len(rest) > 1 and isinstance(rest[1], torch.Tensor) and rest[1].ndim:
            if not self.alike[1]:  # index_add / copy / reduce's source
                rest[1] = rest[1].narrow(k, lo, self.n)
        return self.func(x, self.dim, *rest, **kwargs)


class _OwnPicks:
    """Steps 1-3 of ``gather`` / ``index_select`` of this rank's rows: picks it does not
    own are zeros (a Partial(sum) block)."""

    __slots__ = ("func", "dim", "lo", "n", "size", "shape")

    def __init__(self, func, dim, lo, n, size, shape):
        self.func, self.dim, self.lo, self.n, self.size, self.shape = func, dim, lo, n, size, shape

    def __call__(self, args, kwargs):
        x, index = args[0], args[2]
        index = _checked(self.func, index, self.size, self.dim)
        if self.n == 0:  # nothing owned: all zeros
            return x.new_zeros(self.shape)
        inside, local = _in_block(index, self.lo, self.n, 0)  # 1.
        out = self.func(x, self.dim, local, *args[3:], **kwargs)  # 2.
        if self.func.overloadpacket is aten.index_select:
            view = [1] * out.ndim
            view[self.dim] = -1
            inside = inside.reshape(view)
        return torch.where(inside, out, torch.zeros((), dtype=out.dtype))  # 3.


def _one_index(x, indices):
    """(dim, index) of ``x[..., index, ...]``: one whole integer index tensor on the one
    dim of ``x`` that is cut (by one mesh dim, in blocks, nothing else cut); else None."""
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(given) != 1 or not isinstance(x, c.ShardTensor):
        return None
    d, index = given[0]
    if index.dtype in (torch.bool, torch.uint8) or not _whole(index):
        return None
    if _cut_along(x, d) is None:
        return None
    return d, index


def index_picks(func, args, kwargs):
    """``x[index]`` (aten ``index.Tensor``) along the cut dim: each rank its own picks,
    a Partial(sum) result (as :func:`picks`); NotImplemented otherwise."""
    by_index = by_cut_index(func, args, kwargs)  # a whole input, a cut index
    if by_index is not NotImplemented:
        return by_index
    x, indices = args[0], list(args[1])
    one = _one_index(x, indices)
    if one is None:
        return NotImplemented
    d, index = one
    m = _cut_along(x, d)
    shape = (*x.shape[:d], *index.shape, *x.shape[d + 1 :])
    places = [Partial() if k == m else Replicate() for k in range(x.device_mesh.ndim)]
    out = ShardLayout.build(shape, x._layout.mesh_shape, places)
    lo, n = _my_rows(x, d)
    return Plan(x.device_mesh, out, None, "index", _OwnIndex(d, lo, n, x.shape[d], shape))


def index_writes(func, args, kwargs):
    """``x[index] = values`` / ``index_put(..., accumulate)`` along the cut dim, values
    whole: each rank writes its own rows (+ the spare row, as :class:`_OwnRows`)."""
    x, indices, values = args[0], list(args[1]), args[2]
    one = _one_index(x, indices)
    if one is None:
        return _lines_written(func, args, kwargs)
    moves = None
    if isinstance(values, c.ShardTensor):  # values summed first where Partial (x[i] += v)
        whole = c.without_partial(values._layout)
        if not all(isinstance(p, Replicate) for p in whole.placements):
            return NotImplemented
        if whole != values._layout:
            moves = [None] * (len(args) + len(kwargs))
            moves[2] = whole
    d, _ = one
    lo, n = _my_rows(x, d)
    local = _OwnPuts(func, d, lo, n, x.shape[d], c.is_inplace(func))
    name = c.op_name(func)
    return Plan(x.device_mesh, x._layout, moves, f"{name}.partial", local, inplace=local.inplace)


def _lines_written(func, args, kwargs):
    """``x[index] = values`` on x cut along another dim k than the indexed one, values
    whole: each rank writes its own lines along k (the values' matching lines, where
    they are not broadcast)."""
    x, indices, values = args[0], list(args[1]), args[2]
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    cut = _the_cut(x) if isinstance(x, c.ShardTensor) else None
    if cut is None or len(given) != 1 or not _whole(values) or not _whole(given[0][1]):
        return NotImplemented
    (d, index), (_, k) = given[0], cut
    if index.dtype in (torch.bool, torch.uint8) or k == d:
        return NotImplemented
    result_ndim = x.ndim - 1 + index.ndim  # x[index]: the index's dims replace dim d
    r = k if k < d else k - 1 + index.ndim
    v = r - (result_ndim - values.ndim)  # (values broadcast from the right)
    v = v if v >= 0 and values.shape[v] != 1 else None
    lo, n = _my_rows(x, k)
    local = _ValuesLines(func, v, lo, n)
    return Plan(x.device_mesh, x._layout, None, c.op_name(func), local, inplace=c.is_inplace(func))


class _ValuesLines:
    """``index_put`` on this rank's lines: the values narrowed to them along ``v``."""

    __slots__ = ("func", "v", "lo", "n")

    def __init__(self, func, v, lo, n):
        self.func, self.v, self.lo, self.n = func, v, lo, n

    def __call__(self, args, kwargs):
        values = args[2] if self.v is None else args[2].narrow(self.v, self.lo, self.n)
        indices = [None if i is None else c.local(i) for i in args[1]]
        return self.func(args[0], indices, values, *args[3:], **kwargs)


class _OwnIndex:
    """``x[index]`` of this rank's rows: the picks it does not own are zeros."""

    __slots__ = ("dim", "lo", "n", "size", "shape")

    def __init__(self, dim, lo, n, size, shape):
        self.dim, self.lo, self.n, self.size, self.shape = dim, lo, n, size, shape

    def __call__(self, args, kwargs):
        x, index = args[0], c.local([i for i in args[1] if i is not None][0])  # (a list's
        # ShardTensors reach the local call as they are)
        index = _checked(aten.index.Tensor, index, self.size, self.dim)
        if self.n == 0:
            return x.new_zeros(self.shape)
        inside, local = _in_block(index, self.lo, self.n, 0)  # 1.
        out = x[(slice(None),) * self.dim + (local,)]  # 2.
        view = [1] * self.dim + list(index.shape) + [1] * (out.ndim - self.dim - index.ndim)
        return torch.where(inside.reshape(view), out, torch.zeros((), dtype=out.dtype))  # 3.


class _OwnPuts(_OwnRows):
    """``index_put`` of this rank's rows (+ the spare row)."""

    __slots__ = ()

    def __call__(self, args, kwargs):
        x, indices = args[0], [None if i is None else c.local(i) for i in args[1]]
        index = _checked(self.func, indices[self.dim], self.size, self.dim)
        _, indices[self.dim] = _in_block(index, self.lo, self.n, self.n)  # 1.
        grown = _with_spare_row(x, self.dim)
        out = aten.index_put(grown, indices, *args[2:], **kwargs)  # 2.
        if self.inplace:
            return x.copy_(out.narrow(self.dim, 0, self.n))  # 3.
        return out.narrow(self.dim, 0, self.n).contiguous()  # 3.
