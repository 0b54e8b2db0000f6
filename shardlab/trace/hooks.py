"""How a recorder sees the ops: the ``ProcessGroup`` methods it wraps and the functional
collectives it gives a kernel, installed while a trace is open (:mod:`.record`)."""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["FUNCTIONAL", "METHODS", "PAYLOAD_KW", "close_recorder", "installed"]
__all__ += ["open_recorder"]

# ProcessGroup method -> (event kind, position of the payload, ("peer" | "root",
# position) or None); the methods' overloads keep these positions
METHODS = {
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
PAYLOAD_KW = {  # the payload's keyword names, by position
    0: ("tensors", "tensor", "output_tensors", "output_tensor"),
    1: ("input_tensors", "input_tensor", "input", "inputs", "input_list", "inputTensor"),
}
FUNCTIONAL = {
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
_OPEN: list = []  # the traces open in this process (any thread), oldest first
_LIBS: list = []  # the torch.library registrations while any trace is open
_INSTALL = threading.Lock()
_BUSY = threading.local()  # inside a recorded op: its inner ops are not recorded again
# id(Work or output tensor) -> (it, its events), until it is waited for (Event.end)
_PENDING: dict = {}


def _comm_ops():
    """(namespace, qualified name, OpOverload, spec) of every functional collective this
    torch has; spec: (what it is, its API, its argument names, its name)."""
    tables = [
        (ns, FUNCTIONAL, "functional") for ns in ("_c10d_functional", "_c10d_functional_autograd")
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
        events = [rec._record(spec, args, kwargs, start, took) for rec in list(_OPEN)]
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                _PENDING[id(t)] = (t, events)  # its wait_tensor sets Event.end
        return out

    return kernel


def _wait_kernel(op):
    """``wait_tensor``'s Python kernel: wait; the collective that made the tensor is done."""

    def kernel(keyset, *args, **kwargs):
        out = op.redispatch(keyset.remove(_BACKEND_SELECT), *args, **kwargs)
        _done(args[0] if args else kwargs.get("tensor"))
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
        events = [rec._record_method(name, self, args, kwargs, start, took) for rec in list(_OPEN)]
        if isinstance(out, _work_class()):
            _PENDING[id(out)] = (out, events)  # its wait() sets Event.end
        return out

    method.__name__ = name
    return method


def _work_wait(call):
    """The wrapper of ``Work.wait``: wait; the message it carries is done on this rank."""

    def wait(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        _done(self)
        return out

    wait.__name__ = "wait"
    return wait


def _done(obj) -> None:
    """``obj`` (a Work, a functional collective's output) completed: set its events' end."""
    pending = _PENDING.pop(id(obj), None)
    if pending is not None and pending[0] is obj:
        now = time.perf_counter()
        for event in pending[1]:
            if event is not None:
                event.end = now


def _work_class():
    import torch.distributed as dist

    return dist.distributed_c10d.Work


_KERNELS: list = []  # (namespace, qualified name, kernel), made once per process
_SAVED: dict = {}  # ProcessGroup attribute -> its own descriptor, while wrapped
_SAVED_WAIT: list = []  # Work.wait's own descriptor, while wrapped


def open_recorder(rec) -> None:
    import torch.distributed as dist
    from torch.library import Library

    with _INSTALL:
        if not _KERNELS:
            for ns, qual, op, spec in _comm_ops():
                _KERNELS.append((ns, qual, _kernel(op, spec)))
            wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
            if wait is not None:
                _KERNELS.append(("_c10d_functional", "wait_tensor", _wait_kernel(wait.default)))
        if not _OPEN:
            libs = {}
            for ns, qual, kernel in _KERNELS:
                lib = libs.get(ns) or libs.setdefault(ns, Library(ns, "IMPL"))
                lib.impl(qual, kernel, "BackendSelect", with_keyset=True)
            _LIBS.extend(libs.values())
            pg = dist.ProcessGroup
            for name in METHODS:
                if name in vars(pg):  # (the descriptor; getattr gives the callable)
                    _SAVED[name] = vars(pg)[name]
                    setattr(pg, name, _method(name, getattr(pg, name)))
            work = _work_class()
            _SAVED_WAIT[:] = [vars(work)["wait"]]
            work.wait = _work_wait(work.wait)
        _OPEN.append(rec)


def close_recorder(rec) -> None:
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
            if _SAVED_WAIT:
                _work_class().wait = _SAVED_WAIT.pop()
            _PENDING.clear()


def installed() -> bool:
    """Whether the tracer's kernels and wrappers are in place (a trace is open here)."""
    return bool(_LIBS) or bool(_SAVED)
