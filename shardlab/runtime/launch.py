"""How a :class:`~shardlab.runtime.Ranks` pool starts its ranks and what it sends them.

::

    kernel                                   forkserver (torch preloaded)
    pick_start_method()  forkserver | spawn
    with main_hidden():  start the processes --fork--> worker_module().main(rank, ...)
    dumps((fn, args, kwargs)) ------ pipe ---------->  cloudpickle.loads, fn(*args, **kwargs)

Nothing here imports torch: the kernel's side of a pool does without it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing as mp
import pickle
import sys
import types

import cloudpickle

# What the forkserver imports before it forks a rank: the worker (torch), and what the
# layers above add with :func:`preload_on_ranks` (the tensor engine, the patch, dynamo:
# a rank's first sharded call imported them, about a second of CPU for each rank).
PRELOAD: list[str] = ["shardlab.runtime.worker"]


def preload_on_ranks(*modules: str) -> None:
    """Have the forkserver import ``modules`` once, before it forks the ranks, instead of
    each rank on its first call (a table filled from above: the runtime imports nothing of
    the layers it names). Takes effect for a forkserver not yet started."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def pick_start_method(requested: str | None) -> str:
    """``requested`` if this platform has it, else ValueError; None: forkserver if any."""
    available = mp.get_all_start_methods()
    if requested is None:
        return "forkserver" if "forkserver" in available else "spawn"
    if requested not in ("forkserver", "spawn") or requested not in available:
        supported = [m for m in ("forkserver", "spawn") if m in available]
        raise ValueError(
            f"start_method={requested!r} is not supported here; use one of {supported}"
        )
    return requested


def dumps(obj) -> bytes:
    """``cloudpickle.dumps``, modules of torch's own classes sent by name. cloudpickle sends
    a function with the submodules its code may reach (``torch.ops`` when the code says
    ``torch.ops.aten.add``, ``torch.backends.cuda`` ...), and copies a module whose class
    is not ``ModuleType`` instead of naming it (and fails)."""
    buf = io.BytesIO()
    _ByName(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


class _ByName(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if (
            isinstance(obj, types.ModuleType)
            and type(obj) is not types.ModuleType
            and sys.modules.get(getattr(obj, "__name__", None)) is obj
        ):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


@contextlib.contextmanager
def main_hidden():
    """Start workers without re-running the caller's ``__main__`` in them.

    multiprocessing re-imports the main script in every forkserver/spawn child
    (so an unguarded script would start ranks recursively). The workers only
    need ``shardlab.runtime.worker.main``; user functions arrive by value via
    cloudpickle. So the main module is hidden while the processes start.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def worker_module():
    """:mod:`shardlab.runtime.worker`, on first use: it imports torch (the forkserver preloads
    it for the ranks), which the kernel's side of a pool does without."""
    from shardlab.runtime import worker

    return worker
