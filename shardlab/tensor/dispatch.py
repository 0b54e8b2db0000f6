"""Ops on ShardTensors: shardlab's handlers first, then DTensor, never a wrong answer.

For each aten op reaching ``ShardTensor.__torch_dispatch__``:

1. a handler registered with :func:`register` (uneven-aware ``mean``, views …);
2. all layouts even (``torch.chunk`` sizes): DTensor's own dispatch is right;
3. uneven: DTensor's sharding propagation says which placements result. If it
   needs no redistribution, the op runs on the local tensors and the output
   gets its sizes from the input dims it came from; otherwise a clear error
   says what to redistribute to. The result's local shape is checked against
   its layout before it is returned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map

from shardlab.layout import ShardLayout, format_sizes
from shardlab.tensor import comm

aten = torch.ops.aten
_HANDLERS: dict = {}


def register(*ops) -> Callable:
    """Decorator: ``@register(aten.mean.dim)`` handles that overload (or packet)."""

    def deco(fn):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return deco


def _shard_tensors(args, kwargs):
    from shardlab.tensor.api import ShardTensor

    return [a for a in tree_leaves((args, kwargs)) if isinstance(a, ShardTensor)]


def _describe(layout: ShardLayout) -> str:
    parts = [
        format_sizes(p, layout.sizes_along(p.dim) if isinstance(p, Shard) else None, m)
        for m, p in enumerate(layout.placements)
    ]
    return ", ".join(parts)


def dispatch(func, args, kwargs):
    handler = _HANDLERS.get(func) or _HANDLERS.get(func.overloadpacket)
    if handler is not None:
        return handler(func, args, kwargs)
    return generic(func, args, kwargs)


def generic(func, args, kwargs):
    """DTensor for even layouts, the local path for uneven ones (no handler)."""
    shards = _shard_tensors(args, kwargs)
    args, kwargs = _replicate_plain(args, kwargs, shards[0].device_mesh)
    args, kwargs = _same_sizes(func, args, kwargs, shards)
    shards = _shard_tensors(args, kwargs)
    if all(s._layout.is_even() for s in shards):
        out = DTensor.__torch_dispatch__(func, (DTensor,), args, kwargs)
        return tree_map(_from_dtensor, out)
    return _local_fallback(func, args, kwargs, shards)


def _same_sizes(func, args, kwargs, shards):
    """Inputs sharded alike (same mesh dim, same aligned dim and length) but with
    different sizes -- ``x + skip`` or ``cat([x, skip], 1)`` in a U-Net -- are moved to
    the first one's sizes (exact point-to-point moves of the rows that change owner)."""
    from shardlab.tensor.api import ShardTensor

    if len(shards) < 2:
        return args, kwargs
    ref = shards[0]

    def align(a):
        if not isinstance(a, ShardTensor) or a is ref or a._layout == ref._layout:
            return a
        sizes, changed = [], False
        for m, (p, q) in enumerate(zip(a._layout.placements, ref._layout.placements)):
            entry = a._layout.sizes[m]
            if (
                isinstance(p, Shard)
                and isinstance(q, Shard)
                and p.dim - a.ndim == q.dim - ref.ndim
                and a.shape[p.dim] == ref.shape[q.dim]
                and entry != ref._layout.sizes[m]
                and len(entry) == 1
            ):
                entry, changed = ref._layout.sizes[m], True
            sizes.append(entry)
        if not changed:
            return a
        dst = ShardLayout(
            a._layout.global_shape, a._layout.mesh_shape, a._layout.placements, tuple(sizes)
        )
        return _moved(a, dst, func)

    return tree_map(align, args), tree_map(align, kwargs)


