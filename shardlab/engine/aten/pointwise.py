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
from shardlab.engine.rule import Plan
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
    aten._conj, aten.conj, aten.resolve_conj, aten.resolve_neg, aten._neg_view,
}  # fmt: skip
_IDENTITY = {aten.clone, aten.detach, aten.alias, aten.positive, aten.lift_fresh,
             aten._to_copy, aten.to, aten.conj, aten._conj, aten.resolve_conj}  # fmt: skip
_NEGATION = {aten.neg, aten.neg_, aten.resolve_neg, aten._neg_view}
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


def pointwise(func, args, kwargs):
    """The plan: every input moved to the output's layout (restricted to its shape), then
    the op on the blocks."""
    st = c.ShardTensor
    if func.overloadpacket in _LIKE:  # only the layout of x matters, not its values
        x = args[0]
        local = _Zeroed() if func.overloadpacket is aten.empty_like else None
        return Plan(x.device_mesh, c.without_partial(x._layout), local=local)
    shards = c.shards_in((args, kwargs))
    mesh = c.the_mesh(shards)
    nm = mesh.ndim
    ts = _tensors(args, kwargs)
    out_shape = c.broadcast_shapes([tuple(t.shape) for t in ts])
    keep = [keeps_partial(func, args, kwargs, m) for m in range(nm)]
    inplace = c.is_inplace(func)
    cause = f"{c.op_name(func)}.align"
    if not inplace and c.written_args(func):  # ``out=``: written where it is, as self is
        out_arg = kwargs.get("out")
        if (
            type(out_arg) is not st
            or tuple(out_arg.shape) != out_shape
            or any(isinstance(p, Partial) for p in out_arg._layout.placements)
        ):
            return NotImplemented  # (the fallback writes it back)
        local_args, local_kwargs = _moved_locals(args, kwargs, out_arg._layout, mesh, cause)
        func(*local_args, **local_kwargs)  # the inputs moved to out's layout; out stays
        return out_arg
    if inplace:
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
            kw = {k: work if v is self else v for k, v in kwargs.items()}
            _run_on_blocks(func, (work, *rest), kw)
            c.write_partial(self, work._local_tensor)
            return self
        target = self._layout
    else:  # 1. the output's layout: the candidate that moves the fewest elements
        candidates = []
        for s in shards:
            t = target_from(s._layout, out_shape, keep)
            if t not in candidates:
                candidates.append(t)
        target = min(candidates, key=lambda t: _cost(t, shards, nm))
    values = (*args, *kwargs.values())
    if not _tensors_only(func) or any(
        isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a) for a in values
    ):  # (tensors inside a list, a result that is not a tensor: no plan for them)
        local_args, local_kwargs = _moved_locals(args, kwargs, target, mesh, cause)
        out = _wrap_all(func(*local_args, **local_kwargs), mesh, target)
        return args[0] if inplace else out
    moves = [_move(a, target, nm, mesh) for a in values]  # 2. each input to the target
    if inplace and moves[0] is not None:
        return NotImplemented  # (never: self keeps its layout)
    n = len(func._schema.returns)  # (frexp: two results, each laid out as the output)
    outs = (target,) * n if n > 1 and not inplace else target
    return Plan(mesh, outs, moves, cause, inplace=inplace)  # 3. the op on the blocks


def _tensors_only(func) -> bool:
    """Does ``func`` return tensors only (``equal`` returns a bool)?"""
    return all(isinstance(r.type, torch.TensorType) for r in func._schema.returns)


class _Zeroed:
    """``empty_like`` on a block: zeros (replicas must agree)."""

    __slots__ = ()

    def __call__(self, args, kwargs):
        return aten.zeros_like.default(*args, **kwargs)


def _move(a, target, nm, mesh):
    """What argument ``a`` becomes before the op: None (as it is), or its layout."""
    if isinstance(a, c.ShardTensor):
        part = [isinstance(p, Partial) for p in a._layout.placements]
        need = restrict(target, a.shape, part)
        return None if need == a._layout else need
    if isinstance(a, torch.Tensor) and a.ndim > 0:
        need = restrict(target, a.shape, [False] * nm)
        return None if need == c.replicate_layout(a.shape, mesh) else need
    return None


def _run_on_blocks(func, args, kwargs) -> None:
    """The (in-place) op on the blocks once every input is moved to ``args[0]``'s layout."""
    target = args[0]._layout
    local_args, local_kwargs = _moved_locals(
        args, kwargs, target, args[0].device_mesh, f"{c.op_name(func)}.align"
    )
    func(*local_args, **local_kwargs)


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
