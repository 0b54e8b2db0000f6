"""The matrix products: ``F.linear`` on rows, and aten's ``mm`` / ``bmm`` (what the rest
decomposes into). The layout arithmetic, which strategies a product has and what each
moves, is :mod:`shardlab.layout.matmul`.

``F.linear`` on rows: every ``nn.Linear`` of a sequence- or batch-parallel model.

An input ``(*, in_features)`` cut along its leading dims only (the sequence, the batch;
any sizes, in blocks) and a plain weight and bias (the module's parameters, the same
on every rank)::

    rank 0   x[0:5]  @ W.T + b  ->  y[0:5]        (one local F.linear, no message)
    rank 1   x[5:8]  @ W.T + b  ->  y[5:8]

1. the plain ``F.linear`` on this rank's block             (*, T_local, out_features)
2. the result laid out like the input, ``out_features`` whole on every rank
3. backward: torch's own linear backward on the block; the weight and bias gradients
   (this rank's rows' share) summed over the mesh dims cutting the input: parameters
   join every other parameter's share in ONE all-reduce at the end of the backward
   ("params backward", ``shardlab.tensor.grad_sum``); where that sum cannot wait
   (a hook on them, ``torch.autograd.grad``, DDP) one fused all-reduce of the two here
   ("linear.params backward"); none on a mesh of one rank

One autograd node and torch's kernels for what the aten path does in about eight
dispatched ops (view, t, mm, _unsafe_view and their backward), each deciding layouts.
Anything else (a cut ``in_features``, a Partial input, a strided dim or one cut by two
mesh dims (flattened image tokens on a 2-D mesh), sharded or DTensor
weights, a non-contiguous input) goes to torch's ``F.linear`` on the ShardTensors (the
aten rules); plain DTensors alone (torch's tensor parallelism) stay DTensor's.

``mm`` / ``bmm`` on ShardTensors (``matmul``, ``linear``, ``einsum`` decompose into them).

The strategy (see :mod:`shardlab.layout.matmul`) is the one whose operand moves cost the
fewest elements; then the product runs on the local blocks. Typical cases, no message::

    x (B*T, C) rows cut  @  W (C, N) whole   ->  y rows cut          (a linear layer)
    dy^T (N, B*T) @ x (B*T, C), both cut alike on B*T  ->  dW Partial(sum)
                                             (summed once, when the gradient is read)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from shardlab.engine import _common as c
from shardlab.engine.registry import register as _register
from shardlab.engine.rule import Plan
from shardlab.layout.matmul import mm_strategies
from shardlab.layout.moves import move_cost
from shardlab.ops._cnn_common import summed_grads
from shardlab.ops.registry import original, register

__all__: list[str] = []

_ROWS: dict = {}  # (input layout, out_features) -> the result layout, or False (not rows only)
_SIZE = 4096


def rows_only(layout) -> bool:
    """Blocks cut along leading dims only: no Partial, no Shard of the last dim, no dim
    cut by two mesh dims or strided (a pure function of the layout)."""
    last = len(layout.global_shape) - 1
    dims = [p.dim for p in layout.placements if isinstance(p, Shard)]
    return (
        layout.atoms is None
        and last not in dims
        and len(set(dims)) == len(dims)
        and not any(isinstance(p, Partial) for p in layout.placements)
    )


def out_layout(layout, out_features: int):
    """The input's layout with its last dim ``out_features`` long (kept per layout)."""
    key = (layout, out_features)
    hit = _ROWS.get(key)
    if hit is None:
        shape = (*layout.global_shape[:-1], out_features)
        hit = layout.replace(global_shape=shape) if rows_only(layout) else False
        if len(_ROWS) >= _SIZE:
            _ROWS.clear()
        _ROWS[key] = hit
    return hit


@register("linear", raw=True)  # what it does not take goes to torch as it came
def linear(input, weight, bias=None):
    from shardlab.tensor import ShardTensor
    from shardlab.tensor.create import from_layout
    from shardlab.tensor.functions import ToLocal

    layout = getattr(input, "_layout", None)
    if (
        type(input) is not ShardTensor
        or isinstance(weight, DTensor)
        or isinstance(bias, DTensor)
        or layout is None
        or input.ndim == 0
        or weight.ndim != 2
        or input.shape[-1] != weight.shape[1]
        or (bias is not None and tuple(bias.shape) != (weight.shape[0],))
        or not input.is_contiguous()
    ):
        return original("linear")(input, weight, bias)  # the aten rules (torch's errors)
    out = out_layout(layout, weight.shape[0])
    if out is False:
        return original("linear")(input, weight, bias)
    w, b = summed_grads([weight, bias], input, "linear.params")  # 3. in backward
    y = torch.nn.functional.linear(ToLocal.apply(input, layout), w, b)  # 1. (*, out)
    return from_layout(y, input.device_mesh, out)  # 2.


# -- aten's products ------------------------------------------------------------------
aten = torch.ops.aten


@_register(aten.mm.default, aten.bmm.default)
def _mm(func, args, kwargs):
    a, b = args[0], args[1]
    st = c.ShardTensor
    mesh = c.the_mesh(c.shards_in((a, b)))
    a = a if isinstance(a, st) else c.as_shard(a, mesh)
    b = b if isinstance(b, st) else c.as_shard(b, mesh)
    options = mm_strategies(a._layout, b._layout, func is aten.bmm.default)
    ta, tb, out = min(
        options, key=lambda o: move_cost(a._layout, o[0]) + move_cost(b._layout, o[1])
    )
    moves = [None if ta == a._layout else ta, None if tb == b._layout else tb]
    moves += [None] * (len(args) + len(kwargs) - 2)
    return Plan(mesh, out, moves, f"{c.op_name(func)}.align")  # the product of the blocks