def _replicate_plain(args, kwargs, mesh):
    """Plain tensors next to ShardTensors are read as replicated (the same on every
    rank), like DTensor's ``implicit_replication``; 0-dim tensors stay scalars."""
    from shardlab.tensor.api import ShardTensor

    def lift(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0:
            layout = ShardLayout.build(tuple(x.shape), tuple(mesh.shape), [Replicate()] * mesh.ndim)
            return ShardTensor._wrap(x, mesh, layout)
        return x

    return tree_map(lift, args), tree_map(lift, kwargs)


def _from_dtensor(x):
    from shardlab.tensor.api import ShardTensor

    if isinstance(x, DTensor) and not isinstance(x, ShardTensor):
        layout = ShardLayout.build(tuple(x.shape), tuple(x.device_mesh.shape), x.placements)
        return ShardTensor._wrap(x._local_tensor, x.device_mesh, layout)
    return x


def _to_dtensor(x):
    from shardlab.tensor.api import ShardTensor

    if isinstance(x, ShardTensor):
        return DTensor(x._local_tensor.detach(), x._spec, requires_grad=False)
    return x


def propagate(func, args, kwargs):
    """DTensor's sharding decision for this call (global shapes, no data moved)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(
        func, tree_map(_to_dtensor, args), tree_map(_to_dtensor, kwargs)
    )
    try:
        dispatcher.sharding_propagator.propagate(op_info)
    except RuntimeError as exc:  # DTensor refuses this op for this layout
        reason = str(exc).split("\n")[0]
        raise unsupported(func, _shard_tensors(args, kwargs), f"DTensor says: {reason}") from exc
    return op_info.output_sharding


def unsupported(func, shards, why: str, suggestion=None) -> NotImplementedError:
    have = "; ".join(f"{_describe(s._layout)}" for s in shards)
    hint = (
        f" Redistribute first, e.g. x.redistribute(mesh, {list(suggestion)})"
        if suggestion
        else " Redistribute to even sizes or to Replicate() first."
    )
    return NotImplementedError(
        f"{func.overloadpacket.__name__} on a ShardTensor with uneven sizes ({have}): {why}.{hint}"
    )


def _local_fallback(func, args, kwargs, shards):
    out_sharding = propagate(func, args, kwargs)
    schema = out_sharding.redistribute_schema
    if out_sharding.needs_redistribute and _same_specs(args, schema):
        # only shape arguments change (slice_backward, new_zeros ...): global -> local
        return _with_local_shapes(func, args, kwargs, out_sharding, shards)
    if out_sharding.needs_redistribute:
        args = _align_args(func, args, out_sharding.redistribute_schema, shards)
        out_sharding = propagate(func, args, kwargs)
        if out_sharding.needs_redistribute:
            raise unsupported(func, shards, "DTensor would move data assuming torch.chunk sizes")
        shards = _shard_tensors(args, kwargs)
    local_args, local_kwargs = tree_map(_local, (args, kwargs))
    result = func(*local_args, **local_kwargs)
    return wrap(result, out_sharding.output_spec, shards, func)


def _same_specs(args, schema) -> bool:
    if schema is None:
        return False
    from shardlab.tensor.api import ShardTensor

    return all(
        tuple(spec.placements) == tuple(a.placements)
        for a, spec in zip(args, schema.args_schema)
        if isinstance(a, ShardTensor)
    )


def _with_local_shapes(func, args, kwargs, out_sharding, shards):
    """Run ``func`` locally with every global-shape argument replaced by the local one."""
    spec = out_sharding.output_spec
    layout = output_layout(spec, shards, func)
    global_shape = list(layout.global_shape)
    local_shape = list(layout.local_shape(comm.my_coord(spec.mesh)))

    def fix(a):  # a shape argument (ints only: not a list of tensors, as torch.cat's)
        is_shape = isinstance(a, (list, tuple)) and all(isinstance(v, int) for v in a)
        return local_shape if is_shape and list(a) == global_shape else a

    local_args = [fix(tree_map(_local, a)) for a in args]  # lists too (torch.cat)
    local_kwargs = {k: fix(tree_map(_local, v)) for k, v in kwargs.items()}
    return wrap(func(*local_args, **local_kwargs), spec, shards, func)


def _align_args(func, args, schema, shards):
    """Move the args DTensor wants elsewhere, with the exact sizes of the other inputs.

    Typical case: a Replicate gradient meeting an uneven Shard input; it becomes
    a Shard with that input's sizes by local slicing (no communication).
    """
    from shardlab.tensor.api import ShardTensor

    if schema is None:
        raise unsupported(func, shards, "DTensor would move data assuming torch.chunk sizes")
    out = list(args)
    for i, (a, spec) in enumerate(zip(args, schema.args_schema)):
        if not isinstance(a, ShardTensor) or tuple(spec.placements) == tuple(a.placements):
            continue
        sizes = []
        for m, p in enumerate(spec.placements):
            if isinstance(p, Partial):
                raise unsupported(
                    func, shards, "DTensor would make an input Partial", spec.placements
                )
            ref = None
            if isinstance(p, Shard):  # an input whose dim lines up with it (broadcasting
                for s in shards:  # aligns dims from the right), sharded on mesh dim m
                    q = s._layout.placements[m]
                    if (
                        isinstance(q, Shard)
                        and q.dim - s.ndim == p.dim - a.ndim
                        and s._layout.global_shape[q.dim] == a.shape[p.dim]
                    ):
                        ref = s._layout.sizes[m]
                        break
            if ref is not None and len(ref) != 1:
                raise unsupported(
                    func, shards, "a dim sharded twice would have to move", spec.placements
                )
            # no input sharded this way yet: DTensor's own (chunk) sizes are consistent
            sizes.append(list(ref[0]) if ref is not None else None)
        dst = ShardLayout.build(
            a._layout.global_shape, a._layout.mesh_shape, tuple(spec.placements), sizes
        )
        out[i] = _moved(a, dst, func)
    return tuple(out)


def _moved(a, dst: ShardLayout, func):
    """ShardTensor ``a`` in layout ``dst``: the inputs ``func`` needs aligned, moved."""
    from shardlab.tensor.api import ShardTensor

    cause = f"{func.overloadpacket.__name__}.align"
    local = comm.redistribute_local(a._local_tensor, a._layout, dst, a.device_mesh, cause=cause)
    return ShardTensor._wrap(local, a.device_mesh, dst)


def _local(x):
    from shardlab.tensor.api import ShardTensor

    return x._local_tensor if isinstance(x, ShardTensor) else x


def output_layout(spec, shards, func) -> ShardLayout:
    """Sizes of an op's output: each sharded output dim takes the sizes of the
    input dim (same mesh dim, same global length) it was computed from."""
    shape = tuple(spec.tensor_meta.shape)
    sizes = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            raise unsupported(func, shards, "the local averages would be weighted wrongly")
        if not isinstance(p, Shard):
            sizes.append(None)
            continue
        found = None
        for s in shards:
            q = s._layout.placements[m]
            if isinstance(q, Shard) and s._layout.global_shape[q.dim] == shape[p.dim]:
                found = s._layout.sizes[m]
                if q.dim == p.dim:
                    break
        if found is None:
            raise unsupported(func, shards, f"output dim {p.dim} has no matching input sizes")
        sizes.append(found)
    return ShardLayout(shape, tuple(spec.mesh.shape), tuple(spec.placements), tuple(sizes))


def wrap(result, spec, shards, func):
    """Wrap local result(s) as ShardTensor(s) described by DTensor output spec(s)."""
    from shardlab.tensor.api import ShardTensor

    if isinstance(result, torch.Tensor):
        if spec is None:
            return result
        layout = output_layout(spec, shards, func)
        want = layout.local_shape(comm.my_coord(spec.mesh))
        if tuple(result.shape) != want:
            raise unsupported(
                func,
                shards,
                f"the local result has shape {tuple(result.shape)}, its layout needs {want}",
            )
        return ShardTensor._wrap(result, spec.mesh, layout)
    if isinstance(result, (list, tuple)):
        specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(result)
        return type(result)(wrap(r, s, shards, func) for r, s in zip(result, specs))
    return result


# -- handlers ---------------------------------------------------------------
@register(aten.mean.default, aten.mean.dim)
def _mean(func, args, kwargs):
    """mean = sum / count with the true global count (DTensor averages the local means)."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(x.ndim))
    dims = [d % max(x.ndim, 1) for d in ([dims] if isinstance(dims, int) else dims)]
    count = 1
    for d in dims:
        count *= x.shape[d]
    total = aten.sum.dim_IntList(x, dims, keepdim, dtype=dtype)
    return aten.div.Tensor(total, count)


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default)
def _view(func, args, kwargs):
    """Views on unsharded dims: DTensor decides the placements, the layout the local shape."""
    shards = _shard_tensors(args, kwargs)
    if all(s._layout.is_even() for s in shards):
        return tree_map(_from_dtensor, DTensor.__torch_dispatch__(func, (DTensor,), args, kwargs))
    x = args[0]
    out_sharding = propagate(func, args, kwargs)
    schema = out_sharding.redistribute_schema
    if schema is not None and schema.args_schema[0].placements != x.placements:
        raise unsupported(
            func,
            shards,
            "the view merges or splits a sharded dim",
            schema.args_schema[0].placements,
        )
    layout = output_layout(out_sharding.output_spec, shards, func)
    local_shape = layout.local_shape(comm.my_coord(x.device_mesh))
    result = func(x._local_tensor, list(local_shape), *args[2:], **kwargs)
    return wrap(result, out_sharding.output_spec, shards, func)


