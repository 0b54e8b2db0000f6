"""Ops that record no autograd: decided at the Python entry, replayed on the blocks.

Every op on a ShardTensor passes two Python entry points: ``__torch_function__`` (the
call as the user wrote it: ``torch.Tensor.__add__``, ``F.gelu`` …) and, through aten's
dispatcher, ``__torch_dispatch__`` (the aten op, where :mod:`.decisions` keeps what it
does). Passing both costs ~5 µs with empty bodies, about what DTensor's C++ dispatch
costs in all. When nothing is to be recorded for autograd (no argument requires grad,
or grad mode is off) the second one can be skipped::

    a + b  ->  __torch_function__(Tensor.__add__, (a, b))
                 key (op, layouts, strides, dtypes, scalars) kept here?
                   yes: Tensor.__add__(a_block, b_block), wrapped  (no dispatcher, no aten)
                   no:  the usual path; learnt when it was exactly one aten op replaying a
                        kept decision that runs the op on the blocks as they are

Learnt only when the call (``Tensor.__add__`` on the global tensors) reached
``__torch_dispatch__`` once, as a kept :class:`~.plans.LocalCall` with nothing
moved and nothing run instead of the op (so the aten op on the blocks is the answer),
and returned that op's result: then the same call on the blocks is the same aten op on
the blocks. Only torch's C functions and methods (and a few ``torch.nn.functional``
functions that pass their arguments straight to one, listed in :data:`PASS_THROUGH`)
are learnt: Python code could read a size and take another branch on a block.

Never used (the usual path) under an autocast region, a dispatch or function mode, or
while something compiles; nor for an argument that is not a ShardTensor of one mesh, a
scalar, or a list of those (``ShardTensor.__torch_function__`` checks that first).
"""

from __future__ import annotations

from threading import get_ident as _thread

import torch
import torch.nn.functional as F

from shardlab import _compat
from shardlab.engine import decisions, plans
from shardlab.tensor import entry
from shardlab.tensor.api import ShardTensor

__all__ = ["PASS_THROUGH", "TABLE", "call", "seen"]

TABLE: dict = {}  # key -> _Replay, or _NOT (learnt: this call takes the usual path)
decisions.TABLES.append(TABLE)  # bounded and cleared with the others
_DEPTH = decisions._DEPTH
_NOT = object()
_WATCH: list = [None]  # while a call is learnt: what __torch_dispatch__ replayed under it

# torch.nn.functional's Python functions that only hand their arguments to one C function
PASS_THROUGH = frozenset([F.layer_norm, F.softmax, F.log_softmax])
_C_FUNCTIONS = (type(torch.add), type(torch.Tensor.add))  # builtin, method_descriptor

_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_autocast = torch._C._is_any_autocast_enabled
_grad = torch.is_grad_enabled


def call(func, types, args, kwargs):
    """``func(*args, **kwargs)`` replayed on the blocks, else NotImplemented (the usual
    path). ``args``/``kwargs``: ShardTensors of one mesh, scalars, lists of those."""
    grad = _grad()  # (a first argument requiring grad in grad mode never comes here: entry.py)
    if func in _NEVER or _autocast() or _modes() or _function_modes():
        return NotImplemented
    key = _key(func, args, kwargs, grad)
    if key is None:  # an argument requires grad (autograd records the op), or no key
        return NotImplemented
    kept = TABLE.get(key)
    if type(kept) is _Replay:
        try:
            return kept(func, args, kwargs)
        except plans.Stale:
            return NotImplemented
    if kept is _NOT or _DEPTH[0]:  # (decisions.depth(), inline: inside a rule's op)
        return NotImplemented
    if not (type(func) in _C_FUNCTIONS or func in PASS_THROUGH):
        _never(func)  # Python code (it could read a size and branch on it)
        return NotImplemented
    before, _WATCH[0] = _WATCH[0], [_thread()]  # (this thread's ops only)
    try:
        out = torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        if type(out) is not ShardTensor:  # sizes, dtypes, tuples of results ...
            _never(func)
        else:
            learnt = _learnt(out, _WATCH[0][1:], kept or 0)
            if learnt is _VIEW:
                _never(func)
            else:
                if type(learnt) is _Replay:  # (the ids in a kept key name live objects)
                    learnt.anchors += (func, *decisions.named(args, kwargs))
                decisions.remember(key, learnt, TABLE)
    finally:
        _WATCH[0] = before
    return out


