"""Every aten op on a ShardTensor: shardlab decides the output layout itself.

For each op reaching ``ShardTensor.__torch_dispatch__``:

0. plain DTensor arguments become ShardTensors (chunk sizes are one layout among others),
   and torch's own checks run on shape-only (meta) copies of the *global* tensors, so
   bad arguments raise torch's error on every rank before anything else happens;
1. a rule registered for the op (:mod:`shardlab.engine.aten`), or the element-wise rule
   for ops torch tags ``pointwise``;
2. no rule, and every rank holds every argument whole (a 1-rank mesh, or nothing cut
   across ranks): torch's op on the blocks, no message (:mod:`.whole`);
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

from shardlab import _compat
from shardlab.comm import traced
from shardlab.engine import _common as c
from shardlab.engine import aten as _rules  # noqa: F401  (each family registers its rules)
from shardlab.engine import decisions, nograd, plans, registry
from shardlab.engine import meta as _meta
from shardlab.engine.aten.fallback import replicate_and_run
from shardlab.engine.aten.foreach import _ops
from shardlab.engine.aten.foreach_aligned import aligned
from shardlab.engine.aten.inplace_views import OUT_OF_PLACE, inplace_view
from shardlab.engine.aten.pointwise import is_pointwise, pointwise
from shardlab.engine.rule import Plan
from shardlab.engine.whole import on_blocks
from shardlab.layout import ShardLayout
from shardlab.tensor.api import ShardTensor

__all__ = ["dispatch", "signature"]

_TABLE = decisions._TABLE  # (read inline: the hit path, and the miss's first steps)
_DEPTH = decisions._DEPTH


def _foreach_ids() -> set:
    """ids of every overload of the ops :func:`~.aten.foreach.foreach` handles."""
    return {id(getattr(p, o)) for p in _ops() for o in p.overloads()}


_ALIGNED = _foreach_ids()

aten = torch.ops.aten
NO_META = _meta.NO_META
_SCALARS = decisions.SCALARS  # (a key holds these by type and value)


def dispatch(func, args, kwargs):
    if id(func) in _ALIGNED:  # a foreach op whose elements are each of one layout
        out = aligned(func, args, kwargs)
        if out is not NotImplemented:
            _written_views(func, args, kwargs, _written_args(func))
            nograd.seen(None, func, None)
            return out
    key = signature(func, args, kwargs)
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
    if nograd._WATCH[0] is not None:  # a torch function being learnt: not from this
        nograd.seen(None, func, None)
    _DEPTH[0] += 1  # (decisions.deciding, inline: the ops the rule calls run inside)
    try:
        return _decide(key, func, args, kwargs)
    finally:
        _DEPTH[0] -= 1


def _decide(key, func, args, kwargs):
    """The full path: adopt, torch's meta check, the plan (the rule's, or the next
    stage's), run, kept for the signature."""
    if func in OUT_OF_PLACE:  # x.transpose_(0, 1): the view's rule, then the wrapper
        out = inplace_view(func, args, kwargs, dispatch)
        if out is not NotImplemented:
            return out
    if key is None:  # (a key holds no DTensor to adopt, no stand-in of dynamo's)
        traced.check(func, args, kwargs)  # dynamo's stand-ins: a graph break
        args, kwargs = c.adopt((args, kwargs))
    meta = (
        _meta.copy_meta(func, args, kwargs)
        if func in NO_META
        else _meta.meta_call(func, args, kwargs)
    )
    # the arguments it writes (an optional one passed as None is not written: batch
    # norm's running stats when there are none; the key tells None from a tensor)
    written = [i for i in _written_args(func) if i >= len(args) or args[i] is not None]
    out, kept = _run(func, args, kwargs, meta, written)
    if written:  # a write into a view that had to be a copy: into its base too
        _written_views(func, args, kwargs, written)
    if key is not None and kept is not None:
        decisions.remember(key, kept)
    return out


def _run(func, args, kwargs, meta, written):
    """``(result, what to keep for the signature or None)``, from the first stage that
    takes the call: 1. the op's rule; 2. no rule, every argument whole: the op on the
    blocks; 3. torch's decomposition; 4. the whole-tensor fallback."""
    rule = registry.rule_for(func)
    if rule is None and is_pointwise(func) and _meta.elementwise_shapes(args, kwargs, meta):
        rule = pointwise
    if rule is not None:
        got = rule(func, args, kwargs)
        if type(got) is Plan:
            return _execute(got, func, args, kwargs, meta, written)
        if got is not NotImplemented:  # an algorithm of several ops: its result
            out = _meta.with_strides(got, meta, (args, kwargs))
            return out, None if written else _again(rule, func, args, kwargs, out, meta)
        # (a rule that declined may have sent first: c.reduced)
    plan = on_blocks(func, args, kwargs, meta)  # no rule, every argument whole
    if plan is not None:
        return _execute(plan, func, args, kwargs, meta, written)
    decomposed = _compat.decomposition(func)
    if decomposed is not None:
        out = decomposed(*args, **kwargs)
        if out is not NotImplemented and _meta.agrees(out, meta):
            out = _meta.with_strides(out, meta, (args, kwargs))
            return out, None if written else _decomposed(decomposed, func, args, kwargs, out)
        # a decomposition whose results do not look like the op's (torch's own for the
        # fused CPU attention returns weights where the op returns a logsumexp): the
        # shapes are global, so every rank drops it alike
    return replicate_and_run(func, args, kwargs), None


