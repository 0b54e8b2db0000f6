"""What a plan runs, on its first call and whenever its signature comes again
(:mod:`.decisions` keeps them).

Each is the full path's result replayed without deciding: the inputs moved where the
rule moved them (messages, the same on every rank), the op on each rank's block, the
result wrapped in the layout, strides and dtype the full path gave it.
"""

from __future__ import annotations

import torch

from shardlab import _compat
from shardlab.comm import p2p, traced
from shardlab.engine import _common
from shardlab.engine.rule import BLOCKS
from shardlab.layout.strides import contiguous_stride
from shardlab.tensor.api import ShardTensor

__all__ = ["Again", "Decomposed", "LocalCall", "LocalExpand", "LocalInplace", "LocalReshape"]
__all__ += ["LocalSlice", "LocalSliceBackward", "LocalView", "Stale"]


# -- what runs on a hit ---------------------------------------------------------------
class LocalCall:
    """Replay: move the inputs that must move, call the op on the local blocks, wrap.

    ``moves[i]``: what becomes of argument i (positional, then keyword values in order):
    None (as it is: a scalar, or a ShardTensor whose block is used as it is), a layout (a
    ShardTensor moved there first, or a plain tensor cut to it: a slice, no message),
    :data:`BLOCKS` (a list of ShardTensors: their blocks as they are).
    ``outs``: ``(layout, stride, dtype)`` of each result; ``many``: the op returns a
    tuple of them (``native_layer_norm``'s output, mean and rstd), else one tensor.
    """

    __slots__ = ("moves", "mesh", "outs", "many", "cause", "still", "lists", "anchors", "local",
                 "strides", "first")  # fmt: skip

    def __init__(self, moves, mesh, outs, many, cause, anchors=(), local=None):
        self.moves, self.mesh, self.many, self.cause = tuple(moves), mesh, many, cause
        self.still = all(m is None for m in self.moves)  # nothing moves: blocks as they are
        # only lists of blocks taken as they are (cat's), nothing else moves
        self.lists = not self.still and all(m is None or m is BLOCKS for m in self.moves)
        self.anchors = tuple(anchors)  # what the ids in the key name: kept alive
        self.local = local  # what runs on the blocks instead of the op itself (LocalView)
        me = p2p.my_coord(mesh)
        self.outs = tuple(
            (layout, layout.local_shape(me),
             None if dtype is None else _spec(mesh, layout, stride, dtype), dtype)
            for layout, stride, dtype in outs
        )  # fmt: skip
        self.strides = tuple(stride for _, stride, _ in outs)  # (read once, if no dtype)
        self.first = True  # the run the plan was made for (the dispatcher clears it)

    def __call__(self, func, args, kwargs):
        st = ShardTensor
        if self.still and not kwargs:  # the commonest case, inline
            local_args = [a._local_tensor if type(a) is st else a for a in args]
            local_kwargs = kwargs
        else:
            local_args, local_kwargs = self._blocks(args, kwargs, st)
        if self.local is None:  # (an aten op's C handle: without OpOverload.__call__'s frame)
            op = func._op if type(func) is _OP_OVERLOAD else func
            out = op(*local_args, **local_kwargs)
        else:
            out = self.local(local_args, local_kwargs)
        if not self.many:
            for a in local_args:  # an op that returns its input (lift_fresh): an alias
                if out is a:
                    out = out.detach()
                    break
            layout, local_shape, spec, dtype = self.outs[0]
            if out.dtype != dtype or out.shape != local_shape or out.requires_grad:
                return self._wrap(func, out, layout, local_shape, spec, dtype, st)  # (checks)
            wrapped = (_NEW or _compat.dtensor_constructor())[0](st, out, spec, requires_grad=False)
            wrapped._layout = layout  # (as _wrap, inline: the hit path)
            return wrapped
        return tuple(self._wrap(func, o, *how, st) for o, how in zip(out, self.outs))

    def _wrap(self, func, out, layout, local_shape, spec, dtype, st):
        if dtype is None or (self.first and out.dtype != dtype):
            # the first run of a plan no meta run typed (or typed otherwise than the kernel
            # computes: torch 2.11's meta of the CPU flash attention): its dtype now
            i = next(i for i, h in enumerate(self.outs) if h[0] is layout and h[3] is dtype)
            dtype, spec = out.dtype, _spec(self.mesh, layout, self.strides[i], out.dtype)
            outs = list(self.outs)
            outs[i] = (layout, local_shape, spec, dtype)
            self.outs = tuple(outs)
        if out.dtype != dtype:  # torch's default dtype changed since (int * 0.5)
            raise Stale
        if out.shape != local_shape:
            raise RuntimeError(
                f"shardlab internal error: {func} gave a local block of shape "
                f"{tuple(out.shape)} where {layout} needs {local_shape}; please report it"
            )
        if out.requires_grad:  # below autograd a local result has no history: never, so far
            out = out.detach()
        wrapped = (_NEW or _compat.dtensor_constructor())[0](st, out, spec, requires_grad=False)
        wrapped._layout = layout
        return wrapped

    def _blocks(self, args, kwargs, st):
        """What the op runs on: each argument's block after its move."""
        if self.still:  # the common case: every block as it is, one pass
            local_args = [a._local_tensor if type(a) is st else a for a in args]
            local_kwargs = (
                {k: v._local_tensor if type(v) is st else v for k, v in kwargs.items()}
                if kwargs
                else kwargs
            )
            return local_args, local_kwargs
        if self.lists and not kwargs:  # cat's: one pass, no moves
            local_args = [
                [t._local_tensor if type(t) is st else t for t in a]
                if m is BLOCKS
                else (a._local_tensor if type(a) is st else a)
                for a, m in zip(args, self.moves)
            ]
            return local_args, kwargs
        n = len(args)
        local_args = [self._local(a, self.moves[i], st) for i, a in enumerate(args)]
        local_kwargs = {
            k: self._local(v, self.moves[n + j], st) for j, (k, v) in enumerate(kwargs.items())
        }
        return local_args, local_kwargs

    def _local(self, a, move, st):
        if move is None:
            return a._local_tensor if type(a) is st else a
        if move is BLOCKS:  # a plain tensor in the list: only ever a skipped empty one
            return [t._local_tensor if type(t) is st else t for t in a]
        c = _common
        if type(a) is not st:
            a = c.as_shard(a, self.mesh)  # a plain tensor: cut to the layout (a slice)
        if type(move) is tuple:  # in steps, each with its label
            for layout, cause in move:
                a = c.move(a, layout, cause)
            return a._local_tensor
        return c.move(a, move, self.cause)._local_tensor


