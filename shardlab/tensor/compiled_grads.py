"""A ShardTensor around compiled code: its flatten format and cache key (:func:`unflatten`,
:func:`stable_hash`), and its gradients, fixed where AOTAutograd's guesses differ from eager.

A backward started from a ShardTensor (``loss.backward()``, :mod:`shardlab.tensor.backward`)
passes here when something was compiled in this process (``traced.COMPILED``):

1. before it, :func:`zero_gradients`: a compiled function's ShardTensor output that gets no
   gradient (a model's logits next to its loss) would get plain zeros from autograd,
   which the compiled backward refuses (torch's issue #173123): such outputs get
   Replicate zeros as extra roots;
2. after it, :func:`plain_gradients`: compiled code takes parameters as they are
   (``traced_ops.one_rank``, ``traced_ops.check_ranks``), and a ``.grad`` that came back as a
   ShardTensor is made the plain tensor it is eagerly.

Any backward, whatever its root: :func:`route`, set when a compiled backward node reads a
ShardTensor gradient (``ShardTensor.__tensor_flatten__``), sends the partial gradients of
the plain parameters it took to the end-of-backward sum (:mod:`shardlab.tensor.grad_sum`).
"""

from __future__ import annotations

import functools
import hashlib

import torch
from torch.distributed.tensor import DTensor

from shardlab.comm import p2p, traced
from shardlab.tensor import api, create, grad_sum

__all__ = ["plain_gradients", "route", "zero_gradients"]


def zero_gradients(roots, mesh) -> tuple[list, list, list]:
    """Extra roots for a backward from ``roots``: a compiled function (AOTAutograd's) with
    a ShardTensor output that gets no gradient (a model's logits next to its loss) would
    get plain zeros from autograd, which its compiled backward refuses (torch's issue
    #173123). Each such output gets a root of its own: Replicate zeros (the compiled
    backward moves them to the layout it was built for, with no message; added to the
    output's real gradient where it has one).

    Returns (gradient edges, zeros, plain leaves): the same walk of the graph collects
    the plain tensors the backward accumulates into, for :func:`plain_gradients` after
    it (one walk a step, not two)."""
    if not traced.COMPILED:
        return [], [], []
    from torch.autograd.graph import GradientEdge
    from torch.distributed.tensor import DTensor

    edges, zeros, leaves = [], [], []
    for node in _nodes(roots):
        var = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if var is not None:
            if not isinstance(var, DTensor):
                leaves.append(var)
            continue
        meta = getattr(getattr(node, "_forward_cls", None), "metadata", None)
        if meta is not None and hasattr(meta, "output_info"):  # AOTAutograd's backward
            for j, shape, dtype, device in _sharded_outputs(node, meta):
                edges.append(GradientEdge(node, j))
                zeros.append(_zeros(shape, dtype, device, mesh))
    return edges, zeros, leaves


def _nodes(roots):
    """Every autograd node reachable from ``roots``, once."""
    seen, stack = set(), [getattr(r, "grad_fn", None) for r in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(f for f, _ in node.next_functions if f is not None)


def _sharded_outputs(node, meta):
    """(index, global shape, dtype, device) of each differentiable ShardTensor output."""

    first = meta.num_mutated_inp_runtime_indices
    for i, info in enumerate(meta.output_info):
        kind = getattr(info.output_type, "name", "")
        if kind not in ("non_alias", "unsafe_view_alias", "custom_function_view"):
            continue
        if not (info.requires_grad and issubclass(info.raw_type, api.ShardTensor)):
            continue
        m = node._input_metadata[first + i]
        yield first + i, tuple(m.shape), m.dtype, m.device


def _zeros(shape, dtype, device, mesh):
    return create.as_shard(torch.zeros(shape, dtype=dtype, device=device), mesh)  # Replicate


def plain_gradients(leaves) -> None:
    """After a backward through compiled code: a plain leaf (from :func:`zero_gradients`'
    walk) whose ``.grad`` came back as a ShardTensor (whole on one rank, a partial sum
    cut over several) gets it as the plain full gradient, as eagerly."""
    from torch.distributed.tensor import DTensor

    for var in leaves:
        g = var.grad
        if not isinstance(g, DTensor):
            continue
        whole = g.device_mesh.size() == 1 or all(p.is_replicate() for p in g.placements)
        if whole and not g.requires_grad:
            var.grad = g._local_tensor  # one rank, or Replicate: the block is the tensor
        else:
            var.grad = g.full_tensor()  # (cut over ranks: a partial sum, summed)


def route(node) -> None:
    """A compiled function's backward ``node`` gives its plain leaves (parameters used
    next to ShardTensors cut over several ranks, taken into the graph as they are) their
    gradients as ShardTensors, a partial sum on each rank: a hook on ``node`` hands each
    to :mod:`shardlab.tensor.grad_sum`, summed with the others at the end of the backward
    (or sums it at once where that rule does not hold), so ``.grad`` is the plain full
    gradient, as eagerly. Once per node."""
    if getattr(node, "_shardlab_routed", False):
        return
    node._shardlab_routed = True
    node.register_hook(functools.partial(_route_hook, node))


def _route_hook(node, grad_inputs, grad_outputs):
    from torch.distributed.tensor import DTensor, Partial

    out = None
    for i, g in enumerate(grad_inputs):
        if type(g) is not api.ShardTensor or g._spec.mesh.size() == 1:
            continue
        var = getattr(node.next_functions[i][0], "variable", None)
        # a Partial gradient is a plain input's (traced_ops.check_ranks breaks the graph where
        # a ShardTensor input's would be): others are left as they are
        if isinstance(var, DTensor) or not any(type(p) is Partial for p in g.placements):
            continue
        out = list(grad_inputs) if out is None else out
        if var is not None and grad_sum.take(node, g, g._spec.mesh, index=i):
            out[i] = None  # a parameter's: summed with the others after the backward
        else:
            out[i] = g.full_tensor()  # summed now (a plain tensor made before the graph)
    return None if out is None else tuple(out)


# -- the flatten format and the cache key (ShardTensor's hooks) ---------------------------
def unflatten(inner_tensors, flatten_spec, outer_size, outer_stride):
    """``ShardTensor.__tensor_unflatten__``: the spec kept per layout, as every op makes one
    (DTensor's: a new spec each); a stand-in (no layout) while dynamo traces."""
    layout, local = traced.layout_of(flatten_spec), inner_tensors["_local_tensor"]
    st = api.ShardTensor
    if (
        layout is not None
        and type(local) is torch.Tensor  # a compiled graph's output, a real block
        and tuple(outer_size) == layout.global_shape
    ):
        return st._wrap(local, inner_tensors["device_mesh"], layout, flatten_spec[3], outer_stride)
    d = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
    out = st(d._local_tensor, d._spec, requires_grad=d.requires_grad)
    out._layout = traced.layout_of(flatten_spec)
    return out


def stable_hash(st) -> str:
    """AOTAutograd's on-disk cache key: DTensor's (mesh, placements, global shape) is the
    same on every rank, so a rank would load a graph built for another rank's block; the
    key also holds the layout's sizes and this rank's block."""
    local, base = st._local_tensor, getattr(DTensor, "_stable_hash_for_caching", None)
    data = (
        base(st) if base is not None else repr(st._spec),
        repr(st._layout),
        p2p.my_coord(st.device_mesh),
        tuple(local.shape),
        local.stride(),
    )
    return hashlib.blake2b(repr(data).encode(), digest_size=16).hexdigest()
