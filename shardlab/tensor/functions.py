"""The autograd Functions between a rank's block and its ShardTensor: ``from_local`` and
``to_local`` (a view each way; the gradient laid out as the forward's), ``redistribute``
(its backward moves the gradient back to the source layout); :func:`records`: whether
autograd records a call at all (the handlers skip their Functions when it does not).

Double backward (``create_graph=True``: a gradient penalty): these Functions are linear,
and their backward is itself differentiable when the gradient has a history. The sharded
ops' Functions (halos, rings, norms, cross-entropy) compute their backward on blocks and
are marked :func:`~shardlab.comm._once.first_order`: differentiating their backward
raises a clear error, never a silently missing term."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlab.comm import p2p
from shardlab.comm._once import passes_no_gradient
from shardlab.comm.recompute import fenced
from shardlab.layout import ShardLayout
from shardlab.layout.dtensor import layout_of_dtensor
from shardlab.tensor import api, create

__all__ = ["records"]


def records(values) -> bool:
    """Grad mode is on and a tensor among ``values`` requires grad (a ShardTensor's flag
    read without its ``__torch_function__``)."""
    if not torch.is_grad_enabled():
        return False
    with torch._C.DisableTorchFunctionSubclass():
        for v in values:
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return True
    return False


def _graph(grad) -> bool:
    """A double backward is being recorded through ``grad`` (it has a history)."""
    return torch.is_grad_enabled() and records((grad,))


@passes_no_gradient
class FromLocalAlone(torch.autograd.Function):
    """:class:`FromLocal` on a mesh of one rank: no message can be sent, so no fence."""

    @staticmethod
    def forward(ctx, local, mesh, layout, stride):
        ctx.mesh, ctx.sharding = mesh, layout
        return api.ShardTensor._wrap(local.view_as(local), mesh, layout, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        return local_of(grad, gradient_layout(ctx.sharding), ctx.mesh), None, None, None


@fenced
class FromLocal(FromLocalAlone):
    pass


@passes_no_gradient
class ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, grad_layout):
        ctx.mesh, ctx.sharding = st.device_mesh, grad_layout
        return st._local_tensor.view_as(st._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        if _graph(grad):  # differentiable again (create_graph=True)
            return create.from_layout(grad, ctx.mesh, ctx.sharding), None
        return api.ShardTensor._wrap(grad, ctx.mesh, ctx.sharding), None


@fenced
@passes_no_gradient
class Redistribute(torch.autograd.Function):
    """``Redistribute.apply(st, layout, cause="redistribute")``: differentiable; ``cause``
    labels the messages (its backward's: "redistribute backward")."""

    @staticmethod
    def forward(ctx, st, dst, cause="redistribute"):
        ctx.mesh, ctx.src = st.device_mesh, st._layout
        local = p2p.redistribute_local(st._local_tensor, st._layout, dst, st.device_mesh, cause)
        return api.ShardTensor._wrap(local, st.device_mesh, dst)

    @staticmethod
    def backward(ctx, grad):
        target = gradient_layout(ctx.src)
        if _graph(grad) and isinstance(grad, api.ShardTensor):  # differentiable again
            return Redistribute.apply(grad, target, "redistribute backward"), None, None
        return (
            api.ShardTensor._wrap(local_block(grad, target, ctx.mesh), ctx.mesh, target),
            None,
            None,
        )


def local_of(grad, layout: ShardLayout, mesh) -> torch.Tensor:
    """:func:`local_block`, differentiable when ``grad`` has a history (a double backward
    is being recorded): the moves and the block taken by autograd Functions."""
    if _graph(grad) and isinstance(grad, api.ShardTensor):
        if grad._layout != layout:
            grad = Redistribute.apply(grad, layout, "redistribute backward")
        return ToLocal.apply(grad, gradient_layout(layout))
    return local_block(grad, layout, mesh)


def local_block(grad, layout: ShardLayout, mesh) -> torch.Tensor:
    """This rank's block of ``grad`` in ``layout`` (redistributing if needed)."""
    if isinstance(grad, api.ShardTensor):
        return p2p.redistribute_local(
            grad._local_tensor, grad._layout, layout, mesh, cause="redistribute backward"
        )
    if isinstance(grad, DTensor):  # e.g. from DTensor's own ops: chunk sizes
        return p2p.redistribute_local(
            grad._local_tensor,
            layout_of_dtensor(grad),
            layout,
            mesh,
            cause="redistribute backward",
        )
    return grad


def dtensor_grad_local(grad, mesh, layout: ShardLayout, dims=None):
    """This rank's block of the gradient of a plain DTensor read as ``layout`` on ``mesh``
    (its own mesh, or a mesh it is a sub-mesh of: ``dims``, the mesh dims it lives on),
    and the mesh dims whose sum stays pending: those of ``dims`` where the DTensor is
    ``Replicate`` and the gradient a ``Partial()`` sum (a parameter used on this rank's
    rows), as torch's own backward leaves it (reduced when torch reduces it:
    ``full_tensor()``, the optimizer's step, FSDP's reduce-scatter). Sends nothing for
    those; sums the other Partial mesh dims; a ``Shard`` the gradient lacks moves back."""
    target = gradient_layout(layout)
    pending = ()
    if isinstance(grad, api.ShardTensor) and grad._layout is not None:
        pending = tuple(
            m
            for m, (p, q) in enumerate(zip(grad._layout.placements, layout.placements))
            if type(p) is Partial
            and p.reduce_op == "sum"
            and type(q) is Replicate
            and (dims is None or m in dims)
        )
        if pending:
            places = (Partial() if m in pending else p for m, p in enumerate(target.placements))
            target = target.replace(placements=tuple(places))
    return local_block(grad, target, mesh), pending


def dtensor_grad(grad, mesh, layout: ShardLayout, on, placements, shape, stride, dims=None):
    """The gradient of a plain DTensor (``placements`` on its mesh ``on``, read as ``layout``
    on ``mesh``: ``on`` itself, or a mesh it is the sub-mesh ``dims`` of) used as a
    ShardTensor, as torch would hand it back: a DTensor of the same placements (Partial
    read as Replicate), a pending sum kept ``Partial()`` (:func:`dtensor_grad_local`)."""
    local, pending = dtensor_grad_local(grad, mesh, layout, dims)
    dims = range(len(placements)) if dims is None else dims
    places = [
        Partial() if d in pending else Replicate() if isinstance(p, Partial) else p
        for d, p in zip(dims, placements)
    ]
    return DTensor.from_local(local, on, places, run_check=False, shape=shape, stride=stride)


def gradient_layout(layout: ShardLayout) -> ShardLayout:
    """Gradients of a Partial value are Replicate (d sum / d part = 1 on every rank)."""
    places = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    return layout.replace(placements=places)
