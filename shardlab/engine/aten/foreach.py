"""``torch._foreach_*`` ops and the fused optimizer steps (``_fused_adamw_`` …) on
ShardTensors: what ``torch.optim`` runs with ``foreach=True`` (its default on GPUs) or
``fused=True``, and ``clip_grad_norm_(foreach=True)``.

A foreach op is n independent ops in one call; element i is made of the i-th tensor of
every list (a parameter, its gradient, its optimizer states)::

    params  [ w0 Shard(0) [4, 3],  w1 Shard(1) [4, 3],  b Replicate ]
    grads   [ g0 Shard(0) [4, 3],  g1 Shard(1) [4, 3],  gb Replicate ]
    steps   [ 0-d,                 0-d,                 0-d         ]   plain step counts
                   |                     |                   |
    rank r: one foreach call on the blocks  [w0_r, w1_r, b_r], [g0_r, g1_r, gb_r], steps
            (torch's one kernel for all of them; no message)

1. element i runs on the blocks of one layout: of its tensors' layouts, the one that
   moves the fewest elements (a written tensor moves there and back; ties: ``self``'s);
   its plain tensors are 0-d (a step count) or cut to it (a slice: no message)
   (:func:`element_layouts`, a pure function of layouts);
2. its other tensors laid out otherwise move there first (a gradient that came back
   Partial or cut otherwise: what ``p.add_(g)`` in a loop moves too), labelled
   ``_foreach_<op>.align``; then all elements run as one foreach call on the blocks (one
   kernel), and a written tensor that had to move gets its new values back;
3. an element whose ``self`` is Partial, or with a broadcast tensor, runs alone through
   the whole-tensor fallback (exact; labelled ``whole-tensor fallback for ...``);
4. the per-tensor reductions are the op per tensor through its own rule:
   ``_foreach_norm`` is ``linalg_vector_norm`` (one all-reduce of a scalar per cut
   tensor), ``_foreach_max`` is ``max``, ``_foreach_mm`` is ``mm``;
5. ``GradScaler``'s unscale (:func:`amp_unscale`): the kernel on the blocks, then one
   all-reduce of ``found_inf``.

The common case (each element's tensors of one layout, nothing Partial: every optimizer
step on parameters whose gradients and states are laid out like them) takes a one-pass
path before any of this (:mod:`.foreach_aligned`).

Before this rule, the in-place ops (every optimizer step) went to the fallback, which
wrote the new values into gathered copies only: cut parameters were silently not updated.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial

from shardlab.engine import _common as c
from shardlab.engine.meta import scalars_index
from shardlab.engine.registry import register
from shardlab.layout import ShardLayout
from shardlab.layout.moves import move_cost

from .fallback import replicate_and_run

aten = torch.ops.aten

__all__ = ["PLAIN", "element_layouts"]

_FUSED = ("_fused_adam", "_fused_adam_", "_fused_adamw", "_fused_adamw_", "_fused_sgd",
          "_fused_sgd_", "_fused_adagrad", "_fused_adagrad_")  # fmt: skip


def _ops() -> list:
    names = {
        n.split("::")[1].split(".")[0]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::_foreach_")
    }
    return [getattr(aten, n) for n in sorted(names | set(_FUSED)) if hasattr(aten, n)]


# a sum per tensor (2.11+) with no rule of its own per tensor: the fallback, per element
_ALONE = {"_foreach_powsum"}
# 4. the reductions: the op per tensor (each through its own rule)
_PER_TENSOR = {
    "_foreach_norm": lambda t, ord=2, dtype=None: aten.linalg_vector_norm.default(
        t, ord, dtype=dtype
    ),
    "_foreach_max": lambda t: aten.max.default(t),
    "_foreach_mm": lambda a, b: aten.mm.default(a, b),
}


PLAIN = "plain"  # an element of plain tensors only: torch's op on it, as it is


def element_layouts(elements) -> list:
    """Step 1, from layouts and shapes only. ``elements[i]`` lists element i's tensors in
    argument order as ``(layout or None for a plain tensor, shape, written)``. Element i
    runs on the blocks of the layout returned for it (its first ShardTensor's, the
    written ``self``'s for an in-place op), :data:`PLAIN`, or None: alone, whole."""
    out = []
    for tensors in elements:
        layouts = [lay for lay, _, _ in tensors if lay is not None]
        if not layouts:
            out.append(PLAIN)
            continue
        self = layouts[0]
        alone = any(isinstance(p, Partial) for p in self.placements) or any(
            len(shape) > 0 and (shape != self.global_shape or (lay is None and written))
            for lay, shape, written in tensors
        )  # a Partial self; a broadcast; a plain tensor written
        if alone or all(lay is self for lay in layouts[1:]):  # (the common case)
            out.append(None if alone else self)
            continue
        # the layout whose moves cost the fewest elements (a written tensor moves there
        # and back); ties: the first, self's
        options = [lay for i, lay in enumerate(layouts) if lay not in layouts[:i]]
        options = [o for o in options if not any(isinstance(p, Partial) for p in o.placements)]
        target = min(options, key=lambda o: _cost(tensors, o)) if options else self
        out.append(None if alone else target)
    return out


def _cost(tensors, target) -> int:
    total = 0
    for lay, _, written in tensors:
        if lay is not None and lay != target:
            total += move_cost(lay, target) + (move_cost(target, lay) if written else 0)
    return total


@register(*_ops())
def foreach(func, args, kwargs):
    name = c.op_name(func)
    st = c.ShardTensor
    values = (*args, *kwargs.values())
    n = max((len(v) for v in values if _is_list(v)), default=0)
    if n == 0 or any(_is_list(v) and len(v) not in (0, n) for v in values):
        return NotImplemented  # (torch's meta check has refused it before)
    if name in _ALONE:  # not element-wise, no rule per tensor: each alone, whole
        res = [_alone(func, args, kwargs, i, n, None) for i in range(n)]
        return None if func._schema.returns == [] else _gather(res)
    if name in _PER_TENSOR:
        if func._schema.returns == [] or kwargs.get("out") is not None:
            return NotImplemented  # the out= overloads: the fallback
        per = _PER_TENSOR[name]
        return [per(*_element(args, n, i), **_scalars(kwargs)) for i in range(n)]
    if any(isinstance(v, st) for v in values):  # a tensor for every element (``.Tensor``)
        scalars = [v for v in values if isinstance(v, st)]
        if any(v.ndim or not v._layout.is_whole() for v in scalars):
            return NotImplemented
    mesh = c.the_mesh(c.shards_in((args, kwargs)))
    written = _written_positions(func, args, kwargs)
    lists = [(v, w) for v, w in zip(values, written) if _is_list(v)]
    scalars = _scalars_at(func, args, kwargs)  # (one number per element: sliced)
    plains = [  # a plain tensor for every element (a learning rate)
        (v, w)
        for j, (v, w) in enumerate(zip(values, written))
        if type(v) in _PLAIN and j != scalars
    ]
    elements = []
    for i in range(n):
        tensors = [(t._layout if type(t) is st else None, t.shape, w)
                   for t, w in [(v[i], w) for v, w in lists] + plains]  # fmt: skip
        elements.append(_interned(tensors))
    targets = element_layouts(elements)
    here = [i for i in range(n) if targets[i] is not None]
    results: list = [None] * n
    if here:  # 2. one call on the blocks (moved to their element's layout first)
        cause = f"{name}.align"
        back: list = []
        sub = _blocks(args, kwargs, here, n, targets, written, mesh, cause, back, scalars)
        out = func(*sub[0], **sub[1])
        for orig, moved in back:  # a written tensor that had to move: its new values
            c.write_partial(
                orig, c.move(moved, c.without_partial(orig._layout), cause)._local_tensor
            )
        _place(results, out, here, mesh, targets)
    for i in (i for i in range(n) if targets[i] is None):  # 3. alone, whole
        results[i] = _alone(func, args, kwargs, i, n, scalars)
    if func._schema.returns == [] or all(r is None for r in results):
        return None
    return _gather(results)


@register(aten._amp_foreach_non_finite_check_and_unscale_.default)
def amp_unscale(func, args, kwargs):
    """``GradScaler.unscale_``: gradients times ``inv_scale``, and ``found_inf`` set to 1
    when any of them holds an inf or a NaN, on every rank alike::

        rank r: the kernel on its blocks (a Partial part: unscaling is linear; an inf in
                a part makes the sum inf or NaN)     -> found_inf_r
        found_inf = max over the mesh of found_inf_r    (one all-reduce of one float per
                                                         mesh dim)

    (The fallback gathered every gradient whole at every step.) One difference from one
    device: a Partial gradient whose parts are all finite but whose sum overflows (fp16)
    is not flagged here; its first use after the sum sees the inf."""
    st = c.ShardTensor
    grads, found_inf, inv_scale = (*args, *kwargs.values())
    if isinstance(found_inf, st) or isinstance(inv_scale, st):
        return NotImplemented
    mesh = c.the_mesh(c.shards_in(grads))
    func([c.local(g) for g in grads], found_inf, inv_scale)
    local = found_inf.reshape(()).clone()
    place = [Partial("max")] * mesh.ndim
    mine = st._wrap(local, mesh, ShardLayout.build((), tuple(mesh.shape), place))
    found_inf.copy_(c.replicated(mine, "unscale found_inf")._local_tensor.reshape(found_inf.shape))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _interned(tensors) -> list:
    """Equal layouts as one object (a parameter's gradient and states have their own
    layout objects, equal to its): :func:`element_layouts` then compares by identity."""
    first = None
    out = []
    for lay, shape, w in tensors:
        if lay is not None:
            if first is None:
                first = lay
            elif lay is not first and lay == first:
                lay = first
        out.append((lay, tuple(shape), w))
    return out


def _alone(func, args, kwargs, i, n, scalars):
    """Element i through the whole-tensor fallback: its results, as :func:`_place` keeps them."""
    one: list = [None]
    _place(one, replicate_and_run(func, *_subset(args, kwargs, [i], n, scalars)), [0], None, None)
    return one[0]


def _written_positions(func, args, kwargs) -> list[bool]:
    """For each value of ``(*args, *kwargs.values())``: does the op write it?"""
    names = [a.name for a in func._schema.arguments]
    w = set(c.written_args(func))
    return [i in w for i in range(len(args))] + [names.index(k) in w for k in kwargs]


def _is_list(v) -> bool:
    return isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v)


