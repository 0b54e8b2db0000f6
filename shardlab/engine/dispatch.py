"""Every aten op on a ShardTensor: shardlab decides the output layout itself.

For each op reaching ``ShardTensor.__torch_dispatch__``:

0. plain DTensor arguments become ShardTensors (chunk sizes are one layout among others),
   and torch's own checks run on shape-only (meta) copies of the *global* tensors, so
   bad arguments raise torch's error on every rank before anything else happens;
1. a rule registered for the op (:mod:`shardlab.engine.aten`), or the element-wise rule
   for ops torch tags ``pointwise``;
2. no rule, and every rank holds every argument whole (a 1-rank mesh, or nothing cut
   across ranks): torch's op on the blocks, no message (:mod:`.aten.whole`);
3. torch's decomposition of the op into simpler ones (each routed here again);
4. the fallback: the op on whole tensors (:mod:`.aten.fallback`), labelled
   ``whole-tensor fallback for <op>`` in the tracer.

A rule that cannot describe its result for the layout it got moves its input to the
cheapest layout that works first, labelled ``auto-redistribute for <op>``.

Every step decides from global layouts and shapes only, never from a local shape, so
every rank takes the same path and posts the same collectives. Nothing here depends on
DTensor's sharding rules, which change from release to release.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial

from shardlab import _compat
from shardlab.comm import traced
from shardlab.engine import _common as c
from shardlab.engine import decisions, nograd, plans
from shardlab.engine import meta as _meta
from shardlab.engine.aten import HANDLERS, register
from shardlab.engine.aten.fallback import replicate_and_run
from shardlab.engine.aten.foreach import _ops
from shardlab.engine.aten.foreach_aligned import aligned
from shardlab.engine.aten.inplace_views import OUT_OF_PLACE, inplace_view
from shardlab.engine.aten.pointwise import is_pointwise, pointwise, replay
from shardlab.engine.aten.whole import on_blocks, whole_arguments
from shardlab.layout import ShardLayout

__all__ = ["dispatch", "register"]

_TABLE = decisions._TABLE  # (read inline: the hit path)


def _foreach_ids() -> set:
    """ids of every overload of the ops :func:`~.aten.foreach.foreach` handles."""
    return {id(getattr(p, o)) for p in _ops() for o in p.overloads()}


_ALIGNED = _foreach_ids()

aten = torch.ops.aten
# ops whose meta run is pointless (no shape arguments to check) or unsupported
_NO_META = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
}


def dispatch(func, args, kwargs):
    if id(func) in _ALIGNED:  # a foreach op whose elements are each of one layout
        out = aligned(func, args, kwargs)
        if out is not NotImplemented:
            _written_views(func, args, kwargs, _written_args(func))
            nograd.seen(None, func, None)
            return out
    key = plans.signature(func, args, kwargs)
    if key is not None:
        try:
            decided = _TABLE.get(key)
        except TypeError:  # an unhashable scalar somewhere
            decided = key = None
        if decided is not None:  # decided before for this signature: replay
            try:
                out = decided(func, args, kwargs)
            except plans.Stale:  # not for these blocks (a view of strided ones)
                pass
            else:
                if nograd._WATCH[0] is not None:  # a torch function being learnt
                    nograd.seen(decided, func, out)
                return out
    traced.check(func, args, kwargs)  # dynamo's stand-ins (never a key): a graph break
    nograd.seen(None, func, None)
    if key is None:
        with decisions.deciding():
            return _decide(key, func, args, kwargs)
    named, before = decisions.named(args, kwargs), decisions.lookup(key)  # (as keyed)
    with decisions.deciding():
        out = _decide(key, func, args, kwargs)
    decisions.hold(key, before, named)
    return out


def _decide(key, func, args, kwargs):
    """The full path: adopt, torch's meta check, the rule, global strides, keep it."""
    if func in OUT_OF_PLACE:  # x.transpose_(0, 1): the view's rule, then the wrapper
        out = inplace_view(func, args, kwargs, dispatch)
        if out is not NotImplemented:
            return out
    args, kwargs = c.adopt((args, kwargs))
    meta = (
        _copy_meta(func, args, kwargs) if func in _NO_META else _meta.meta_call(func, args, kwargs)
    )
    ran = []
    # the arguments it writes (an optional one passed as None is not written: batch
    # norm's running stats when there are none; the key tells None from a tensor)
    written = [i for i in _written_args(func) if i >= len(args) or args[i] is not None]
    before = getattr(args[0], "_layout", None) if written == [0] and args else None
    raw = _run(func, args, kwargs, meta, ran)
    out = _with_strides(raw, meta, (args, kwargs))
    if written:  # a write into a view that had to be a copy: into its base too
        _written_views(func, args, kwargs, written)
    if key is not None and not written:
        if ran and ran[0] is _DECOMPOSED:  # decomposed with no rule tried first
            _remember_decomposed(key, func, args, kwargs, out, ran[1])
        else:
            _remember(key, func, args, kwargs, raw, out, ran == [pointwise_rule])
    elif key is not None and before is not None and ran == [pointwise_rule]:
        _remember_inplace(key, func, args, kwargs, out, before)
    return out


