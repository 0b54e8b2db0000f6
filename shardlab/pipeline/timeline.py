"""What a pipeline schedule ran, as it ran: each rank's actions (a stage's forward ``F``,
full backward ``B``, or its input ``I`` and weight ``W`` parts) with their times, and the
bubble fraction of a timeline.

:func:`record` wraps the three methods of torch's ``PipelineStage`` that every schedule
calls (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``; the same
names in torch 2.11 to 2.15) on the stage objects given, for the time of a ``with`` block:
each call becomes an :class:`Action` with its wall-clock interval and the CPU time of the
calling thread (where a CPU stage computes, forward and backward alike).

:func:`replay` redraws a run with one core per rank: each action takes its measured CPU
time, each rank keeps its own order, and an action that waited for a message (a traced
``recv`` that completed before it started) starts no earlier than the matching ``send``
was posted on the other rank (the k-th send from a to b is the k-th recv on b from a).
Messages cost nothing and sends never block. The result is what the schedule would do on
hardware that runs every rank at once, from what each rank actually computed, in the order
it actually ran.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, replace

__all__ = ["KINDS", "Action", "bubble", "formula", "record", "replay"]


class _Table(dict):
    """A dict with a docstring of its own (what its API entry shows)."""

    def __init__(self, doc: str, entries: dict):
        super().__init__(entries)
        self.__doc__ = doc


KINDS = _Table(
    "What an :class:`Action`'s kind means: ``F`` forward, ``B`` a whole backward, ``I`` and "
    "``W`` its input and weight parts (zero-bubble schedules).",
    {
        "F": "forward",
        "B": "backward (input and weights)",
        "I": "backward, input part",
        "W": "backward, weight part",
    },
)


@dataclass(frozen=True)
class Action:
    """One computation a rank ran: ``kind`` (``"F"``, ``"B"``, ``"I"`` or ``"W"``: see
    :data:`KINDS`) of ``stage`` on ``microbatch``. ``start`` and ``end``: seconds
    (``time.perf_counter()`` when recorded; from the start of the timeline after
    :func:`replay`). ``cpu``: the CPU seconds its thread spent in it."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float
    cpu: float

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


def _wrap(stage, name, kind_of, rank, out):
    call = getattr(stage, name)

    def wrapped(*args, **kwargs):
        chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
        kind = kind_of(kwargs)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            end, cpu_end = time.perf_counter(), time.thread_time()
            out.append(Action(rank, stage.stage_index, int(chunk), kind, start, end, cpu_end - cpu))

    return wrapped


@contextlib.contextmanager
def record(stages, rank: int | None = None):
    """Record the actions that a schedule runs on ``stages`` (torch ``PipelineStage``
    objects, one or a list) inside the block; yields the list they are appended to, in
    the order this rank ran them.

    ``rank``: the number to record (default: this process's global rank, 0 without a
    process group). Communicates nothing.

    Example::

        with pipeline.record(stage) as actions:
            schedule.step(x, target=y)
        [(a.kind, a.microbatch) for a in actions]   # [('F', 0), ('F', 1), ..., ('B', 0), ...]
    """
    import torch.distributed as dist

    stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    out: list[Action] = []
    kinds = {
        "forward_one_chunk": lambda kw: "F",
        "backward_one_chunk": lambda kw: "B" if kw.get("full_backward", True) else "I",
        "backward_weight_one_chunk": lambda kw: "W",
    }
    for stage in stages:
        for name, kind_of in kinds.items():
            setattr(stage, name, _wrap(stage, name, kind_of, rank, out))
    try:
        yield out
    finally:
        for stage in stages:
            for name in kinds:
                vars(stage).pop(name, None)  # the class's method again


