"""What comes back from the ranks of a :class:`~shardlab.runtime.Ranks` pool.

Each rank answers every message through its pipe with one tuple::

    ("ready", rank, pid)                                      joined the process group
    ("ok", result (cloudpickled), printed output)             the call returned
    ("err", type, message, traceback, printed output, dist)   it raised; ``dist``: the
                                                              process group failed with it

:func:`collect` waits for one per rank, a rank that died counting as an ``"err"``; once one
rank failed the others get ``grace`` seconds. :func:`rank_error` names the root cause (a rank
that failed for its own reason, not one whose collective broke because of it). Under
torchrun, :func:`call_attached` runs the call in place and all-gathers the same tuples.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.connection import wait

import cloudpickle

from shardlab.runtime.errors import RankError
from shardlab.runtime.launch import worker_module

_POLL = 0.1  # seconds between checks for signals while waiting for the ranks


def collect(ranks, deadline: float | None = None) -> dict[int, tuple]:
    """Wait for one reply per rank of the pool ``ranks``; handle deaths, failures and Ctrl-C
    (a rank that died or broke its process group marks the pool broken and stops it)."""
    replies: dict[int, tuple] = {}
    index = {c: r for r, c in enumerate(ranks._conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(ranks._procs)}
    interrupted = False
    while len(replies) < ranks.world_size:
        now = time.monotonic()
        failed = any(m[0] == "err" for m in replies.values())
        if failed or interrupted:
            deadline = min(deadline or now + ranks.grace, now + ranks.grace)
        pending = [c for c, r in index.items() if r not in replies]
        waits = pending + [s for s, r in sentinels.items() if r not in replies]
        # short waits: a signal that the kernel delivered to another thread
        # (gloo, the store) is only acted on when this thread runs Python
        step = _POLL if deadline is None else max(0.0, min(_POLL, deadline - now))
        try:
            ready = wait(waits, timeout=step)
            if not ready and (deadline is None or time.monotonic() < deadline):
                continue
        except KeyboardInterrupt:
            interrupted = True
            for r in range(ranks.world_size):
                if r not in replies and ranks._procs[r].is_alive():
                    os.kill(ranks._procs[r].pid, signal.SIGUSR1)
            deadline = time.monotonic() + ranks.grace
            continue
        if not ready:  # deadline passed: stop the stragglers
            for r in range(ranks.world_size):
                if r not in replies:
                    replies[r] = (
                        "err",
                        "Stopped",
                        "did not finish after another rank failed"
                        if not interrupted
                        else "interrupted",
                        "",
                        "",
                        True,
                    )
            ranks._broken = True
            break
        for obj in ready:
            if obj in index:
                r = index[obj]
                try:
                    replies[r] = obj.recv()
                except (EOFError, OSError):
                    pass  # the sentinel reports the death
            elif sentinels.get(obj) not in replies:
                r = sentinels[obj]
                code = ranks._procs[r].exitcode
                replies[r] = (
                    "err",
                    "RankDied",
                    f"rank {r} died (exit code {code})",
                    "",
                    "",
                    True,
                )
                ranks._broken = True
    for m in replies.values():
        if m[0] == "err" and m[5]:
            ranks._broken = True
    if interrupted:
        if ranks._broken:
            ranks._kill()
        raise KeyboardInterrupt("interrupted; the ranks were stopped" if ranks._broken else "")
    if ranks._broken:
        ranks._kill()
    return replies


def rank_error(replies: dict, world_size: int, restarted: bool, note: str = "") -> RankError:
    """The :class:`RankError` of failed ``replies`` (the printed output printed first)."""
    failures = {r: (m[1], m[2]) for r, m in replies.items() if m[0] == "err"}
    # report the root cause: a rank that failed for its own reason, not a
    # collective that broke because another rank failed
    own = [r for r, m in sorted(replies.items()) if m[0] == "err" and not m[5]]
    rank = own[0] if own else min(failures)
    outputs = []
    for r in range(world_size):
        m = replies.get(r, ("",))
        outputs.append(m[4] if m[0] == "err" else m[2] if m[0] == "ok" else "")
    m = replies[rank]
    print_outputs(outputs)
    return RankError(rank, m[1], m[2], m[3], failures, restarted=restarted, note=note)


def call_attached(payload: bytes, world_size: int) -> tuple[list, list]:
    """torchrun mode: run here, all-gather (ok, result | error) across ranks."""
    import torch.distributed as dist

    worker = worker_module()
    fn, args, kwargs = cloudpickle.loads(payload)
    try:
        mine = ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001
        import traceback

        mine = (
            "err",
            type(exc).__name__,
            str(exc),
            traceback.format_exc(),
            "",
            worker.is_dist_error(exc),
        )
    gathered: list = [None] * world_size
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # the runtime's own gather is not the user's traffic
        dist.all_gather_object(gathered, mine)
    replies = {r: m for r, m in enumerate(gathered)}
    if any(m[0] != "ok" for m in replies.values()):
        failures = {r: (m[1], m[2]) for r, m in replies.items() if m[0] == "err"}
        rank = min(failures)
        m = replies[rank]
        raise RankError(rank, m[1], m[2], m[3], failures)
    return [m[1] for m in gathered], []


def print_outputs(outputs: list[str]) -> None:
    """Print what each rank printed, in rank order, each line prefixed ``[rank i]``."""
    for r, text in enumerate(outputs):
        if not text:
            continue
        for line in text.rstrip("\n").split("\n"):
            sys.stdout.write(f"[rank {r}] {line}\n")
    sys.stdout.flush()
