"""The process behind one rank of a :class:`shardlab.Ranks` pool.

Life of a worker::

    forkserver (torch preloaded) --fork--> worker
      1. ignore SIGINT (Jupyter's interrupt hits the whole process group);
         SIGUSR1 interrupts the running call instead
      2. watchdog thread: exit as soon as the parent process is gone
      3. init_process_group + 1-D DeviceMesh, send ("ready", rank, pid)
      4. loop: receive a call, run it with stdout/stderr captured, send back
         ("ok", result, output) or ("err", type, message, traceback, output)

Messages are cloudpickled, so functions defined in a notebook travel by value.
"""

from __future__ import annotations

import ast
import io
import os
import signal
import sys
import threading
import traceback
from typing import Any

import cloudpickle
import torch  # noqa: F401  (preloaded by the forkserver: workers start fast)
import torch.distributed  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401

from shardlab.runtime import context

_BUSY = False


def _on_interrupt(signum, frame):
    if _BUSY:
        raise KeyboardInterrupt("interrupted from the kernel")


def _watch_parent(lifeline, parent_pid: int) -> None:
    """Exit when the parent dies: its end of ``lifeline`` closes, or its pid vanishes."""
    while True:
        try:
            if lifeline.poll(1.0):
                lifeline.recv()  # the parent never sends: EOF means it is gone
        except (EOFError, OSError):
            os._exit(3)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


def is_dist_error(exc: BaseException) -> bool:
    """Did this exception come from the process group (timeout, peer gone)?"""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(
        s in text
        for s in (
            "Timed out",
            "timed out",
            "Connection closed by peer",
            "Connection reset",
            "Broken pipe",
            "gloo",
            "NCCL",
        )
    )


class _Capture(io.TextIOBase):
    """A text stream that collects everything written to it."""

    def __init__(self):
        self.parts: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def exec_cell(code: str) -> Any:
    """Run notebook cell ``code`` in this rank's namespace; return the last expression."""
    ns = context.this_rank().ns
    tree = ast.parse(code, "<%%ranks cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<%%ranks cell>", "exec"), ns)
    if last is not None:
        return eval(compile(last, "<%%ranks cell>", "eval"), ns)
    return None


def push(values: dict) -> None:
    context.this_rank().ns.update(values)


def pull(names: tuple[str, ...]) -> tuple:
    ns = context.this_rank().ns
    missing = [n for n in names if n not in ns]
    if missing:
        raise NameError(f"name(s) {missing} not defined on rank {context.this_rank().rank}")
    return tuple(ns[n] for n in names)


def _run_one(payload: bytes) -> tuple:
    global _BUSY
    out = _Capture()
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    _BUSY = True
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
        _BUSY = False
        return ("ok", cloudpickle.dumps(result), out.text())
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        _BUSY = False
        tb = traceback.format_exc()
        return ("err", type(exc).__name__, str(exc), tb, out.text(), is_dist_error(exc))
    finally:
        _BUSY = False
        sys.stdout, sys.stderr = old


def main(
    rank: int,
    world_size: int,
    conn,
    lifeline,
    parent_pid: int,
    store_addr: tuple[str, int],
    backend: str,
    timeout: float,
    threads: int,
    device: str = "cpu",
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, _on_interrupt)
    threading.Thread(target=_watch_parent, args=(lifeline, parent_pid), daemon=True).start()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.TCPStore(
            store_addr[0],
            store_addr[1],
            world_size + 1,
            is_master=False,
            timeout=__import__("datetime").timedelta(seconds=timeout),
        )
        context.init_rank(rank, world_size, backend, timeout, store=store, device=device)
        context.reuse_mesh_groups()
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", type(exc).__name__, str(exc), traceback.format_exc(), "", False))
        return
    conn.send(("ready", rank, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            break
        if msg[0] == "close":
            break
        conn.send(_run_one(msg[1]))
    _release()
    os._exit(0)


def _release() -> None:
    """What the rank holds beyond its memory, given back before ``os._exit`` (which runs no
    ``atexit`` handler, nor multiprocessing's exit): torch.compile's compile workers, the
    finalizers of multiprocessing objects (tqdm's lock, made by inductor's progress bar: a
    named semaphore the resource tracker reported leaked at the script's end), and every
    process group."""
    from multiprocessing import util

    compile_workers = sys.modules.get("torch._inductor.async_compile")
    try:
        if compile_workers is not None:
            compile_workers.shutdown_compile_workers()
        util._run_finalizers(0)  # (what a multiprocessing child runs at its exit)
        util._run_finalizers()
    except Exception:  # noqa: BLE001 - the pool is going away anyway
        pass
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the pool is going away anyway
        pass