def replay(actions, events=()) -> list[Action]:
    """The timeline with one core per rank (see the module's text): ``actions`` of every
    rank as recorded (wall-clock times), ``events`` the traced messages of the same run
    (:class:`shardlab.trace.Event`; their ``send``/``recv`` give the waits). Returns new
    actions, each lasting its ``cpu`` seconds, times counted from 0.

    Example::

        ideal = pipeline.replay(actions, trace.events)
        pipeline.bubble(ideal)                     # the idle share of the ranks' time
    """
    # message (sender, receiver) -> its sends' and recvs' real times, in order
    sends, recvs = defaultdict(list), defaultdict(list)
    for e in sorted(events, key=lambda e: (e.rank, e.seq)):
        if e.kind == "send" and e.peer is not None:
            sends[e.rank, e.peer].append(e.start)
        elif e.kind == "recv" and e.peer is not None:
            recvs[e.peer, e.rank].append(e.end or e.start + e.duration)
    # each received message: (receiver, real time its wait ended, sender, real time sent)
    arrivals = defaultdict(list)
    for key, times in recvs.items():
        for got, sent in zip(times, sends.get(key, [])):
            arrivals[key[1]].append((got, key[0], sent))
    for lst in arrivals.values():
        lst.sort()
    order = sorted(actions, key=lambda a: a.start)  # a message's sender comes first
    done: dict[int, list[tuple[float, float]]] = defaultdict(list)  # (real end, new end)
    clock: dict[int, float] = defaultdict(float)
    seen: dict[int, int] = defaultdict(int)
    out = []

    def posted(sender: int, real: float) -> float:
        """When, replayed, ``sender`` posted a message it sent at ``real``: the replayed
        end of its last action that ended before it (0 before any)."""
        return max((new for end, new in done[sender] if end <= real), default=0.0)

    for a in order:
        ready = clock[a.rank]
        waits = arrivals[a.rank]
        while seen[a.rank] < len(waits) and waits[seen[a.rank]][0] <= a.start:
            _, sender, sent = waits[seen[a.rank]]
            ready = max(ready, posted(sender, sent))
            seen[a.rank] += 1
        new = replace(a, start=ready, end=ready + a.cpu)
        clock[a.rank] = new.end
        done[a.rank].append((a.end, new.end))
        out.append(new)
    return sorted(out, key=lambda a: (a.rank, a.start))


def bubble(actions) -> float:
    """The idle share of a timeline: ``1 - busy / (ranks x span)``, ``busy`` the actions'
    summed durations, ``span`` from the first start to the last end (over all ranks)."""
    actions = list(actions)
    if not actions:
        return 0.0
    ranks = {a.rank for a in actions}
    span = max(a.end for a in actions) - min(a.start for a in actions)
    busy = sum(a.duration for a in actions)
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def formula(stages: int, microbatches: int, times=None) -> float:
    """The bubble fraction of GPipe (and, closely, 1F1B) for ``p`` stages (one per rank)
    and ``m`` micro-batches.

    ``times`` None: every stage alike, the textbook ``(p - 1) / (m + p - 1)`` (backward
    twice the forward, or any ratio). ``times``: each stage's ``(forward, backward)``
    seconds for one micro-batch, when the stages are not alike (the first holds the
    embedding, the last the head and the loss). Then the slowest stage sets the pace::

        span   = sum(f + b over stages) + (m - 1) * (max f + max b)
        bubble = 1 - m * sum(f + b) / (p * span)

    (the forwards flow down the stages, then the backwards up: each flow takes the sum of
    one micro-batch's times plus ``m - 1`` times its slowest stage). Equal times give the
    textbook fraction; unequal ones a larger bubble, never a smaller.

    Example::

        pipeline.formula(4, 8)                                  # 0.2727...
        pipeline.formula(4, 8, [(1, 2), (1, 2), (1, 2), (1.5, 2.5)])  # 0.3658...
    """
    p, m = stages, microbatches
    if times is None:
        return (p - 1) / (m + p - 1)
    times = [(float(f), float(b)) for f, b in times]
    if len(times) != p:
        raise ValueError(f"formula: times has {len(times)} stages, stages is {p}")
    work = sum(f + b for f, b in times)
    span = work + (m - 1) * (max(f for f, _ in times) + max(b for _, b in times))
    return 1.0 - m * work / (p * span) if span > 0 else 0.0