def _written_views(func, args, kwargs, written) -> None:
    """:func:`~._common.written` for each ShardTensor the op wrote: by position, by
    name (``out=``), and inside a written list (``_foreach_add_``)."""
    st = c.ShardTensor
    names = func._schema.arguments
    for i in written:
        a = args[i] if i < len(args) else kwargs.get(names[i].name)
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, st):
                c.written(t)


def _remember_inplace(key, func, args, kwargs, out, before) -> None:
    """An element-wise op that wrote its first argument and left its layout as it was
    (no Partial reduced into it): kept as :class:`~.plans.LocalInplace`."""
    self = args[0]
    if out is not self or self._layout is not before or not c.is_inplace(func):
        return
    if any(isinstance(p, Partial) for p in before.placements):
        return  # reduced first when the op is not linear in it: decided in full
    how = replay(func, args, kwargs, out)
    if how is None or how[0][0] is not None:
        return
    moves, mesh, _, cause = how
    moves = _whole_moves(moves, args, kwargs)
    anchors = _anchors(func, args, kwargs)
    decisions.remember(key, plans.LocalInplace(moves, mesh, [], False, cause, anchors))


_DECOMPOSED = object()  # in ``ran``: torch's decomposition made the result


def _remember_decomposed(key, func, args, kwargs, out, decomposed) -> None:
    """An op torch decomposes (``addmm``, ``matmul`` …): kept as "decompose again" (each op
    inside replays its own decision), skipping the adoption, the meta check and the
    comparison with it, which hold for every call of the same signature."""
    st = c.ShardTensor
    if type(out) is not st or getattr(out, "_writeback", None):
        return
    anchors = _anchors(func, args, kwargs)
    decisions.remember(key, plans.Decomposed(decomposed, out._layout, out.stride(), anchors))


def _anchors(func, args, kwargs) -> tuple:
    """The objects a key names by ``id``: the op and every mesh (kept alive by the decision)."""
    meshes = {id(t.device_mesh): t.device_mesh for t in c.shards_in((args, kwargs))}
    return (func, *meshes.values())


def _remember(key, func, args, kwargs, raw, out, elementwise) -> None:
    """Keep the decision just taken, when it was a local call (see :mod:`.decisions`)."""
    st = c.ShardTensor
    many = isinstance(out, tuple) and isinstance(raw, tuple) and len(out) > 0  # or return_types
    outs = out if many else (out,)
    if not all(isinstance(o, st) and not getattr(o, "_writeback", None) for o in outs):
        return
    how = getattr(raw[0] if many else raw, "_decided", None)
    if how is not None and (how[0] is not func or how[1] != decisions.depth()):
        return  # decided for another op, or inside (an op this one decomposed into)
    how = how and how[2:]
    if how is None and elementwise and not many:
        how = replay(func, args, kwargs, out)
        how = how and (*how, None)
    if how is None:
        how = _on_whole_blocks(func, args, kwargs, outs, many)
    if how is not None:
        moves, mesh, layouts, cause, local = how
        moves = _whole_moves(moves, args, kwargs)
        layouts = layouts if many else (layouts,)
        if [o._layout for o in outs] != list(layouts):
            return  # not what the rule said it made: decide in full every time
        outs = [(o._layout, o.stride(), o.dtype) for o in outs]
        anchors = _anchors(func, args, kwargs)
        decisions.remember(key, plans.LocalCall(moves, mesh, outs, many, cause, anchors, local))


def _whole_moves(moves, args, kwargs) -> list:
    """A move from a whole block to a whole layout is no move (each rank's block of the
    one is its block of the other: a relabelling over mesh dims of one rank, or a plain
    tensor "cut" to a layout that cuts nothing): kept as None, the block as it is."""
    st = c.ShardTensor
    out = list(moves)
    for i, (a, m) in enumerate(zip((*args, *kwargs.values()), moves)):
        whole = type(a) in (torch.Tensor, torch.nn.Parameter) or (
            type(a) is st and a._layout.is_whole()
        )
        if whole and isinstance(m, ShardLayout) and m.is_whole() and a.shape == m.global_shape:
            out[i] = None
    return out


# ops whose values or success depend on the block's own strides, which a key (global
# strides) does not fix: decided in full every time on whole blocks too
_STRIDED_READS = {aten.as_strided, aten.as_strided_copy, aten.as_strided_scatter,
                  aten.view, aten._unsafe_view, aten.view_copy, aten._reshape_alias}  # fmt: skip


