"""Recording: ``with shardlab.trace() as t:`` and ``with shardlab.trace.label(...)``.

Every message between ranks goes through a ``ProcessGroup`` method (``allreduce``,
``send`` …: what ``torch.distributed`` calls, ``batch_isend_irecv`` included) or a
functional collective (``_c10d_functional.all_gather_into_tensor`` …, what DTensor
calls). While a trace is open, those methods are wrapped and those ops get a Python
kernel (below: how); no other op pays anything. When no trace is open, nothing is
installed: tracing costs nothing.
A trace sees the messages of every thread of its process (autograd's, too) while
it is open.

Where the trace is opened decides what it records:

* on a rank (code run by ``ranks.run``, a ``%%ranks`` cell, a torchrun script):
  that rank's own events;
* in the kernel that owns a :class:`shardlab.Ranks` pool: every ``ranks.run``
  inside the block is traced on every rank, and the events come back here.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from shardlab.runtime import context
from shardlab.runtime import pool as _pool
from shardlab.trace.events import Event, Trace

__all__ = ["trace", "label", "current_label"]

_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("shardlab_trace_label", default="")

# ProcessGroup method -> (event kind, position of the payload, ("peer" | "root",
# position) or None); the methods' overloads keep these positions
_METHODS = {
    "allreduce": ("all_reduce", 0, None),
    "allreduce_coalesced": ("all_reduce", 0, None),
    "allgather": ("all_gather", 1, None),
    "_allgather_base": ("all_gather", 1, None),
    "allgather_coalesced": ("all_gather", 1, None),
    "allgather_into_tensor_coalesced": ("all_gather", 1, None),
    "reduce_scatter": ("reduce_scatter", 1, None),
    "_reduce_scatter_base": ("reduce_scatter", 1, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1, None),
    "all_gather_single": ("all_gather", 1, None),  # 2.13+: the new names
    "all_gather_single_coalesced": ("all_gather", 1, None),
    "reduce_scatter_single": ("reduce_scatter", 1, None),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1, None),
    "all_to_all_single": ("all_to_all", 1, None),
    "gather_single": ("gather", 1, ("root", None)),  # 2.15+
    "gather_into_tensor": ("gather", 1, ("root", None)),
    "alltoall": ("all_to_all", 1, None),
    "alltoall_base": ("all_to_all", 1, None),
    "broadcast": ("broadcast", 0, ("root", 1)),
    "scatter": ("scatter", 0, ("root", 2)),  # the chunk each rank gets
    "gather": ("gather", 1, ("root", 2)),
    "reduce": ("reduce", 0, ("root", 1)),
    "send": ("send", 0, ("peer", 1)),
    "recv": ("recv", 0, ("peer", 1)),
    "recv_anysource": ("recv", 0, None),
    "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None),
}
_PAYLOAD_KW = {  # the payload's keyword names, by position
    0: ("tensors", "tensor", "output_tensors", "output_tensor"),
    1: ("input_tensors", "input_tensor", "input", "inputs", "input_list", "inputTensor"),
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

    Args:
        name: what sends them (``"conv2d.halo"``).
        phase: appended after a space (``"forward"``), or None.

    Communicates nothing; events recorded by :func:`trace` inside the block carry the
    label (``Event.label``), and blocks nest (the innermost wins).

    Example::

        with shardlab.trace.label("my_op", "forward"):
            dist.all_reduce(x)          # traced as label "my_op forward"
    """
    token = _LABEL.set(f"{name} {phase}" if phase else name)
    try:
        yield
    finally:
        _LABEL.reset(token)


def current_label() -> str:
    """The label the innermost :func:`label` block sets here (``""`` outside any)."""
    return _LABEL.get()


