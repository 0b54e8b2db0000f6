"""``loss.backward()``, ``torch.autograd.backward`` and ``torch.autograd.grad`` from a
ShardTensor: the same backward, with ``__torch_function__`` left on while the graph runs
(a checkpointed block recomputed in it lifts its plain parameters as its forward did;
:mod:`shardlab.comm.recompute` keeps the messages of the recomputation in order), and
the fixes around compiled code (:mod:`.compiled_grads`).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from shardlab import _compat
from shardlab.comm import traced
from shardlab.tensor import compiled_grads

__all__ = ["backward", "grad", "tensor_backward"]


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
    if _compat.compiled_autograd_on():
        raise NotImplementedError(_compat.COMPILED_AUTOGRAD)


def tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward`` through :func:`backward`."""
    backward(self, gradient, retain_graph, create_graph, inputs)
