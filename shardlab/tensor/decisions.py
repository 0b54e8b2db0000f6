"""What an op does on ShardTensors, decided once per signature and replayed.

Deciding an op (:mod:`shardlab.tensor.dispatch`) costs tens of microseconds of Python:
torch's meta kernel on the global shapes, the rule's layout arithmetic, specs, strides.
All of it is a pure function of the op's *signature*::

    (op,  for every argument:
            ShardTensor   -> its mesh, layout (placements and every shard size),
                             global strides, dtype, requires_grad
            plain tensor  -> shape, strides, dtype, device, requires_grad
            anything else -> its type and value (ints of a view, a dim, a dtype …))

so it is computed once per signature and kept (a bounded table, the oldest entry dropped
first). A hit costs one pass over the arguments to build the key, the local call and the
wrap: no meta run, no rule, no spec built. Anything the key cannot hold (a plain DTensor
to adopt first, an unhashable argument) takes the full path every time.

A decision replays exactly what the full path did: which inputs move to which layout
(moves are messages, and run again on every call, the same on every rank), then the op
on the local blocks, then the result wrapped in the layout and global strides the full
path gave it. Decisions are made only for the families whose result is the op on the
moved local blocks (element-wise ops today); every other op keeps deciding in full.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LocalCall", "clear", "lookup", "remember", "signature"]

_TABLE: dict = {}
SIZE = 8192  # signatures kept; a training step repeats a few hundred


def clear() -> None:
    _TABLE.clear()


def lookup(key):
    return _TABLE.get(key)


def remember(key, decision) -> None:
    if len(_TABLE) >= SIZE:
        del _TABLE[next(iter(_TABLE))]  # the oldest
    _TABLE[key] = decision


_CLS: list = []


def _shard_tensor():
    if not _CLS:
        from shardlab.tensor.api import ShardTensor

        _CLS.append(ShardTensor)
    return _CLS[0]


class _Uncacheable(Exception):
    pass


def signature(func, args, kwargs):
    """The key of the decision for ``func(*args, **kwargs)``, or None (not cacheable)."""
    st = _shard_tensor()
    try:
        key = [func]
        for a in args:
            key.append(_sig(a, st))
        for k, v in kwargs.items():
            key.append(k)
            key.append(_sig(v, st))
        key = tuple(key)
        hash(key)
    except (_Uncacheable, TypeError):
        return None
    return key


_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device,
            torch.memory_format, torch.layout)  # fmt: skip


def _sig(a, st):
    t = type(a)
    if t is st:
        return (st, a.device_mesh, a._layout, a.stride(), a.dtype, a.requires_grad)
    if isinstance(a, torch.Tensor):
        if isinstance(a, torch.distributed.tensor.DTensor) or t not in (
            torch.Tensor,
            torch.nn.Parameter,
        ):
            raise _Uncacheable  # a DTensor to adopt, another subclass: the full path
        return (torch.Tensor, a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
    if t is list or t is tuple:
        return (t, *(_sig(v, st) for v in a))
    if t is float and math.isnan(a):
        return (float, "nan")  # nan != nan: it would never hit
    if t in _SCALARS:
        return (t, a)  # the type too: True, 1 and 1.0 are equal keys otherwise
    raise _Uncacheable


class LocalCall:
    """Replay: move the inputs that must move, call the op on the local blocks, wrap.

    ``moves[i]``: what becomes of argument i (positional, then keyword values in order):
    None (as it is: a scalar, or a ShardTensor whose block is used as it is), a layout (a
    ShardTensor moved there first, or a plain tensor cut to it: a slice, no message).
    ``outs``: ``(layout, stride, dtype)`` of each result; ``many``: the op returns a
    tuple of them (``native_layer_norm``'s output, mean and rstd), else one tensor.
    """

    __slots__ = ("moves", "mesh", "outs", "many", "cause")

    def __init__(self, moves, mesh, outs, many, cause):
        from shardlab import _compat
        from shardlab.tensor.comm import my_coord

        self.moves, self.mesh, self.many, self.cause = tuple(moves), mesh, many, cause
        me = my_coord(mesh)
        self.outs = tuple(
            (layout, layout.local_shape(me),
             _compat.dtensor_spec(mesh, layout.placements, layout.global_shape, tuple(stride),
                                  dtype))
            for layout, stride, dtype in outs
        )  # fmt: skip

    def __call__(self, func, args, kwargs):
        n = len(args)
        local_args = [self._local(a, self.moves[i]) for i, a in enumerate(args)]
        local_kwargs = {
            k: self._local(v, self.moves[n + j]) for j, (k, v) in enumerate(kwargs.items())
        }
        out = func(*local_args, **local_kwargs)
        if not self.many:
            return self._wrap(func, out, *self.outs[0])
        return tuple(self._wrap(func, o, *how) for o, how in zip(out, self.outs))

    def _wrap(self, func, out, layout, local_shape, spec):
        if tuple(out.shape) != local_shape:
            raise RuntimeError(
                f"shardlab internal error: {func} gave a local block of shape "
                f"{tuple(out.shape)} where {layout} needs {local_shape}; please report it"
            )
        wrapped = _shard_tensor()(out.detach(), spec, requires_grad=False)
        wrapped._layout = layout
        return wrapped

    def _local(self, a, move):
        from shardlab.tensor.aten import _common as c

        if move is None:
            return a._local_tensor if type(a) is _shard_tensor() else a
        if type(a) is _shard_tensor():
            return c.move(a, move, self.cause)._local_tensor
        return c.move(c.as_shard(a, self.mesh), move, self.cause)._local_tensor