def _on_whole_blocks(func, args, kwargs, outs, many):
    """Every ShardTensor argument and result whole on every rank (``ShardLayout.is_whole``:
    a 1-rank mesh, or no cut across ranks): whatever the rule did, the op on the blocks
    as they are gives each rank the whole result, so the decision is kept as that local
    call (a ``select`` of a cut dim on one rank, a ``cat`` of a lifted Replicate tensor
    and a Shard one). Not for random ops (their rules define their own draws), nor for
    ops that read the block's strides (:data:`_STRIDED_READS`)."""
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None
    if func.overloadpacket in _STRIDED_READS:
        return None
    if not all(o._layout.is_whole() for o in outs):
        return None
    scanned = whole_arguments(args, kwargs)
    if scanned is None:
        return None
    moves, first, _ = scanned
    layouts = tuple(o._layout for o in outs)
    return moves, first.device_mesh, layouts if many else layouts[0], "", None


_WRITTEN: dict = {}


def _written_args(func) -> list[int]:
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = c.written_args(func)
    return hit


def _run(func, args, kwargs, meta, ran):
    handler = HANDLERS.get(func) or HANDLERS.get(func.overloadpacket)
    if handler is None and is_pointwise(func) and elementwise_shapes(args, kwargs, meta):
        handler = pointwise_rule
    if handler is not None:
        out = handler(func, args, kwargs)
        if out is not NotImplemented:
            ran.append(handler)
            return out
        ran.append(NotImplemented)  # a rule that declined may have sent (c.reduced) first
    out = on_blocks(func, args, kwargs, meta)  # no rule, every argument whole
    if out is not None:
        return out
    decomposed = _compat.decomposition(func)
    if decomposed is not None:
        out = decomposed(*args, **kwargs)
        if out is not NotImplemented and _agrees(out, meta):
            ran += [_DECOMPOSED, decomposed]
            return out
        # a decomposition whose results do not look like the op's (torch's own for the
        # fused CPU attention returns weights where the op returns a logsumexp): the
        # shapes are global, so every rank drops it alike
    return replicate_and_run(func, args, kwargs)


def _agrees(out, meta) -> bool:
    """Same structure, shapes and dtypes as the meta run (True when there is none)."""
    if meta is None:
        return True
    if isinstance(meta, torch.Tensor):
        return (
            isinstance(out, torch.Tensor)
            and tuple(out.shape) == tuple(meta.shape)
            and out.dtype == meta.dtype
        )
    if isinstance(meta, (list, tuple)):
        return (
            isinstance(out, (list, tuple))
            and len(out) == len(meta)
            and all(_agrees(o, m) for o, m in zip(out, meta))
        )
    return True


def _copy_meta(func, args, kwargs):
    """The strides torch gives an alias or a copy of a ShardTensor (``detach`` and
    ``alias`` keep its strides, ``clone`` and ``_to_copy`` follow ``memory_format``), from
    a meta tensor (no meta run of the op itself: a device argument has none)."""
    x = args[0] if args else None
    if func not in _COPIES or not isinstance(x, c.ShardTensor):
        return None
    with traced.outside_modes():
        m = torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
        if func is aten.clone.default or func is aten._to_copy.default:
            fmt = kwargs.get("memory_format")
            m = m.clone(memory_format=torch.preserve_format if fmt is None else fmt)
        return m


_COPIES = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default}


def _with_strides(out, meta, inputs):
    """Results get the global strides torch gives on one device (from the meta run):
    the same on every rank, so composite ops that branch on them agree everywhere."""
    if meta is None:
        return out
    st = c.ShardTensor
    if isinstance(out, st) and isinstance(meta, torch.Tensor):
        if out.stride() == meta.stride() or tuple(out.shape) != tuple(meta.shape):
            return out
        if any(out is a for a in c.shards_in(inputs)):
            return out  # an in-place op returns its input as it is
        new = st._wrap(out._local_tensor, out.device_mesh, out._layout, stride=meta.stride())
        if hasattr(out, "_writeback"):
            new._writeback = out._writeback
        return new
    if isinstance(out, (list, tuple)) and isinstance(meta, (list, tuple)) and len(out) == len(meta):
        return c.rebuild(out, [_with_strides(o, m, inputs) for o, m in zip(out, meta)])
    return out


def pointwise_rule(func, args, kwargs):
    return pointwise(func, args, kwargs)


def elementwise_shapes(args, kwargs, meta) -> bool:
    """Is every tensor result the broadcast shape of the inputs? (torch tags ``glu``
    pointwise, but it halves a dim: blocks of odd length would fail on some ranks.)"""
    if meta is None:
        return True
    shape = c.broadcast_shapes(
        [tuple(t.shape) for t in c.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    )
    return all(tuple(m.shape) == shape for m in c.tree_leaves(meta) if isinstance(m, torch.Tensor))
