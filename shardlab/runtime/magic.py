"""The ``%%ranks`` cell magic (``%load_ext shardlab``).

::

    %%ranks                      # run the cell on every rank of the open pool
    %%ranks pool --pull loss     # a named pool; afterwards ``loss`` in the kernel
                                 # is the list [loss on rank 0, loss on rank 1, ...]

The cell runs in each rank's own namespace, which persists across cells and
starts with ``rank``, ``world_size``, ``device``, ``mesh``, ``torch``, ``dist``.
What the ranks print appears in rank order, each line prefixed ``[rank i]``;
the value of a last expression is shown the same way.
"""

from __future__ import annotations

import argparse
import shlex

from shardlab.runtime import pool as _pool
from shardlab.runtime import worker
from shardlab.runtime.context import this_rank
from shardlab.runtime.replies import print_outputs

__all__ = ["register"]


def _prelude() -> None:
    import torch
    import torch.distributed as dist

    ctx = this_rank()
    ctx.ns.setdefault("__name__", "__ranks__")
    for k, v in dict(
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        mesh=ctx.mesh,
        torch=torch,
        dist=dist,
    ).items():
        ctx.ns.setdefault(k, v)


def _run_cell(code: str):
    _prelude()
    return worker.exec_cell(code)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    p.add_argument(
        "pool",
        nargs="?",
        default=None,
        help="name of a shardlab.Ranks in the kernel (default: the only open one)",
    )
    p.add_argument(
        "--pull",
        default="",
        help="comma-separated names to copy back into the kernel as per-rank lists",
    )
    return p


def _find_pool(name: str | None, user_ns: dict) -> _pool.Ranks:
    if name is not None:
        obj = user_ns.get(name)
        if not isinstance(obj, _pool.Ranks):
            raise ValueError(f"%%ranks {name}: {name!r} is not a shardlab.Ranks in this kernel")
        return obj
    live = [p for p in list(_pool._OPEN) if not p._closed]
    if not live:
        raise RuntimeError(
            "%%ranks: no ranks are running; start them with ranks = shardlab.Ranks(4)"
        )
    if len(live) > 1:
        names = [k for k, v in user_ns.items() if isinstance(v, _pool.Ranks) and not v._closed]
        raise RuntimeError(
            f"%%ranks: {len(live)} pools are open; name one, e.g. "
            f"%%ranks {names[0] if names else 'ranks'}"
        )
    return live[0]


def ranks_magic(line: str, cell: str, user_ns: dict) -> None:
    try:
        args = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"%%ranks {line}: usage: %%ranks [pool] [--pull name1,name2]") from None
    ranks = _find_pool(args.pool, user_ns)
    results, outputs = ranks._call(_run_cell, (cell,), {})
    for r, value in enumerate(results):
        if value is not None:
            outputs[r] = (
                outputs[r]
                + ("" if not outputs[r] or outputs[r].endswith("\n") else "\n")
                + repr(value)
                + "\n"
            )
    print_outputs(outputs)
    names = [n.strip() for n in args.pull.split(",") if n.strip()]
    if names:
        pulled = ranks.pull(*names)
        user_ns.update({names[0]: pulled} if len(names) == 1 else pulled)


def register(ipython) -> None:
    def ranks(line, cell):
        return ranks_magic(line, cell, ipython.user_ns)

    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