def _named_group(name: str):
    """(ranks, group) of the process group a functional collective names."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(name)
    return tuple(dist.get_process_group_ranks(pg)), pg


class _Recorder:
    """Appends one :class:`Event` per communication op to ``self.events``."""

    def __init__(self, rank: int, mesh=None):
        self.rank = rank
        self.events: list[Event] = []
        self.groups: dict = {}  # id(ProcessGroup) -> (its ranks, the group): asked once
        self.mesh_groups: list[tuple[int, ...]] = []
        if mesh is not None:
            for d in range(mesh.ndim):
                import torch.distributed as dist

                self.mesh_groups.append(tuple(dist.get_process_group_ranks(mesh.get_group(d))))

    def _record(self, spec, args, kwargs, start, duration) -> None:
        """A functional collective; ``spec``: (what it is, its API, argument names, name)."""
        (kind, payload_name, peer_name), api, names, op = spec
        bound = dict(zip(names, args))
        bound.update(kwargs)
        group, pg = _named_group(bound.get("group_name"))
        peer = bound.get(peer_name) if peer_name else None
        self._event(kind, bound.get(payload_name), group, pg, peer, op, api, start, duration)

    def _record_method(self, name, pg, args, kwargs, start, duration) -> None:
        """A ``ProcessGroup`` method's call (:data:`_METHODS`)."""
        kind, at, peer_at = _METHODS[name]
        payload = None
        if at is not None:
            payload = (
                args[at]
                if len(args) > at
                else next((kwargs[k] for k in _PAYLOAD_KW[at] if k in kwargs), None)
            )
        peer = None
        if peer_at is not None:
            what, i = peer_at
            peer = next((a.rootRank for a in (*args, *kwargs.values()) if hasattr(a, "rootRank")),
                        None)  # fmt: skip
            if peer is None and i is not None:
                peer = args[i] if len(args) > i and isinstance(args[i], int) else None
            if peer is None:
                keys = ("root",) if what == "root" else ("dstRank", "srcRank")
                peer = next((kwargs[k] for k in keys if k in kwargs), None)
        known = self.groups.get(id(pg))
        if known is None:
            import torch.distributed as dist

            known = self.groups[id(pg)] = (tuple(dist.get_process_group_ranks(pg)), pg)
        self._event(kind, payload, known[0], pg, peer, f"c10d.{name}", "c10d", start, duration)

    def _event(self, kind, payload, group, pg, peer, op, api, start, duration) -> None:
        if isinstance(payload, torch.Tensor):
            tensors = [payload]
        elif isinstance(payload, list) and all(isinstance(t, torch.Tensor) for t in payload):
            tensors = payload  # c10d's lists of tensors
        else:  # nested lists (allgather's outputs), or None
            tensors = [t for t in tree_leaves(payload) if isinstance(t, torch.Tensor)]
        if tensors and tensors[0].device.type == "meta":
            return  # a fake run (FakeTensorMode, tracing for torch.compile): no message
        if peer is not None and peer >= 0:
            peer = group[peer]  # the group's ranks, in group-rank order
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
# While a trace is open in a process:
#
# * every ``ProcessGroup`` method that communicates is wrapped (the class attribute
#   replaced, restored when the last trace closes): ``torch.distributed``'s functions,
#   ``batch_isend_irecv`` included, call them; a wrapper costs a Python call, and no
#   argument crosses into the dispatcher's boxed values (a Python kernel on the c10d
#   ops, tried before, spent ~0.2 ms converting each call's ProcessGroup and Work);
# * each functional collective (``_c10d_functional``: DTensor's) gets a Python kernel at
#   the BackendSelect dispatch key (``torch.library``). That key sits below the autograd
#   keys and the Python key of subclasses and dispatch modes, so the kernel also sees
#   the messages sent inside DTensor's and ShardTensor's ``__torch_dispatch__`` (a
#   redistribution), in backward and in inference mode. The ProcessGroup methods that a
#   functional collective runs in C++ are not recorded again.
#
# A dispatch mode, used at first, cost a Python call on every op of a step.

_BACKEND_SELECT = torch._C.DispatchKey.BackendSelect
_OPEN: list[_Recorder] = []  # the traces open in this process (any thread), oldest first
_LIBS: list = []  # the torch.library registrations while any trace is open
_INSTALL = threading.Lock()
_BUSY = threading.local()  # inside a recorded op: its inner ops are not recorded again


def _comm_ops():
    """(namespace, qualified name, OpOverload, spec) of every functional collective this
    torch has; spec: (what it is, its API, its argument names, its name)."""
    tables = [
        (ns, _FUNCTIONAL, "functional") for ns in ("_c10d_functional", "_c10d_functional_autograd")
    ]
    for ns, table, api in tables:
        for name, what in table.items():
            try:
                packet = getattr(getattr(torch.ops, ns), name)
            except (AttributeError, RuntimeError):
                continue  # not in this torch version
            for overload in packet.overloads():
                op = getattr(packet, overload)
                qual = name if overload == "default" else f"{name}.{overload}"
                names = [a.name for a in op._schema.arguments]
                yield ns, qual, op, (what, api, names, f"{ns}.{name}")


