"""Gradients of plain parameters used next to ShardTensors, summed once per backward.

A parameter ``W`` that every rank holds alike, used with a ShardTensor cut over the
ranks, gets a *partial* gradient on each rank (its own rows' share); the full gradient
is their sum over the cut mesh dims. Summed as each arrives, that is one all-reduce per
use (a Llama layer: seven linears and two norms, ~2 ms each on gloo here). Kept until
the backward ends, they are summed together, as DDP buckets its gradients::

    backward   ... lift(W1): keep P1 ...  lift(W2): keep P2 ...  lift(W1): P1 += ...
    the end    1. flat = cat(P1, P2)                 (every rank, the same order)
    (engine's  2. all_reduce(flat) per cut mesh dim  (one message per mesh dim, dtype)
    callback)  3. W.grad += its slice                (or W.grad = it: the full gradient)

Kept only where nothing reads ``W``'s gradient before the end: ``W`` is a leaf whose
``AccumulateGrad`` runs in this backward (not ``torch.autograd.grad``, not ``inputs=``
that leaves it out), with no hooks, no double backward (``create_graph``), not inside
DDP's forward (its reducer reads ``.grad`` as it is accumulated), nor in the forward of a
module under FSDP's ``fully_shard`` (it reads ``.grad`` as the module's backward ends), nor
compiled autograd; on every rank alike (the rule reads nothing that differs between them).
Otherwise the gradient is summed at once, as before, by the op. Code of one's own that
reads a parameter's ``.grad`` *during* the backward (not through a hook on it) would
see it without this sum: torch itself does not promise when it is accumulated.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.tensor import Partial, Replicate
from torch.nn.parallel import DistributedDataParallel

from shardlab.comm import collectives
from shardlab.tensor import api
from shardlab.trace import label

__all__ = ["deferrable_input", "keep", "take"]

LABEL = "params backward"  # the tracer's label of the one all-reduce
_PENDING: dict = {}  # graph task id -> [(order, W, partial block, process groups)]
_LOCK = threading.Lock()  # device threads run backward nodes


def deferrable_input(tensor) -> bool:
    """Forward-time part of the rule: ``tensor`` is a leaf (a parameter), and neither a
    DDP forward nor a ``fully_shard`` / ``replicate`` module's is running (FSDP reads its
    unsharded parameters' ``.grad`` as each module's backward ends)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_leaf:
        return False
    if getattr(DistributedDataParallel, "_active_ddp_module", None) is not None:
        return False
    for ref in list(_module_state_mapping.values()):  # empty without FSDP
        state = ref() if isinstance(ref, weakref.ref) else ref
        step = getattr(state, "_training_state", None)  # (FSDP's; replicate: none)
        if state is not None and getattr(step, "name", None) != "IDLE":
            return False
    return True


def take(ctx, grad, mesh, index: int = 0) -> bool:
    """In a lift's backward (or a compiled one's, for its tensor input number ``index``):
    keep ``grad`` (a ShardTensor, Partial sum over
    some mesh dims, Replicate over the rest) for the sum at the end of this backward, and
    say so; False (nothing kept) where the rule above does not hold."""
    if type(grad) is not api.ShardTensor or grad._layout is None:
        return False
    dims = []
    for m, p in enumerate(grad._layout.placements):
        if type(p) is Partial and p.reduce_op == "sum":
            dims.append(m)
        elif not isinstance(p, Replicate):
            return False
    # one mesh dim after the other, as a redistribute sums them (each message then names
    # its mesh axis in a trace)
    groups = [mesh.get_group(m) for m in dims if mesh.shape[m] > 1]
    return bool(groups) and keep(ctx, index, grad._local_tensor, groups)


def keep(ctx, index: int, local: torch.Tensor, groups) -> bool:
    """In a backward: keep ``local``, this rank's share of the gradient of the Function's
    tensor input number ``index`` (its sum over the ranks of ``groups``, one group after
    the other, is the gradient), for the sum at the end of this backward, and say so;
    False (nothing kept: the caller sums it now) where the module docstring's rule fails."""
    if torch.is_grad_enabled() or not groups or _in_compiled_autograd():
        return False
    node = ctx.next_functions[index][0]
    if type(node).__name__ != "AccumulateGrad":
        return False
    w = node.variable
    if (
        type(local) is not torch.Tensor
        or w._backward_hooks
        or getattr(w, "_post_accumulate_grad_hooks", None)
        or type(w.grad) not in (type(None), torch.Tensor)
        or local.shape != w.shape
        or local.dtype != w.dtype
        or local.device != w.device
        or local.layout != torch.strided
        or not _accumulates(node)
    ):
        return False
    task = torch._C._current_graph_task_id()
    with _LOCK:
        first = task not in _PENDING
        if first and len(_PENDING) >= 32:  # a backward that raised never reaches its
            del _PENDING[next(iter(_PENDING))]  # callback: forget the oldest such one
        order = (ctx._sequence_nr(), index)
        _PENDING.setdefault(task, []).append((order, w, local, list(groups)))
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _sum(task))
    return True


def _accumulates(node) -> bool:
    """This backward will run ``node`` (a parameter's ``AccumulateGrad``)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad: it captures gradients, never accumulates
        return False


def _in_compiled_autograd() -> bool:
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # (not imported:
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))  # not on)


@torch.no_grad()
def _sum(task) -> None:
    """The engine's final callback: steps 1-3 of the module docstring."""
    with _LOCK:
        kept = _PENDING.pop(task, [])
    kept.sort(key=lambda k: k[0])  # forward order: the same on every rank
    buckets: dict = {}  # (groups, dtype, device) -> {id(W): [W, summed part, groups]}
    for _, w, local, groups in kept:
        key = (tuple(id(g) for g in groups), local.dtype, local.device)
        bucket = buckets.setdefault(key, {})
        if id(w) in bucket:
            bucket[id(w)][1] = bucket[id(w)][1] + local
        else:
            bucket[id(w)] = [w, local, groups]
    for bucket in buckets.values():
        entries = list(bucket.values())
        flat = torch.cat([p.reshape(-1) for _, p, _ in entries])  # 1.
        with label(LABEL):
            for group in entries[0][2]:  # 2.
                collectives.all_reduce_(flat, dist.ReduceOp.SUM, group)
        offset = 0
        for w, p, _ in entries:  # 3.
            full = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            if w.grad is None:
                w.grad = torch.empty_like(w).copy_(full)
            else:
                w.grad.add_(full)
