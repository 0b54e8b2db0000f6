"""Element-wise ops on ShardTensors (torch's ``pointwise`` tag, and a few untagged ones).

1. The output layout is one input's layout carried to the output shape
   (:func:`~shardlab.layout.elementwise.target_from`); the input whose layout costs the
   fewest moved elements wins (ties: the first). In-place ops keep ``self``'s layout.
2. Every input moves to that layout restricted to its own shape (broadcast dims:
   Replicate; a plain tensor is sliced, which moves nothing).
3. The op runs on the local blocks. No other communication.

``Partial(sum)`` passes through the ops that are linear in it (``-x``, ``a + b`` of two
Partials, ``x * r`` / ``x / r`` with ``r`` not Partial, casts between float types);
anything else reduces it first (one all-reduce), as DTensor does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial

from shardlab.engine import _common as c
from shardlab.engine import decisions
from shardlab.layout.elementwise import restrict, target_from
from shardlab.layout.moves import move_cost

aten = torch.ops.aten

_UNTAGGED = {
    aten._to_copy, aten.clone, aten.copy_, aten.fill_, aten.fill, aten.zero_, aten.detach,
    aten.alias, aten.lift_fresh, aten.zeros_like, aten.ones_like, aten.empty_like,
    aten.full_like, aten.masked_fill, aten.masked_fill_, aten.where, aten.threshold_backward,
    aten.gelu_backward, aten.silu_backward, aten.sigmoid_backward, aten.tanh_backward,
    aten.hardtanh_backward, aten.leaky_relu_backward, aten.elu_backward,
    aten.softplus_backward, aten.hardswish_backward, aten.hardsigmoid_backward,
    aten.mish_backward, aten.native_dropout_backward, aten.isnan, aten.isinf,
    aten.nan_to_num, aten.positive, aten.logical_not, aten.logical_and, aten.logical_or,
    aten.logical_xor, aten.clamp, aten.clamp_min, aten.clamp_max, aten.lerp, aten.addcmul,
    aten.addcdiv, aten.bitwise_not, aten.relu, aten.relu_, aten.sign, aten.isfinite,
    aten.lift_fresh_copy, aten.log_sigmoid_backward, aten.to,
    aten._conj, aten.conj, aten.resolve_conj, aten.resolve_neg,
}  # fmt: skip
_IDENTITY = {aten.clone, aten.detach, aten.alias, aten.positive, aten.lift_fresh,
             aten._to_copy, aten.to, aten.conj, aten._conj, aten.resolve_conj}  # fmt: skip
_NEGATION = {aten.neg, aten.neg_, aten.resolve_neg}
_ADDITIVE = {aten.add, aten.add_, aten.sub, aten.sub_}
_SCALING = {aten.mul, aten.mul_, aten.div, aten.div_}
_RANDOM = torch.Tag.nondeterministic_seeded


def is_pointwise(func) -> bool:
    if _RANDOM in func.tags:
        return False  # random ops: the fallback draws the global tensor (see fallback.py)
    return torch.Tag.pointwise in func.tags or func.overloadpacket in _UNTAGGED


def _tensors(args, kwargs) -> list:
    return [a for a in c.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]


def keeps_partial(func, args, kwargs, m: int) -> bool:
    """May the result stay Partial on mesh dim ``m``? Identity-like ops keep any Partial
    (sum, max, min); sums pass through the ops that are linear in them."""
    st = c.ShardTensor
    ts = _tensors(args, kwargs)
    kinds = [t._layout.placements[m] if isinstance(t, st) else None for t in ts]
    partial = [isinstance(k, Partial) for k in kinds]
    if not any(partial):
        return False
    pk = func.overloadpacket
    if pk in _IDENTITY and len(ts) == 1:
        if pk in (aten._to_copy, aten.to):
            dtype = kwargs.get("dtype") or next(
                (a for a in args[1:] if isinstance(a, torch.dtype)), None
            )
            return dtype is None or dtype.is_floating_point or dtype.is_complex
        return True
    is_sum = [k == Partial() for k in kinds]
    if pk in _NEGATION and len(ts) == 1:
        return is_sum[0]
    if pk in _ADDITIVE:
        return all(is_sum) and len(ts) == 2
    if pk in _SCALING:
        if sum(partial) != 1 or sum(is_sum) != 1:
            return False
        return not (pk in (aten.div, aten.div_) and not is_sum[0])
    return False


_LIKE = {aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like}


def pointwise(func, args, kwargs, meta_out=None):
    st = c.ShardTensor
    if func.overloadpacket in _LIKE:  # only the layout of x matters, not its values
        x = args[0]
        out = func(x._local_tensor, *args[1:], **kwargs)
        layout = c.without_partial(x._layout)
        wrapped = c.wrap(out, x.device_mesh, layout)
        if func.overloadpacket is aten.empty_like:
            out.zero_()  # replicas must agree
        else:  # the op on the block as it is: kept per signature (backward's seed)
            keep = [None] * (len(args) + len(kwargs))
            decisions.decided(wrapped, func, keep, x.device_mesh, layout)
        return wrapped
    shards = c.shards_in((args, kwargs))
    mesh = c.the_mesh(shards)
    nm = mesh.ndim
    ts = _tensors(args, kwargs)
    out_shape = c.broadcast_shapes([tuple(t.shape) for t in ts])
    keep = [keeps_partial(func, args, kwargs, m) for m in range(nm)]
    inplace = c.is_inplace(func)
    cause = f"{c.op_name(func)}.align"
    out_arg = None
    if not inplace and c.written_args(func):  # ``out=``: written where it is, as self is
        out_arg = kwargs.get("out")
        if (
            type(out_arg) is not st
            or tuple(out_arg.shape) != out_shape
            or any(isinstance(p, Partial) for p in out_arg._layout.placements)
        ):
            return NotImplemented  # (the fallback writes it back)
    if out_arg is not None:
        target = out_arg._layout  # the inputs move to it; out does not move
    elif inplace:
        self = args[0]
        if not isinstance(self, st):
            return NotImplemented  # a plain tensor written: the whole-tensor fallback
        reduce = [
            m
            for m, p in enumerate(self._layout.placements)
            if isinstance(p, Partial) and not keep[m]
        ]
        if reduce:  # not linear in a Partial self: on its reduced value, then written back
            work = c.move(self, c.without_partial(self._layout, reduce), cause)
            rest = [work if a is self else a for a in args[1:]]
            pointwise(func, (work, *rest), {k: work if v is self else v for k, v in kwargs.items()})
            c.write_partial(self, work._local_tensor)
            return self
        target = self._layout
    else:
        candidates = []
        for s in shards:
            t = target_from(s._layout, out_shape, keep)
            if t not in candidates:
                candidates.append(t)
        target = min(candidates, key=lambda t: _cost(t, shards, nm))
    local_args, local_kwargs = _moved_locals(args, kwargs, target, mesh, cause)
    result = func(*local_args, **local_kwargs)
    if inplace:
        return args[0]
    if out_arg is not None:
        return out_arg
    return _wrap_all(result, mesh, target)


def replay(func, args, kwargs, out):
    """For :mod:`shardlab.engine.decisions`: ``(moves, mesh, target, cause)`` that replay
    this call (``out`` its result; in place: the first argument, written): what each
    argument became before the local call, or None when the call cannot be replayed that
    way (``*_like``, several results, tensors inside lists)."""
    st = c.ShardTensor
    if func.overloadpacket in _LIKE or type(out) is not st:
        return None
    if c.is_inplace(func) and out is not args[0]:
        return None
    mesh, target = out.device_mesh, out._layout
    nm = mesh.ndim
    moves = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
            return None
        if isinstance(a, st):
            part = [isinstance(p, Partial) for p in a._layout.placements]
            need = restrict(target, a.shape, part)
            moves.append(None if need == a._layout else need)
        elif isinstance(a, torch.Tensor) and a.ndim > 0:
            need = restrict(target, a.shape, [False] * nm)
            moves.append(None if need == c.replicate_layout(a.shape, mesh) else need)
        else:
            moves.append(None)
    return moves, mesh, target, f"{c.op_name(func)}.align"


def _cost(target, shards, nm) -> int:
    total = 0
    for s in shards:
        part = [isinstance(p, Partial) for p in s._layout.placements]
        total += move_cost(s._layout, restrict(target, s.shape, part))
    return total


def _moved_locals(args, kwargs, target, mesh, cause):
    st = c.ShardTensor

    def conv(a):
        if isinstance(a, st):
            part = [isinstance(p, Partial) for p in a._layout.placements]
            return c.move(a, restrict(target, a.shape, part), cause)._local_tensor
        if isinstance(a, torch.Tensor) and a.ndim > 0:
            return c.move(
                c.as_shard(a, mesh), restrict(target, a.shape, [False] * mesh.ndim), cause
            )._local_tensor
        return a

    return c.tree_map(conv, args), c.tree_map(conv, kwargs)


def _wrap_all(result, mesh, target):
    if isinstance(result, torch.Tensor):
        return c.wrap(result, mesh, target)
    if isinstance(result, (list, tuple)):
        return c.rebuild(result, [_wrap_all(r, mesh, target) for r in result])
    return result