def _element(args, n, i) -> list:
    return [a[i] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]


def _scalars(kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if not isinstance(v, (list, tuple))}


def _subset(args, kwargs, idx, n, scalars=None):
    """The call restricted to the elements ``idx`` (lists of n sliced, and the ``Tensor
    scalars`` of one number per element at value index ``scalars``; other scalars as they
    are, empty optional lists kept empty)."""

    def one(v, j):
        if isinstance(v, (list, tuple)) and len(v) == n and n > 0:
            return [v[i] for i in idx]
        if j == scalars:
            return v[idx]
        return v

    k = len(args)
    return (
        [one(a, j) for j, a in enumerate(args)],
        {key: one(v, k + j) for j, (key, v) in enumerate(kwargs.items())},
    )


def _scalars_at(func, args, kwargs):
    """The value index (positional, then keyword) of a ``Tensor scalars`` argument of one
    number per element, or None."""
    i = scalars_index(func)
    if i is None:
        return None
    if i < len(args):
        return i
    return len(args) + list(kwargs).index("scalars") if "scalars" in kwargs else None


def _blocks(args, kwargs, idx, n, targets, written, mesh, cause, back, scalars):
    """The call restricted to ``idx``, each tensor as its block of its element's layout
    (moved there when laid out otherwise; a written one is noted in ``back``)."""
    st = c.ShardTensor

    def block(t, i, w):
        if not isinstance(t, torch.Tensor) or targets[i] is PLAIN:
            return t
        target = targets[i]
        if isinstance(t, st):
            if t._layout == target:
                return t._local_tensor
            moved = c.move(t, target, cause)
            if w:
                back.append((t, moved))
            return moved._local_tensor
        if t.ndim == 0:
            return t
        return c.move(c.as_shard(t, mesh), target, cause)._local_tensor  # (a slice)

    def one(v, j):
        if isinstance(v, (list, tuple)) and len(v) == n and n > 0:
            return [block(v[i], i, written[j]) for i in idx]
        if j == scalars:
            return v[idx]  # (one number per element)
        return c.local(v)  # a scalar, a 0-d tensor, an empty optional list

    k = len(args)
    return (
        [one(a, j) for j, a in enumerate(args)],
        {key: one(v, k + j) for j, (key, v) in enumerate(kwargs.items())},
    )


def _place(results, out, idx, mesh, layouts) -> None:
    """Results of the elements ``idx``: a list of tensors, or a tuple of such lists (the
    out-of-place fused steps; one is empty where the step has no such state, as
    ``max_exp_avg_sqs`` without amsgrad); blocks are wrapped in their element's layout."""
    if out is None:
        return
    lists = out if isinstance(out, tuple) else (out,)
    for j, i in enumerate(idx):
        got = []
        for lst in lists:
            t = lst[j] if len(lst) else _NONE
            if mesh is not None and layouts[i] not in (None, PLAIN) and isinstance(t, torch.Tensor):
                t = c.wrap(t, mesh, layouts[i])  # (element-wise: shaped like its element)
            got.append(t)
        results[i] = (got, isinstance(out, tuple))


_NONE = object()  # in an empty result list


def _gather(results):
    tupled = results[0][1]
    k = len(results[0][0])
    lists = [[r[0][j] for r in results if r[0][j] is not _NONE] for j in range(k)]
    return tuple(lists) if tupled else lists[0]