def _kernel(op, spec):
    """``op``'s Python kernel: run the op below BackendSelect; record it, timed."""

    def kernel(keyset, *args, **kwargs):
        below = keyset.remove(_BACKEND_SELECT)
        if not _OPEN or getattr(_BUSY, "on", False):
            return op.redispatch(below, *args, **kwargs)
        _BUSY.on = True
        try:
            start = time.perf_counter()
            out = op.redispatch(below, *args, **kwargs)
            took = time.perf_counter() - start
        finally:
            _BUSY.on = False
        for rec in list(_OPEN):
            rec._record(spec, args, kwargs, start, took)
        return out

    return kernel


def _method(name, call):
    """The wrapper of ``ProcessGroup.<name>``: call it; record it, timed."""

    def method(self, *args, **kwargs):
        if not _OPEN or getattr(_BUSY, "on", False):
            return call(self, *args, **kwargs)
        _BUSY.on = True
        try:
            start = time.perf_counter()
            out = call(self, *args, **kwargs)
            took = time.perf_counter() - start
        finally:
            _BUSY.on = False
        for rec in list(_OPEN):
            rec._record_method(name, self, args, kwargs, start, took)
        return out

    method.__name__ = name
    return method


_KERNELS: list = []  # (namespace, qualified name, kernel), made once per process
_SAVED: dict = {}  # ProcessGroup attribute -> its own descriptor, while wrapped


def _open(rec: _Recorder) -> None:
    import torch.distributed as dist
    from torch.library import Library

    with _INSTALL:
        if not _KERNELS:
            for ns, qual, op, spec in _comm_ops():
                _KERNELS.append((ns, qual, _kernel(op, spec)))
        if not _OPEN:
            libs = {}
            for ns, qual, kernel in _KERNELS:
                lib = libs.get(ns) or libs.setdefault(ns, Library(ns, "IMPL"))
                lib.impl(qual, kernel, "BackendSelect", with_keyset=True)
            _LIBS.extend(libs.values())
            pg = dist.ProcessGroup
            for name in _METHODS:
                if name in vars(pg):  # (the descriptor; getattr gives the callable)
                    _SAVED[name] = vars(pg)[name]
                    setattr(pg, name, _method(name, getattr(pg, name)))
        _OPEN.append(rec)


def _close(rec: _Recorder) -> None:
    import torch.distributed as dist

    with _INSTALL:
        _OPEN.remove(rec)
        if not _OPEN:
            for lib in _LIBS:
                lib._destroy()
            _LIBS.clear()
            for name, descriptor in _SAVED.items():
                setattr(dist.ProcessGroup, name, descriptor)
            _SAVED.clear()


def installed() -> bool:
    """Whether the tracer's kernels and wrappers are in place (a trace is open here)."""
    return bool(_LIBS) or bool(_SAVED)


def _default_mesh():
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
def trace(mesh: Any = None):
    """Record every collective and point-to-point message inside the block.

    Opened on a rank (``ranks.run``, a ``%%ranks`` cell, a torchrun script), it records
    that rank's events; opened in the kernel that owns a :class:`shardlab.Ranks` pool,
    every ``ranks.run`` inside the block is traced on every rank and the events come back.
    ``shardlab.trace()`` is this function (the module is callable).

    Args:
        mesh: a DeviceMesh whose dims name the process groups (``Event.mesh_dim``);
            by default the rank's 1-D mesh.

    Yields a :class:`Trace`, filled when the block exits (on a rank, also
    while it runs).

    Communicates:
        Nothing of its own on a rank; from the kernel, each rank's events travel back
        with the results of ``ranks.run``. While no trace is open nothing is installed.

    Example::

        def body():
            x = torch.ones(4)
            with shardlab.trace() as t:
                dist.all_reduce(x)
            return t.counts(), t.bytes()

        ranks.run(body)          # [({'all_reduce': 1}, 16), ...] on every rank
    """
    import torch.distributed as dist

    t = Trace()
    if dist.is_available() and dist.is_initialized():
        mesh = mesh if mesh is not None else _default_mesh()
        rec = _Recorder(dist.get_rank(), mesh)
        t.events = rec.events
        _open(rec)
        try:
            yield t
        finally:
            _close(rec)
        return
    hook = _KernelHook(t, mesh)
    token = _pool.CALL_HOOKS.set(_pool.CALL_HOOKS.get() + (hook,))
    try:
        yield t
    finally:
        _pool.CALL_HOOKS.reset(token)