def _spec(mesh, layout, stride, dtype):
    if stride is None:
        stride = contiguous_stride(layout.global_shape)
    return _compat.dtensor_spec(
        mesh, traced.placements(layout), layout.global_shape, tuple(stride), dtype
    )


_OP_OVERLOAD = torch._ops.OpOverload
_NEW = _compat._NEW  # [DTensor's C constructor] (what _compat.new_dtensor calls), once used


class LocalInplace(LocalCall):
    """Replay of an element-wise op that writes its first argument (``add_``, ``mul_`` …):
    the moves, the op on the blocks (writing the first one), and the first argument
    itself returned, its layout unchanged (a view that had to be a copy written back)."""

    __slots__ = ()

    def __call__(self, func, args, kwargs):
        local_args, local_kwargs = self._blocks(args, kwargs, ShardTensor)
        if self.local is None:
            func(*local_args, **local_kwargs)
        else:  # (what the rule runs instead: it writes the first block too)
            self.local(local_args, local_kwargs)
        _common.written(args[0])
        return args[0]


class Again:
    """Replay of a rule that is an algorithm of several ops (it returned its result, not
    a plan: ``mean`` as ``sum / n``, an ``argmax``'s gather): the rule again, each op in
    it replaying its own kept plan; the results given the global strides the full path
    gave them. Skips the adoption and torch's meta check, which hold for every call of
    the signature."""

    __slots__ = ("rule", "strides", "anchors")

    def __init__(self, rule, strides, anchors):
        self.rule, self.strides, self.anchors = rule, strides, anchors

    def __call__(self, func, args, kwargs):
        out = self.rule(func, args, kwargs)
        if type(out) is ShardTensor:
            return _restrided(out, self.strides, args, kwargs)
        if type(out) is not tuple or len(out) != len(self.strides):
            raise Stale  # (never, so far: the same signature, the same path)
        return tuple(_restrided(o, s, args, kwargs) for o, s in zip(out, self.strides))


