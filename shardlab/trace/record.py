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
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from shardlab.runtime import context
from shardlab.runtime import pool as _pool
from shardlab.trace import hooks
from shardlab.trace.events import Event, Trace

__all__ = ["trace", "label", "current_label"]

_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("shardlab_trace_label", default="")


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

    def _record(self, spec, args, kwargs, start, duration) -> Event | None:
        """A functional collective; ``spec``: (what it is, its API, argument names, name)."""
        (kind, payload_name, peer_name), api, names, op = spec
        bound = dict(zip(names, args))
        bound.update(kwargs)
        group, pg = _named_group(bound.get("group_name"))
        peer = bound.get(peer_name) if peer_name else None
        splits = bound.get("input_split_sizes")
        return self._event(kind, bound.get(payload_name), group, pg, peer, op, api, start,
                           duration, splits)  # fmt: skip

    def _record_method(self, name, pg, args, kwargs, start, duration) -> Event | None:
        """A ``ProcessGroup`` method's call (:data:`~.hooks.METHODS`)."""
        kind, at, peer_at = hooks.METHODS[name]
        payload = None
        if at is not None:
            payload = (
                args[at]
                if len(args) > at
                else next((kwargs[k] for k in hooks.PAYLOAD_KW[at] if k in kwargs), None)
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
        splits = None  # all_to_all_single(output, input, output_splits, input_splits, ...)
        if kind == "all_to_all" and len(args) > 3 and not isinstance(payload, list):
            splits = args[3]
        return self._event(
            kind, payload, known[0], pg, peer, f"c10d.{name}", "c10d", start, duration, splits
        )

    def _event(self, kind, payload, group, pg, peer, op, api, start, duration,
               splits=None) -> Event | None:  # fmt: skip
        """Append the event (returned; None for a fake run, which sends nothing)."""
        if isinstance(payload, torch.Tensor):
            tensors = [payload]
        elif isinstance(payload, list) and all(isinstance(t, torch.Tensor) for t in payload):
            tensors = payload  # c10d's lists of tensors
        else:  # nested lists (allgather's outputs), or None
            tensors = [t for t in tree_leaves(payload) if isinstance(t, torch.Tensor)]
        if tensors and tensors[0].device.type == "meta":
            return None  # a fake run (FakeTensorMode, tracing for torch.compile): no message
        if peer is not None and peer >= 0:
            peer = group[peer]  # the group's ranks, in group-rank order
        mesh_dim = next((d for d, g in enumerate(self.mesh_groups) if g == group), None)
        if mesh_dim is None and peer is not None:  # a message: the mesh dim it travels along
            mesh_dim = next((d for d, g in enumerate(self.mesh_groups) if peer in g), None)
        event = Event(
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
            splits=_split_bytes(tensors, splits, len(group)) if kind == "all_to_all" else None,
        )
        self.events.append(event)
        return event


def _split_bytes(tensors, splits, ranks: int) -> tuple[int, ...] | None:
    """The bytes an ``all_to_all`` hands each of the group's ``ranks``: one tensor per rank
    (c10d's list form), or one tensor cut along dim 0 in ``splits`` rows (even if empty)."""
    if len(tensors) == ranks and len(tensors) > 1:
        return tuple(t.numel() * t.element_size() for t in tensors)
    if len(tensors) != 1:
        return None
    (t,) = tensors
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() * t.element_size() // rows if rows else 0
    splits = [int(n) for n in splits or []] or [rows // ranks] * ranks
    return tuple(n * row for n in splits)


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
        hooks.open_recorder(rec)
        try:
            yield t
        finally:
            hooks.close_recorder(rec)
        return
    hook = _KernelHook(t, mesh)
    token = _pool.CALL_HOOKS.set(_pool.CALL_HOOKS.get() + (hook,))
    try:
        yield t
    finally:
        _pool.CALL_HOOKS.reset(token)
