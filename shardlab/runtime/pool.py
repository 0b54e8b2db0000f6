"""``Ranks``: a persistent pool of N ranks, driven from a notebook kernel or a script.

::

    kernel (you)                 rank 0      rank 1      rank 2      rank 3
    ranks.run(fn, x) ──pickle──▶ fn(x)       fn(x)       fn(x)       fn(x)
                                  └──── one process group, one 1-D DeviceMesh ────┘
    [r0, r1, r2, r3] ◀──────────  results and printed output, in rank order

The workers start once (a forkserver that imported torch and shardlab's engine forks
them: 2.5 s for 4 ranks on 2 cores, then their first sharded call takes milliseconds) and
keep their process group, mesh and namespace across calls. When the
process already is one rank of a ``torchrun``/``srun`` job (``RANK`` and
``WORLD_SIZE`` set), the same API runs ``fn`` in place and all-gathers the
results, so scripts run unchanged under torchrun.
"""

from __future__ import annotations

import contextvars
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from shardlab.runtime import context
from shardlab.runtime.launch import PRELOAD, dumps, main_hidden, pick_start_method, worker_module
from shardlab.runtime.replies import call_attached, collect, print_outputs, rank_error

__all__ = ["Ranks"]

BACKENDS = ("gloo", "nccl")
_OPEN: weakref.WeakSet = weakref.WeakSet()  # live pools, for the %%ranks magic
# Scoped wrappers around every call (``shardlab.trace`` installs one for the
# duration of its block): ``hook.wrap(fn, args, kwargs)`` before sending,
# ``hook.unwrap(results)`` on the results in rank order.
CALL_HOOKS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "shardlab_call_hooks", default=()
)


