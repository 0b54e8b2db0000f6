"""The last resort for an op no rule and no decomposition covers: compute it whole.

1. every ShardTensor argument is gathered whole on every rank (Partial values reduced),
   labelled ``whole-tensor fallback for <op>`` in the tracer;
2. the op runs on the whole tensors, the same on every rank (random ops too: every rank
   draws the same numbers when the ranks' generators agree, as after ``manual_seed``);
3. results come back Replicate, except that a result shaped like the first sharded input
   is cut like it again (slicing: no message), and arguments the op writes (``x.op_()``,
   ``out=``) get their new values back in their own layout.

Always exact, never a hang (the decision reads global layouts only), but it moves and
holds whole tensors: a rule in this package is the fix for an op that shows up here.
"""

from __future__ import annotations

import torch

from shardlab.comm import graphs, traced, traced_ops
from shardlab.engine import _common as c

aten = torch.ops.aten


def replicate_and_run(func, args, kwargs):
    st = c.ShardTensor
    shards = c.shards_in((args, kwargs))
    mesh = c.the_mesh(shards)
    cause = f"whole-tensor fallback for {c.op_name(func)}"
    if mesh.size() != 1:
        if graphs.in_graphs() and traced_ops.cut_by_dynamo(shards, {}):
            # (inside messages_in_graphs(): an op on whole tensors, written in place or
            # read through its strides, met torch's functionalization, which refuses a
            # mutation through an ``as_strided`` view: the compile failed, on every rank)
            traced.graph_break(f"{cause}: runs eagerly")
    whole: dict[int, object] = {}

    def gather(a):
        if isinstance(a, st):
            if id(a) not in whole:
                whole[id(a)] = _with_global_strides(c.replicated(a, cause)._local_tensor, a)
            return whole[id(a)]
        return a

    local_args, local_kwargs = c.tree_map(gather, (args, kwargs))
    local_args = list(local_args)
    # the arguments it writes, by position or by name (``out=``); a list of tensors too
    # (``_foreach_add_``): (argument, its gathered copy, where the copy goes back)
    names = [a.name for a in func._schema.arguments]
    written = []
    for i in c.written_args(func):
        if i < len(args):
            written.append((args[i], local_args, i))
        elif names[i] in kwargs:
            written.append((kwargs[names[i]], local_kwargs, names[i]))
    for arg, where, k in written:  # in place on a gathered copy, never the caller's block
        where[k] = _private(where[k], arg, st)
    result = func(*local_args, **local_kwargs)
    _check_dense(func, result)  # decided from the whole result: the same on every rank
    for arg, where, k in written:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        fulls = where[k] if isinstance(arg, (list, tuple)) else [where[k]]
        for target, full in zip(items, fulls):
            if isinstance(target, st):
                _write_back(target, full)
    if written and c.is_inplace(func) and isinstance(args[0], st):
        return args[0]
    first = shards[0]
    if _returns_view(func) and isinstance(args[0], st) and isinstance(result, torch.Tensor):
        # a view of the gathered copy: kept whole, and written back into the input
        out = c.wrap(result, mesh, c.replicate_layout(result.shape, mesh))
        base, full = args[0], local_args[0]
        return c.with_writeback(out, lambda: (_write_back(base, full), c.written(base)))
    return _rewrap(result, mesh, first, written)


def _private(gathered, arg, st):
    """``gathered`` (a copy of ``arg``, or a list of them), never aliasing a block of the
    caller's (a Replicate block is gathered as itself)."""
    if isinstance(arg, (list, tuple)):
        return [_private(g, a, st) for g, a in zip(gathered, arg)]
    if isinstance(arg, st) and gathered is arg._local_tensor:
        return gathered.clone()
    return gathered


def _returns_view(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not c.written_args(func)


def _with_global_strides(full: torch.Tensor, x) -> torch.Tensor:
    """The gathered tensor laid out with ``x``'s global strides: ops that address memory
    (``as_strided``, which torch's decompositions of ``diagonal`` ... emit) then read
    what they would read on one device."""
    if full.stride() == x.stride() or full.numel() == 0:
        return full
    # an expanded dim (stride 0: every element along it the same, as one device holds it)
    # is made from one slice of it, expanded: memory written through it would overlap
    expanded = [d for d, (n, st) in enumerate(zip(x.shape, x.stride())) if st == 0 and n > 1]
    base = [1 if d in expanded else n for d, n in enumerate(x.shape)]
    strides = [1 if d in expanded else st for d, st in enumerate(x.stride())]
    one = full[tuple(slice(0, 1) if d in expanded else slice(None) for d in range(x.ndim))]
    if expanded and not torch.equal(one.expand(full.shape), full):
        return full  # a stride of 0 over values that differ (a DTensor's local strides)
    try:
        out = torch.empty_strided(base, strides, dtype=full.dtype, device=full.device)
        out.copy_(one)
    except RuntimeError:  # strides no dense tensor has (overlapping otherwise): as gathered
        return full
    return out.expand(tuple(x.shape)) if expanded else out


def _check_dense(func, result) -> None:
    for r in c.tree_leaves(result):
        if isinstance(r, torch.Tensor) and r.layout != torch.strided:
            raise NotImplementedError(
                f"{c.op_name(func)} on a ShardTensor: its result is a {r.layout} tensor; "
                "shardlab holds dense (torch.strided) tensors only. Call it on .full_tensor()."
            )


def _write_back(x, full: torch.Tensor) -> None:
    """The op wrote the whole tensor ``full``: keep ``x``'s block of it."""
    layout = c.replicate_layout(full.shape, x.device_mesh)
    if tuple(full.shape) != tuple(x.shape):
        raise NotImplementedError(
            f"an op resized a ShardTensor in place ({tuple(x.shape)} -> {tuple(full.shape)}); "
            "not supported on ShardTensors"
        )
    block = c.move(
        c.ShardTensor._wrap(full, x.device_mesh, layout),
        c.without_partial(x._layout),
        "write back",
    )
    c.write_partial(x, block._local_tensor)


def _rewrap(result, mesh, first, written):
    if isinstance(result, torch.Tensor):
        for arg, where, k in written:  # an op returning its (out=) argument returns it
            if result is where[k]:
                return arg
        out = c.wrap(result, mesh, c.replicate_layout(result.shape, mesh))
        lay = c.without_partial(first._layout)
        if tuple(result.shape) == tuple(first.shape) and lay != out._layout:
            out = c.move(out, lay, "fallback.reshard")  # a slice of what every rank has
        return out
    if isinstance(result, (list, tuple)):
        return c.rebuild(result, [_rewrap(r, mesh, first, written) for r in result])
    return result