@register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _extreme(func, args, kwargs):
    """max/min where this rank's block is empty along a reduced dim: torch refuses an
    empty reduction, so the rank contributes the identity (-inf for max) instead."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim", ())
    dims = [d % x.ndim for d in (dims if dims else range(x.ndim))]
    local = x._local_tensor
    if not any(local.shape[d] == 0 and x.shape[d] > 0 for d in dims):
        return generic(func, args, kwargs)
    out_sharding = propagate(func, args, kwargs)
    spec = out_sharding.output_spec
    layout = output_layout(spec, [x], func)
    is_max = func in (aten.amax.default, aten.max.default)
    info = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
    fill = (
        (-float("inf") if is_max else float("inf"))
        if x.dtype.is_floating_point
        else (info.min if is_max else info.max)
    )
    result = torch.full(
        layout.local_shape(comm.my_coord(x.device_mesh)), fill, dtype=x.dtype, device=local.device
    )
    return wrap(result, spec, [x], func)


@register(aten.sum.dim_IntList)
def _sum(func, args, kwargs):
    """``sum(dim=[])`` means every dim in aten (autograd uses it); say so explicitly."""
    x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is not None and len(dims) == 0:
        args = (x, list(range(x.ndim)), *args[2:])
    return generic(func, args, kwargs)