class Ranks:
    """A pool of ``n`` ranks sharing one process group.

    Args:
        n: number of ranks (>= 1). Under torchrun, ``None`` or ``WORLD_SIZE``.
        backend: ``"gloo"`` (CPU, or CUDA tensors staged as below) or ``"nccl"``
            (one GPU per rank).
        device: where each rank's tensors live: ``"cpu"`` (gloo's default),
            ``"cuda"`` (nccl's; with gloo: N ranks may share one GPU, rank r on GPU
            r % count, collectives on CUDA tensors through gloo and point-to-point
            messages staged through host memory: for learning on one GPU, not for
            speed), or ``"auto"`` (``"cuda"`` where torch sees a GPU, else ``"cpu"``).
        timeout: seconds after which a collective that cannot complete (a rank
            missing, a mismatched collective) fails; the pool then restarts
            itself on the next call.
        grace: seconds to wait for the other ranks once one rank has failed,
            before stopping them.
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.
        threads: torch intra-op threads per rank (default: cores // n, at least 1).

    Use as a context manager, or call :meth:`close`. Under ``torchrun``/``srun`` (``RANK``
    and ``WORLD_SIZE`` set) the pool *attaches* to the job instead: :meth:`run` runs the
    function in place and all-gathers the results, so the same script runs unchanged.

    Communicates:
        Starting joins the ranks in one process group (a TCP store rendezvous) with a 1-D
        :class:`~torch.distributed.device_mesh.DeviceMesh` over all of them. Calls travel
        to the ranks through pipes (the function and its arguments pickled with
        cloudpickle); nothing moves between ranks unless the function communicates.

    Example::

        ranks = shardlab.Ranks(4)              # 4 gloo ranks on CPU

        def body(scale):
            import torch, torch.distributed as dist
            x = torch.tensor([scale * shardlab.this_rank().rank])
            dist.all_reduce(x)                 # one all-reduce of 8 bytes
            return x.item()

        ranks.run(body, 2.0)                   # [12.0, 12.0, 12.0, 12.0]
        ranks.close()
    """

    def __init__(
        self,
        n: int | None = None,
        backend: str = "gloo",
        *,
        device: str | None = None,
        timeout: float = 30.0,
        grace: float = 2.0,
        start_method: str | None = None,
        threads: int | None = None,
    ):
        env = context.env_rank()
        if n is None and env is None:
            raise TypeError("Ranks() needs the number of ranks, e.g. Ranks(4)")
        if n is None:
            n = env[1]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Ranks(n): n must be a positive int (number of ranks), got {n!r}")
        if backend not in BACKENDS:
            raise ValueError(f"Ranks(backend={backend!r}): supported backends are {list(BACKENDS)}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"Ranks(timeout={timeout!r}): timeout must be a positive number of seconds"
            )
        self.world_size = n
        self.backend = backend
        self.device = context.rank_device_type(backend, device)
        self.timeout = float(timeout)
        self.grace = float(grace)
        self.attached = env is not None
        self._procs: list = []
        self._conns: list = []
        self._lifelines: list = []
        self._store = None
        self._broken = False
        self._closed = False
        if self.attached:
            if env[1] != n:
                raise ValueError(
                    f"Ranks({n}) inside a job of WORLD_SIZE={env[1]}: "
                    f"pass Ranks() or Ranks({env[1]})"
                )
            self._rank_ctx = context._CONTEXT or context.init_rank(
                env[0], env[1], backend, self.timeout, local_rank=env[2], device=self.device
            )
            return
        if backend == "nccl":
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count < n:
                raise RuntimeError(
                    f"Ranks({n}, backend='nccl') needs {n} GPUs, found {count}; "
                    "use backend='gloo' on CPU"
                )
        self._method = pick_start_method(start_method)
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self._start()
        _OPEN.add(self)

    # -- lifecycle ---------------------------------------------------------
    def _start(self) -> None:
        self._broken = False
        ctx = mp.get_context(self._method)
        if self._method == "forkserver":
            from multiprocessing import forkserver

            ctx.set_forkserver_preload(list(PRELOAD))
            with main_hidden():
                forkserver.ensure_running()  # imports torch there while we import it here
        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, use_libuv=True
        )
        addr = ("127.0.0.1", self._store.port)
        with main_hidden():
            self._spawn_workers(ctx, addr)
        replies = collect(self, deadline=time.monotonic() + self.timeout + 30)
        failed = {r: m for r, m in replies.items() if m[0] != "ready"}
        if failed:
            self._kill()
            raise rank_error(
                replies, self.world_size, restarted=True, note="the ranks could not start"
            )
        self.pids = [replies[r][2] for r in range(self.world_size)]

    def _spawn_workers(self, ctx, addr) -> None:
        worker = worker_module()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            life_r, life_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker.main,
                args=(
                    rank,
                    self.world_size,
                    child_end,
                    life_r,
                    os.getpid(),
                    addr,
                    self.backend,
                    self.timeout,
                    self.threads,
                    self.device,
                ),
                name=f"shardlab-rank-{rank}",
                daemon=True,
            )
            p.start()
            child_end.close()
            life_r.close()
            self._procs.append(p)
            self._conns.append(parent_end)
            self._lifelines.append(life_w)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns + self._lifelines:
            c.close()
        self._procs, self._conns, self._lifelines = [], [], []
        self._store = None

    def close(self) -> None:
        """Stop every rank (each destroys its process group first). Safe to call twice;
        leaving a ``with Ranks(n) as ranks:`` block calls it. Attached to a torchrun job, it
        stops nothing.

        Example::

            with shardlab.Ranks(2) as ranks:
                ranks.run(lambda: 1)           # [1, 1]
        """
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self.attached:
            return
        for c in self._conns:
            try:
                c.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("attached" if self.attached else "running")
        return (
            f"Ranks({self.world_size}, backend={self.backend!r}, device={self.device!r}, {state}, "
            f"timeout={self.timeout:g}s)"
        )

    # -- calls -------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: any function, also one defined in a notebook (it travels by value with
                cloudpickle; an unpicklable function or argument is a ``TypeError`` before
                anything runs).
            args, kwargs: passed to ``fn`` on every rank (the same values).

        Returns:
            A list with each rank's result, in rank order (results must be picklable).

        What ranks print is printed here afterwards, rank by rank, each line prefixed
        ``[rank i]``. Raises :class:`RankError` if any rank raises (naming the rank, with its
        traceback); a rank that dies or a collective that cannot complete is reported
        within ``timeout`` and the pool restarts on the next call.

        Communicates:
            Only what ``fn`` does; the call and the results travel through pipes.

        Example::

            def shapes(n):
                import torch
                me = shardlab.this_rank()
                return torch.zeros(n + me.rank).shape

            ranks.run(shapes, 2)   # [torch.Size([2]), torch.Size([3]), ...]
        """
        results, outputs = self._call(fn, args, kwargs)
        print_outputs(outputs)
        return results

    def push(self, **values: Any) -> None:
        """Put the same ``name=value`` pairs into every rank's namespace (where ``%%ranks``
        cells run). Nothing moves between ranks.

        Example::

            ranks.push(lr=0.1, steps=3)
            ranks.pull("lr")          # [0.1, 0.1, 0.1, 0.1]
        """
        worker = worker_module()
        self._call(worker.push, (values,), {})

    def pull(self, *names: str) -> list | dict:
        """Values of ``names`` in every rank's namespace: a list in rank order
        for one name, a dict ``{name: [per-rank values]}`` for several. Nothing moves
        between ranks (each sends its values to the kernel through its pipe).

        Example::

            ranks.run(lambda: shardlab.this_rank().ns.update(x=shardlab.this_rank().rank))
            ranks.pull("x")           # [0, 1, 2, 3]
            ranks.pull("x", "lr")     # {"x": [0, 1, 2, 3], "lr": [...]}
        """
        worker = worker_module()
        results, _ = self._call(worker.pull, (names,), {})
        if len(names) == 1:
            return [r[0] for r in results]
        return {n: [r[i] for r in results] for i, n in enumerate(names)}

    def _call(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[list, list]:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; start a new pool with shardlab.Ranks(...)")
        if not callable(fn):
            raise TypeError(f"ranks.run(fn): fn must be callable, got {type(fn).__name__}")
        hooks = CALL_HOOKS.get()
        for hook in hooks:
            fn, args, kwargs = hook.wrap(fn, args, kwargs)
        try:
            payload = dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"ranks.run could not send {getattr(fn, '__name__', fn)!r} and its arguments "
                f"to the ranks (cloudpickle failed: {type(exc).__name__}: {exc}). "
                "Functions, arguments and captured globals must be picklable; open files, "
                "locks and generators are not."
            ) from exc
        if self.attached:
            results, outputs = call_attached(payload, self.world_size)
        else:
            results, outputs = self._call_pool(payload)
        for hook in reversed(hooks):
            results = hook.unwrap(results)
        return results, outputs

    def _call_pool(self, payload: bytes) -> tuple[list, list]:
        if self._broken or not self._procs:
            self._kill()
            self._start()
        try:
            for c in self._conns:
                c.send(("call", payload))
        except KeyboardInterrupt:
            self._kill()  # some ranks got the call, others not: start afresh
            raise
        replies = collect(self)
        if any(m[0] != "ok" for m in replies.values()):
            raise rank_error(replies, self.world_size, restarted=self._broken)
        results = [cloudpickle.loads(replies[r][1]) for r in range(self.world_size)]
        return results, [replies[r][2] for r in range(self.world_size)]
