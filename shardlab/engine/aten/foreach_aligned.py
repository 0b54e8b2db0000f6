"""The foreach ops' one-pass path, tried before any meta run or key: every
``torch.optim`` step with ``foreach=True`` / ``fused=True`` on parameters whose gradient
and states are laid out like them. The full rule (:mod:`.foreach`) decided each call
afresh, ~20 µs per tensor: an AdamW step over 48 tensors cost 3x its arithmetic::

    params  [ w0 Shard(0) [1, 3, 5],  b Replicate ]     element i: its tensors all of one
    grads   [ g0 Shard(0) [1, 3, 5],  gb Replicate ]    layout (equal, nothing Partial), on
    states  [ m0 Shard(0) [1, 3, 5],  mb Replicate ]    one mesh; plain tensors 0-d (steps)
                       |
    rank r: torch's foreach call on its blocks, as they are (no move, no message)

Anything else (an element laid out two ways, a Partial one, a plain tensor beside cut
ones, a non-contiguous ``self`` of an out-of-place op, the per-tensor reductions) is left
to the full rule.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from shardlab.engine import _common as c
from shardlab.engine.meta import scalars_index

from .foreach import _ALONE, _PER_TENSOR, PLAIN

__all__ = ["aligned"]


class _Off(Exception):
    """Not the aligned case: the full path decides."""


_NOT_ALIGNED = _ALONE | set(_PER_TENSOR)
_RESULTS: dict = {}  # op -> "none" (in place), "list" (one list of results) or "other"


def aligned(func, args, kwargs):
    """The common case in one pass, before any meta run (what every optimizer step
    calls; the full rule, :func:`.foreach.foreach`, took ~20 µs per tensor): element i's
    ShardTensors all of one layout, nothing Partial, one mesh; its plain tensors 0-d (a
    step count), or all of them plain. Nothing moves then: torch's foreach call on the
    blocks is the op, and its checks (list lengths, dtypes, devices) see the same on every
    rank (blocks of one layout are alike but for their sizes). Out of place, each result
    takes its element's layout (contiguous ``self`` only: torch's result is laid out like
    it). Else NotImplemented."""
    st = c.ShardTensor
    kind = _RESULTS.get(func)
    if kind is None:
        rets = func._schema.returns
        kind = _RESULTS[func] = (
            "none" if not rets else "list" if len(rets) == 1 and str(rets[0].type) == "List[Tensor]"
            else "other"
        )  # fmt: skip
        if c.op_name(func) in _NOT_ALIGNED or scalars_index(func) is not None:
            kind = _RESULTS[func] = "other"
    if kind == "other" or (kwargs and kwargs.get("memory_format") is not None):
        return NotImplemented  # (a memory format: the full path's strides)
    lays: list = []  # per element: its layout, PLAIN, or None (0-d plain tensors only)
    mesh: list = []
    selfs: list = []  # out of place: the first list (torch lays results out like it)

    def blocks(v):
        tv = type(v)
        if tv is st:  # one scalar tensor for every element: 0-d, whole
            lay = v._layout
            if lay is None or lay.global_shape != () or not lay.is_whole():
                raise _Off
            _same_mesh(mesh, v)
            return v._local_tensor
        if tv is not list and tv is not tuple:
            if isinstance(v, torch.Tensor) and (v.ndim != 0 or isinstance(v, DTensor)):
                raise _Off  # (a DTensor of torch's: the full path adopts it)
            return v
        if not v or not isinstance(v[0], torch.Tensor):
            return v  # numbers, or an empty optional list
        if not lays:
            lays.extend([None] * len(v))
            if kind == "list":
                selfs.extend(v)
        elif len(v) != len(lays):
            raise _Off
        out = []
        m = mesh[0] if mesh else None
        for i, x in enumerate(v):
            if type(x) is st:
                lay = x._layout
                if lay is None:  # a traced stand-in: the full path breaks the graph
                    raise _Off
                if lay is not lays[i]:
                    _fits(lays, i, lay)
                if x._spec.mesh is not m:
                    if m is not None:
                        raise _Off
                    m = x._spec.mesh
                    mesh.append(m)
                out.append(x._local_tensor)
            elif isinstance(x, torch.Tensor):
                if isinstance(x, DTensor):  # torch's own: the full path adopts it
                    raise _Off
                if x.ndim != 0:
                    if lays[i] is not None and lays[i] is not PLAIN:
                        raise _Off
                    lays[i] = PLAIN
                out.append(x)
            else:
                raise _Off
        return out

    try:
        bargs = [blocks(a) for a in args]
        bkwargs = {k: blocks(v) for k, v in kwargs.items()} if kwargs else kwargs
        if not mesh:
            raise _Off
        if kind == "list":
            with torch._C.DisableTorchFunctionSubclass():
                for x, lay in zip(selfs, lays):
                    if lay is PLAIN or lay is None:
                        continue
                    if type(x) is not st or not x.is_contiguous():
                        raise _Off
    except _Off:
        return NotImplemented
    out = func(*bargs, **bkwargs)  # (dispatch writes a copied view's base back)
    if kind == "none":
        return out
    m = mesh[0]
    return [t if lay is None or lay is PLAIN else st._wrap(t, m, lay) for t, lay in zip(out, lays)]


_PARTIAL: dict = {}  # id -> (layout, has it a Partial placement) (held: its id stays its)
_EQUAL: dict = {}  # (id, id) -> the two equal layouts (held: their ids stay theirs)


def _partial(lay) -> bool:
    hit = _PARTIAL.get(id(lay))
    if hit is None:
        if len(_PARTIAL) > 4096:
            _PARTIAL.clear()
        hit = _PARTIAL[id(lay)] = (lay, any(isinstance(p, Partial) for p in lay.placements))
    return hit[1]


def _equal(a, b) -> bool:
    """``a == b`` for layouts (a gradient's and its parameter's are equal objects, not one),
    remembered for equal pairs: a dataclass comparison costs ~1 µs."""
    if (id(a), id(b)) in _EQUAL:
        return True
    if a != b:
        return False
    if len(_EQUAL) > 4096:
        _EQUAL.clear()
    _EQUAL[id(a), id(b)] = (a, b)
    return True


def _fits(lays: list, i: int, lay) -> None:
    """Element i's layout so far is ``lays[i]`` (not ``lay`` itself): ``lay`` becomes it,
    or equals it, or :class:`_Off`."""
    known = lays[i]
    if known is PLAIN:
        raise _Off
    if known is None:
        if _partial(lay):
            raise _Off
        lays[i] = lay
    elif not _equal(lay, known):
        raise _Off


def _same_mesh(mesh: list, x) -> None:
    if not mesh:
        mesh.append(x._spec.mesh)
    elif x._spec.mesh is not mesh[0]:
        raise _Off