def _restrided(out, stride, args, kwargs):
    """``out`` with the global ``stride`` (as :func:`.meta.with_strides`; None: as it is)."""
    if stride is None or out.stride() == stride:
        return out
    if any(out is a for a in _common.shards_in((args, kwargs))):
        return out  # an in-place op returns its input as it is
    new = ShardTensor._wrap(out._local_tensor, out.device_mesh, out._layout, stride=stride)
    if hasattr(out, "_writeback"):
        new._writeback = out._writeback
    return new


class Decomposed:
    """Replay of an op torch decomposes: the decomposition again (each op in it replays
    its own kept decision), its result given the global strides the full path gave it."""

    __slots__ = ("fn", "layout", "stride", "anchors")

    def __init__(self, fn, layout, stride, anchors):
        self.fn, self.layout, self.stride, self.anchors = fn, layout, tuple(stride), anchors

    def __call__(self, func, args, kwargs):
        out = self.fn(*args, **kwargs)
        if type(out) is not ShardTensor or out._layout != self.layout:
            raise RuntimeError(
                f"shardlab internal error: {func}'s decomposition gave "
                f"{getattr(out, '_layout', type(out).__name__)} where it gave {self.layout} "
                "for the same signature before; please report it"
            )
        return _restrided(out, self.stride, args, kwargs)


class Stale(Exception):
    """A kept decision that does not apply to these blocks: decide in full this time."""


class LocalView:
    """The block of a view whose global shape argument is not the block's: every rank
    views its own block as ``shape`` (its local extent of the result)."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(shape)

    def __call__(self, args, kwargs):
        try:
            return args[0].view(self.shape)
        except (RuntimeError, ValueError):  # this block's strides do not allow a view
            raise Stale from None  # (a fake block's meta raises ValueError): the full path


class LocalReshape(LocalView):
    """The block of a reshape (a copy where a view cannot be): as :class:`LocalView`."""

    __slots__ = ()

    def __call__(self, args, kwargs):
        return args[0].reshape(self.shape)


class LocalSlice:
    """The block of a slice: this rank's ``[lo:hi:step]`` of its block along ``dim``
    (an empty slice is ``narrow(dim, 0, 0)``)."""

    __slots__ = ("dim", "lo", "hi", "step", "index")

    def __init__(self, dim, lo, hi, step):
        self.dim, self.lo, self.hi, self.step = dim, lo, hi, step
        self.index = (slice(None),) * dim + (slice(lo, hi, step),)

    def __call__(self, args, kwargs):
        if self.lo >= self.hi:
            return args[0].narrow(self.dim, 0, 0)
        return args[0][self.index]


class LocalSliceBackward:
    """The block of a slice's gradient: zeros of this rank's ``shape``, its block of the
    gradient written at ``index`` (None: the rank holds none of the slice)."""

    __slots__ = ("shape", "index")

    def __init__(self, shape, index):
        self.shape, self.index = tuple(shape), index

    def __call__(self, args, kwargs):
        y = args[0].new_zeros(self.shape)
        if self.index is not None:
            y[self.index] = args[0]
        return y


class LocalExpand:
    """The block of an expand: this rank's block expanded to its local ``shape``."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(shape)

    def __call__(self, args, kwargs):
        return args[0].expand(self.shape)
