"""Activation checkpointing meets messages: every rank recomputes at the same point.

``torch.utils.checkpoint`` (non-reentrant) drops a block's saved tensors in forward and
re-runs the block when backward first *unpacks* one of them, stopping as soon as the
last of them is back (early stop). Both are rank-local facts: which autograd node
unpacks first, which op saved last. A rank whose shard is smaller than a halo builds a
slightly different graph than its neighbours (no overlapped convolution, an empty
output), so a block that sends messages re-sends them at another point of its backward
than its peers, and a message lands in the buffer of another one::

    rank 0  backward: conv2 halo back | recompute: conv1 halo, conv2 halo | conv1 ...
    rank 1  backward: recompute: conv1 halo, conv2 halo | conv2 halo back | conv1 ...
                                 ^ rank 0's gradient rows arrive as rank 1's halo rows
                                   (gloo: "Received data size doesn't match", every rank)

The order of shardlab's autograd Functions that send messages is the same on every rank
(every decision is taken from global layouts). :func:`fenced` ties the recomputation to
them:

1. forward, after the Function's messages: it saves one more (empty) tensor, so a
   recomputation never stops early before a Function that sends (it runs every message
   of the block on every rank);
2. backward, before its first message: it unpacks what it saved, so a pending
   recomputation of its block runs *now*, before the messages of its backward, on every
   rank alike.

Only where saved tensors are hooked (``saved_tensors_hooks``: a checkpointed block, its
recomputation, offloading) is the token saved: elsewhere a Function that keeps nothing can be
backpropagated twice, as torch's own ops that save nothing (an input distributed once, used in
two steps).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import get_gradient_edge

from shardlab.tensor import compiled_grads, traced

_HOOKED = torch._C._autograd._top_saved_tensors_default_hooks  # (ignore_is_tracing) -> hooks

__all__ = ["fenced", "kept"]


def fenced(cls):
    """Class decorator for a ``torch.autograd.Function`` that sends messages in its forward
    or backward (steps 1 and 2 above). Its backward reads what its forward saved with
    :func:`kept` (``ctx.saved_tensors`` may be unpacked only once under a checkpoint)."""
    forward, backward = cls.forward, cls.backward

    @functools.wraps(forward)
    def forward_then_token(ctx, *args, **kwargs):
        out = forward(ctx, *args, **kwargs)
        to_save = getattr(ctx, "to_save", None) or ()
        ctx.shardlab_token = _HOOKED(True) is not None  # saved tensors are hooked (checkpoint)
        ctx.shardlab_saved = bool(to_save)
        if ctx.shardlab_token:
            ctx.save_for_backward(*to_save, torch.empty(0))  # 1.
        elif to_save:
            ctx.save_for_backward(*to_save)
        return out

    @functools.wraps(backward)
    def unpack_then_backward(ctx, *grads):
        if ctx.shardlab_token:
            ctx.shardlab_kept = ctx.saved_tensors[:-1]  # 2. a pending recomputation runs here
        else:  # (read once freed, even an empty one raises: read only what was saved)
            ctx.shardlab_kept = ctx.saved_tensors if ctx.shardlab_saved else ()
        return backward(ctx, *grads)

    cls.forward = staticmethod(forward_then_token)
    cls.backward = staticmethod(unpack_then_backward)
    return cls


def kept(ctx) -> tuple:
    """What the forward of a :func:`fenced` Function saved (without the fence's token)."""
    return ctx.shardlab_kept


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """``torch.autograd.backward`` for ShardTensor roots, with ``__torch_function__`` left
    on while the graph runs.

    torch calls a subclass's ``Tensor.backward`` with ``__torch_function__`` off
    (``_disabled_torch_function_impl``), and the engine keeps that state: a checkpointed
    block recomputed during ``loss.backward()`` would then run without the lifting of
    plain parameters next to ShardTensors that its forward had, and save other tensors.
    Handing the engine the roots' gradient edges (not tensors) runs the same backward
    with the state of the caller."""
    _no_compiled_autograd()
    edges, grads, leaves = _roots(tensors, grad_tensors, "tensors")
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        inputs = _edges(inputs)
    torch.autograd.backward(edges, grads, retain_graph, create_graph, inputs=inputs)
    if leaves:  # something was compiled: see there
        compiled_grads.plain_gradients(leaves)


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    materialize_grads=False,
):
    """``torch.autograd.grad`` with ShardTensors among ``outputs`` or ``inputs``, as
    :func:`backward` runs it: on gradient edges, ``__torch_function__`` left on. Passed on
    as tensors, the plain parameters among ``inputs`` (a conv's weight) would be lifted
    next to the ShardTensors, as in any call: new tensors, "not used in the graph"."""
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, "
            "but got: allow_unused=False."
        )
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    edges, grads, _ = _roots(outputs, grad_outputs, "outputs", is_grads_batched)
    result = torch.autograd.grad(
        edges,
        _edges(inputs),
        grads,
        retain_graph=create_graph if retain_graph is None else retain_graph,
        create_graph=create_graph,
        only_inputs=only_inputs,
        allow_unused=True if materialize_grads else allow_unused,
        is_grads_batched=is_grads_batched,
    )
    if materialize_grads:  # (torch refuses it for edges: done here, for the tensors)
        if any(r is None and not isinstance(t, torch.Tensor) for r, t in zip(result, inputs)):
            raise RuntimeError(
                "materialize_grads cannot be used when the given input is a GradientEdge"
            )
        result = tuple(
            torch.zeros_like(t, requires_grad=create_graph) if r is None else r
            for r, t in zip(result, inputs)
        )
    return result


def _edges(tensors) -> list:
    return [get_gradient_edge(t) if isinstance(t, torch.Tensor) else t for t in tensors]


def _roots(tensors, grad_tensors, name, batched=False) -> tuple[list, list, list]:
    """The gradient edges and gradients of a backward's roots, torch's checks on them;
    when something was compiled and a root is a ShardTensor, the extra roots of
    :func:`compiled_grads.zero_gradients` and the plain leaves it found (else none)."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,) * len(tensors) if grad_tensors is None else (grad_tensors,)
    grad_tensors = tuple(grad_tensors)
    if len(grad_tensors) != len(tensors):
        raise RuntimeError(f"{name} has {len(tensors)} tensors but {len(grad_tensors)} gradients")
    edges, grads = [], []
    for i, (t, g) in enumerate(zip(tensors, grad_tensors)):
        if not t.requires_grad:
            raise RuntimeError(
                f"element {i} of {name} does not require grad and does not have a grad_fn"
            )
        if g is None:
            if t.numel() != 1 or batched:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(t)
        edges.append(get_gradient_edge(t))
        grads.append(g)
    mesh = next((t.device_mesh for t in tensors if hasattr(t, "_layout")), None)
    leaves = []
    if mesh is not None and traced.COMPILED:  # torch.compile was used: see there
        more, zeros, leaves = compiled_grads.zero_gradients(tensors, mesh)
        edges, grads = edges + more, grads + zeros
    return edges, grads, leaves


def _no_compiled_autograd() -> None:
    """Compiled autograd (torch's option to trace the whole backward) cannot trace one
    through ShardTensors: its capture runs their ops on symbolic sizes, which a layout
    cannot hold. A clear error first, on every rank (a setting, never a shape)."""
    from shardlab import _compat

    if _compat.compiled_autograd_on():
        raise NotImplementedError(_compat.COMPILED_AUTOGRAD)


def tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward`` through :func:`backward`."""
    backward(self, gradient, retain_graph, create_graph, inputs)