def _execute(plan, func, args, kwargs, meta, written):
    """Run ``plan`` as a kept decision runs it (:class:`~.plans.LocalCall`), its results
    given the global strides and dtypes of torch's meta run."""
    moves = plan.moves or (None,) * (len(args) + len(kwargs))
    outs = plan.layouts if plan.many else (plan.layouts,)
    metas = tuple(meta) if plan.many and isinstance(meta, (list, tuple)) else (meta,)
    how = []
    for i, layout in enumerate(outs):
        m = metas[i] if i < len(metas) else None
        if isinstance(m, torch.Tensor) and tuple(m.shape) == layout.global_shape:
            how.append((layout, m.stride(), m.dtype))
        else:  # no meta run: contiguous, the dtype the first run gives
            how.append((layout, None, None))
    kind = plans.LocalInplace if plan.inplace else plans.LocalCall
    anchors = _anchors(func, args, kwargs)
    run = kind(_whole_moves(moves, args, kwargs), plan.mesh, how, plan.many, plan.cause,
               anchors, plan.local)  # fmt: skip
    try:
        out = run(func, args, kwargs)
    except plans.Stale:  # not for these blocks (a block that cannot be viewed)
        if plan.otherwise is None:
            raise
        return plan.otherwise(func, args, kwargs), None
    run.first = False
    if written and not (plan.inplace and written == [0]):
        return out, None  # (an ``out=`` argument written: decided in full every time)
    return out, run


def _again(rule, func, args, kwargs, out, meta):
    """What keeps a rule that returned its result (:class:`~.plans.Again`), or None. With
    no meta run (a result whose size depends on the values: ``nonzero``), no strides are
    kept: each call's result keeps its own."""
    st = c.ShardTensor
    outs = out if type(out) is tuple else (out,)
    if not outs or not all(type(o) is st and not getattr(o, "_writeback", None) for o in outs):
        return None
    strides = tuple(o.stride() for o in outs) if type(out) is tuple else out.stride()
    if meta is None:
        strides = (None,) * len(outs) if type(out) is tuple else None
    return plans.Again(rule, strides, _anchors(func, args, kwargs))


def _decomposed(decomposed, func, args, kwargs, out):
    """An op torch decomposes (``addmm``, ``matmul`` …): kept as "decompose again" (each op
    inside replays its own plan), skipping the adoption and the meta check."""
    if type(out) is not c.ShardTensor or getattr(out, "_writeback", None):
        return None
    return plans.Decomposed(decomposed, out._layout, out.stride(), _anchors(func, args, kwargs))


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


def _anchors(func, args, kwargs) -> tuple:
    """The objects a key names by ``id``, kept alive by the decision: the op, every mesh,
    every ShardTensor's spec and layout."""
    meshes = {id(t.device_mesh): t.device_mesh for t in c.shards_in((args, kwargs))}
    return (func, *meshes.values(), *decisions.named(args, kwargs))


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
        if not whole or m is None:
            continue
        steps = (m,) if isinstance(m, ShardLayout) else m if type(m) is tuple else ()
        layouts = [s if isinstance(s, ShardLayout) else s[0] for s in steps]
        if layouts and all(t.is_whole() and a.shape == t.global_shape for t in layouts):
            out[i] = None
    return out


_WRITTEN: dict = {}


def _written_args(func) -> list[int]:
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = c.written_args(func)
    return hit


# -- the key: a call's signature ------------------------------------------------------
class _Uncacheable(Exception):
    pass


def signature(func, args, kwargs):
    """The key of the decision for ``func(*args, **kwargs)``, or None (not cacheable)."""
    st = ShardTensor
    try:
        # a ShardTensor's stride(), dtype and requires_grad each call its
        # __torch_function__ (~1 us each, more than the rest of the key): read them in C
        with _NO_TORCH_FUNCTION():
            key = [id(func)]  # ids (C hashes): the decision holds what they name alive
            for a in args:
                if type(a) is st:  # the common case, inline
                    layout = a._layout
                    if layout is None:
                        return None  # a traced stand-in: the full path breaks the graph
                    key.append((st, id(a._spec), id(layout), a.requires_grad))
                elif type(a) is int:  # a dim, a size (inline: as _sig has it)
                    key.append((int, a))
                elif type(a) is list:
                    if _all_ints(a):  # sizes, dims (view, sum, permute)
                        key.append((list, _INTS, *a))
                        continue
                    items = [list]  # tensors (cat's): as _sig has them, inline
                    for v in a:
                        if type(v) is st and v._layout is not None:
                            items.append((st, id(v._spec), id(v._layout), v.requires_grad))
                        else:
                            items.append(_sig(v, st))
                    key.append(tuple(items))
                else:
                    key.append(_sig(a, st))
            if kwargs:
                for k, v in kwargs.items():
                    key.append(k)
                    key.append(_sig(v, st))
    except _Uncacheable:
        return None
    return tuple(key)  # hashed once, by the lookup (which returns None if it cannot)


_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_INTS = "ints"  # in a key: a list of plain ints follows (never equal to _sig's entries)


def _all_ints(a) -> bool:
    for v in a:
        if type(v) is not int:
            return False
    return True


def _sig(a, st):
    t = type(a)
    if t is st:
        if a._layout is None:
            raise _Uncacheable  # a traced stand-in
        return (st, id(a._spec), id(a._layout), a.requires_grad)
    if isinstance(a, torch.Tensor):
        if isinstance(a, torch.distributed.tensor.DTensor) or t not in (
            torch.Tensor,
            torch.nn.Parameter,
        ):
            raise _Uncacheable  # a DTensor to adopt, another subclass: the full path
        return (torch.Tensor, a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
    if t is list or t is tuple:
        return (t, *[_sig(v, st) for v in a])  # (a list comprehension: no generator frame)
    if (t is float or t is complex) and a != a:
        return (t, "nan", str(a))  # nan != nan: it would never hit
    if t in _SCALARS:
        return (t, a)  # the type too: True, 1 and 1.0 are equal keys otherwise
    raise _Uncacheable