def _key(func, args, kwargs, grad):
    """The call's key, flat: the function's id; per ShardTensor its spec's and layout's
    ids (the spec: mesh, global shape, strides, dtype; the layout: every shard size);
    per scalar its type and value; lists of those between their type and :data:`_END`.
    None when ``grad`` (grad mode) and an argument requires grad, or a scalar cannot
    be a key. A kept replay holds the function, specs and layouts of its key, so no id
    in its key can be another object's (an id reused in a key kept as "not learnt" only
    sends a call the usual way); whether the arguments require grad is not in it
    (nothing is recorded either way)."""
    st = ShardTensor
    key = [id(func)]
    with _NO_TORCH_FUNCTION():
        for a in args:
            t = type(a)
            if t is st:
                if grad and a.requires_grad:
                    return None
                key += (st, id(a._spec), id(a._layout))
            elif t is list or t is tuple:
                key.append(t)
                for v in a:
                    if type(v) is st:
                        if grad and v.requires_grad:
                            return None
                        key += (st, id(v._spec), id(v._layout))
                    elif not _scalar(key, v):
                        return None
                key.append(_END)
            elif not _scalar(key, a):
                return None
        for k, v in kwargs.items():
            key.append(k)
            if not _scalar(key, v):
                return None
    return tuple(key)


def _scalar(key: list, v) -> bool:
    t = type(v)
    if t not in decisions.SCALARS:
        return False
    if (t is float or t is complex) and v != v:
        key += (t, str(v))  # nan != nan: it would never hit
    else:
        key += (t, v)  # the type too: True, 1 and 1.0 are equal values
    return True


_END = object()  # in a key: the end of a list
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_NEVER = entry.NEVER_REPLAYED  # functions never learnt (asked first: no key built for them)


def _never(func) -> None:
    if len(_NEVER) >= decisions.SIZE:
        _NEVER.clear()
    _NEVER.add(func)


def seen(decision, func, out) -> None:
    """Called by ``__torch_dispatch__`` for each aten op ``func`` (``decision``: the kept
    one it replayed, giving ``out``; None: decided in full) while a call is learnt."""
    watch = _WATCH[0]
    if watch is not None and watch[0] == _thread():
        watch.append((decision, func, out))


def _learnt(out, ops, tries):
    """What to keep for a call that returned ``out`` and dispatched ``ops``: a
    :class:`_Replay`, :data:`_NOT`, how many times it was tried (an aten op decided in
    full this time: kept now, it may replay next time), or :data:`_VIEW`."""
    if ops and any(r.alias_info is not None for r in ops[0][1]._schema.returns):
        # a view (or a write): autograd's view tracking (``_base``, the version counter
        # shared with the input) is set by aten's dispatcher, which this path skips
        return _VIEW
    if any(kept is None for kept, _, _ in ops):
        return tries + 1 if tries < _TRIES else _NOT
    if len(ops) != 1:
        return _NOT
    kept, _, result = ops[0]
    if type(kept) is not plans.LocalCall or kept.local is not None:
        return _NOT
    if not (kept.still or kept.lists):  # something moves (a message, or a cut)
        return _NOT
    results = result if kept.many else (result,)
    for how, r in zip(kept.outs, results):
        if r is out:
            return _Replay(how, kept.anchors)
    return _NOT


_TRIES = 2  # calls decided in full before a call is not learnt any more
_VIEW = object()


class _Replay:
    """The call on the blocks (ShardTensors replaced by their blocks, in lists too),
    wrapped in the layout and global strides the usual path gave."""

    __slots__ = ("layout", "local_shape", "spec", "dtype", "anchors")

    def __init__(self, how, anchors):
        self.layout, self.local_shape, self.spec, self.dtype = how
        self.anchors = anchors  # keeps the ids in the key alive

    def __call__(self, func, args, kwargs):
        st = ShardTensor
        blocks = [
            a._local_tensor if type(a) is st else (_blocks(a, st) if type(a) in _LISTS else a)
            for a in args
        ]
        if kwargs:
            out = func(*blocks, **{k: _block(v, st) for k, v in kwargs.items()})
        else:
            out = func(*blocks)
        if type(out) is not torch.Tensor or out.shape != self.local_shape:
            raise plans.Stale
        if out.dtype != self.dtype:  # torch's default dtype changed since
            raise plans.Stale
        for b in blocks:
            if out is b:  # a block returned as it is: the result would alias an input
                raise plans.Stale
        new = (_NEW or _compat.dtensor_constructor())[0]
        wrapped = new(ShardTensor, out, self.spec, requires_grad=False)
        wrapped._layout = self.layout
        return wrapped


_LISTS = (list, tuple)
_NEW = _compat._NEW  # [DTensor's C constructor], filled on first use


def _block(a, st):
    t = type(a)
    if t is st:
        return a._local_tensor
    return _blocks(a, st) if t is list or t is tuple else a


def _blocks(a, st):
    return type(a)([v._local_tensor if type(v) is st else v for v in a])
