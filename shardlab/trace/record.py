"""Recording: ``with shardlab.trace() as t:`` and ``with shardlab.trace.label(...)``.

Every message between ranks passes through the torch dispatcher as a c10d op
(``c10d.allreduce_``, ``c10d.send`` …, what ``torch.distributed`` calls) or a
functional collective (``_c10d_functional.all_gather_into_tensor`` …, what
DTensor calls). A ``TorchDispatchMode`` sees them all, including send/recv and
``batch_isend_irecv``. When no trace is active, nothing is installed: tracing
costs nothing.

Where the trace is opened decides what it records:

* on a rank (code run by ``ranks.run``, a ``%%ranks`` cell, a torchrun script):
  that rank's own events;
* in the kernel that owns a :class:`shardlab.Ranks` pool: every ``ranks.run``
  inside the block is traced on every rank, and the events come back here.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardlab.runtime import pool as _pool
from shardlab.trace.events import Event, Trace

__all__ = ["trace", "label", "current_label"]

_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("shardlab_trace_label", default="")

# op name -> (event kind, name of the payload argument, name of the peer argument)
_C10D = {
    "allreduce_": ("all_reduce", "tensors", None),
    "allreduce_coalesced_": ("all_reduce", "tensors", None),
    "allgather_": ("all_gather", "input_tensors", None),
    "_allgather_base_": ("all_gather", "input_tensor", None),
    "allgather_coalesced_": ("all_gather", "input_list", None),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs", None),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", None),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", None),
    "alltoall_": ("all_to_all", "input_tensors", None),
    "alltoall_base_": ("all_to_all", "input", None),
    "broadcast_": ("broadcast", "tensors", "root_rank"),
    "scatter_": ("scatter", "output_tensors", "root_rank"),  # the chunk each rank gets
    "gather_": ("gather", "input_tensors", "root_rank"),
    "reduce_": ("reduce", "tensors", "root_rank"),
    "send": ("send", "tensors", "dst"),
    "recv_": ("recv", "tensors", "src"),
    "recv_any_source_": ("recv", "tensors", None),
    "barrier": ("barrier", None, None),
    "monitored_barrier_": ("barrier", None, None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input", None),
    "all_reduce_": ("all_reduce", "input", None),
    "all_reduce_coalesced": ("all_reduce", "inputs", None),
    "all_gather_into_tensor": ("all_gather", "input", None),
    "all_gather_into_tensor_out": ("all_gather", "input", None),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", None),
    "reduce_scatter_tensor": ("reduce_scatter", "input", None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "broadcast": ("broadcast", "input", "src"),
    "broadcast_": ("broadcast", "input", "src"),
    "isend": ("send", "tensor", "dst"),
    "irecv": ("recv", "tensor", "src"),
}


@contextlib.contextmanager
def label(name: str, phase: str | None = None):
    """Name the cause of the messages sent inside the block.

    ``with label("conv2d.halo", "forward"):`` tags events ``"conv2d.halo forward"``.
    """
    token = _LABEL.set(f"{name} {phase}" if phase else name)
    try:
        yield
    finally:
        _LABEL.reset(token)


def current_label() -> str:
    return _LABEL.get()


def _group_ranks(pg) -> tuple[int, ...]:
    import torch.distributed as dist

    if isinstance(pg, str):  # functional collectives name their group
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(pg)
    elif not isinstance(pg, dist.ProcessGroup):  # c10d ops get a boxed TorchScript object
        pg = dist.ProcessGroup.unbox(pg)
    return tuple(dist.get_process_group_ranks(pg)), pg


class _Recorder:
    """Appends one :class:`Event` per communication op to ``self.events``."""

    def __init__(self, rank: int, mesh=None):
        self.rank = rank
        self.events: list[Event] = []
        self.mesh_groups: list[tuple[int, ...]] = []
        if mesh is not None:
            for d in range(mesh.ndim):
                import torch.distributed as dist

                self.mesh_groups.append(tuple(dist.get_process_group_ranks(mesh.get_group(d))))

    def _record(self, spec, args, kwargs, start, duration) -> None:
        """``spec``: the op's ``_spec`` (what it is, its API, argument names, name)."""
        import torch.distributed as dist

        (kind, payload_name, peer_name), api, names, op = spec
        bound = dict(zip(names, args))
        bound.update(kwargs)
        pg = bound.get("process_group", bound.get("group_name"))
        group, pg = _group_ranks(pg)
        tensors = [t for t in tree_leaves(bound.get(payload_name)) if isinstance(t, torch.Tensor)]
        peer = bound.get(peer_name) if peer_name else None
        if peer is not None and peer >= 0:
            peer = dist.get_global_rank(pg, peer)
        mesh_dim = next((d for d, g in enumerate(self.mesh_groups) if g == group), None)
        if mesh_dim is None and peer is not None:  # a message: the mesh dim it travels along
            mesh_dim = next((d for d, g in enumerate(self.mesh_groups) if peer in g), None)
        self.events.append(
            Event(
                rank=self.rank,
                seq=len(self.events),
                kind=kind,
                op=op,
                group=group,
                peer=peer,
                bytes=sum(t.numel() * t.element_size() for t in tensors),
                dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                shapes=tuple(tuple(t.shape) for t in tensors),
                label=_LABEL.get(),
                mesh_dim=mesh_dim,
                api=api,
                start=start,
                duration=duration,
            )
        )


# -- how a recorder sees the ops -------------------------------------------------------
#
# A dispatch mode: it sees every op, including those run inside another subclass's
# ``__torch_dispatch__`` (DTensor's own redistributions, ShardTensor's local ops), where
# the dispatch keys above the backend are already passed. (A Python kernel on just the
# communication ops, at the ADInplaceOrView key, costs nothing per op; tried, it missed
# the messages sent inside those handlers.) Per op: one Python call and a dict lookup.

_NOT_COMM = object()
_SPECS: dict = {}  # OpOverload -> (spec, api, argument names, name), or _NOT_COMM


def _spec(func):
    spec = _SPECS.get(func)
    if spec is None:
        ns = func.namespace
        table = _C10D if ns == "c10d" else _FUNCTIONAL if ns.startswith("_c10d_functional") else {}
        name = func._schema.name.split("::")[-1]
        found = table.get(name)
        spec = _SPECS[func] = (
            _NOT_COMM
            if found is None
            else (
                found,
                "c10d" if ns == "c10d" else "functional",
                [a.name for a in func._schema.arguments],
                f"{ns}.{name}",
            )
        )
    return spec


class _WatchMode(TorchDispatchMode):
    """Hands every communication op to its recorder; runs every other op as it is
    (``live``, a :class:`shardlab.trace.memory.LiveCount`, sees every op's outputs)."""

    def __init__(self, rec: _Recorder, live=None):
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.rec, self.live, self._dtensor = rec, live, DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:  # the subclasses among the arguments
            if t is not torch.Tensor and issubclass(t, self._dtensor):
                return NotImplemented  # let DTensor desugar into plain ops and collectives
        kwargs = kwargs or {}
        spec = _spec(func)
        if spec is _NOT_COMM:
            out = func(*args, **kwargs)
            if self.live is not None:
                self.live.see(func, args, kwargs, out)
            return out
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.rec._record(spec, args, kwargs, start, time.perf_counter() - start)
        return out


def _default_mesh():
    from shardlab.runtime import context

    return context._CONTEXT.mesh if context._CONTEXT is not None else None


def _traced_call(fn, args, kwargs, mesh):
    """On a rank: run ``fn`` under a trace; return its result and the events."""
    with trace(mesh=mesh) as t:
        result = fn(*args, **kwargs)
    return result, t.events


class _KernelHook:
    """Installed in the kernel: wraps every ``ranks._call`` in :func:`_traced_call`."""

    def __init__(self, t: Trace, mesh):
        self.trace = t
        self.mesh = mesh

    def wrap(self, fn, args, kwargs):
        return _traced_call, (fn, args, kwargs, self.mesh), {}

    def unwrap(self, results: list) -> list:
        for _, events in results:
            done = sum(e.rank == events[0].rank for e in self.trace.events) if events else 0
            for e in events:
                e.seq += done  # one sequence per rank across the calls of the block
            self.trace.events.extend(events)
        return [r for r, _ in results]


@contextlib.contextmanager
def trace(mesh: Any = None, *, live=None):
    """Record every collective and point-to-point message inside the block.

    Args:
        mesh: a DeviceMesh whose dims name the process groups (``Event.mesh_dim``);
            by default the rank's 1-D mesh.
        live: (on a rank) a :class:`shardlab.trace.memory.LiveCount` that counts live
            tensor bytes in the same pass (``shardlab.explain``'s memory column).

    Yields a :class:`Trace`, filled when the block exits (on a rank, also
    while it runs).
    """
    import torch.distributed as dist

    t = Trace()
    if dist.is_available() and dist.is_initialized():
        mesh = mesh if mesh is not None else _default_mesh()
        rec = _Recorder(dist.get_rank(), mesh)
        t.events = rec.events
        with _WatchMode(rec, live):
            yield t
        return
    hook = _KernelHook(t, mesh)
    token = _pool.CALL_HOOKS.set(_pool.CALL_HOOKS.get() + (hook,))
    try:
        yield t
    finally:
        _pool.CALL_HOOKS.reset(token)
