"""From a trace's events (one per rank per message) to messages, and their measured time.

A trace holds what each rank saw: an all-reduce on 4 ranks is 4 events, a message is a
``send`` on one rank and a ``recv`` on another. :func:`messages` pairs them up:

* a collective is the k-th collective each rank of its group ran on that group (every
  rank runs a group's collectives in the same order, or they would hang);
* a point-to-point message is the k-th ``send`` from rank a to rank b and the k-th
  ``recv`` on b from a.

**Measured time, without the waiting.** A rank that reaches a collective first waits for
the last one: that is load imbalance, not the network. So a message's measured time counts
from the moment its *last* participant posted it (``Event.start``) to its completion
(``Event.end``: see :class:`shardlab.trace.Event`):

* a collective: ``min over its ranks (end - start)``: the last rank to arrive waits for
  nobody;
* a point-to-point message: ``recv.end - max(send.start, recv.start)`` (the data has
  arrived when the receive completes; it could not leave before both were posted).

Starts of different ranks are compared: the ranks must share a clock (one machine's
``time.perf_counter``, as a :class:`shardlab.Ranks` pool). Where one end is missing (a
trace of one rank) the other end's own ``end - start`` stands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.cost.formulas import family

__all__ = ["Message", "gaps", "in_flight_together", "messages"]


@dataclass
class Message:
    """One message: a collective over ``group``, or a point-to-point ``group = (sender,
    receiver)``; ``events`` are the ranks' records of it (one per rank that traced it)."""

    kind: str  # family: "p2p", "all_reduce", ...
    group: tuple[int, ...]
    label: str
    events: list = field(default_factory=list)
    key: tuple = ()  # (group, k): the k-th on its group; (sender, receiver, k); the same each step

    @property
    def p(self) -> int:
        """Ranks taking part (2 for a point-to-point message)."""
        return len(self.group)

    @property
    def nbytes(self) -> int:
        """One rank's payload (``Event.bytes``; the largest, for uneven shards)."""
        return max((e.bytes for e in self.events), default=0)

    @property
    def bytes(self) -> int:
        """The bytes its events count in the trace (summed over the ranks that traced it)."""
        return sum(e.bytes for e in self.events)

    @property
    def start(self) -> float:
        """When its first participant posted it (``time.perf_counter()``)."""
        return min(e.start for e in self.events)

    def measured(self) -> float | None:
        """Its time from the last participant's post to completion, in seconds; None if
        no event of it knows its end (``Event.end`` 0.0)."""
        if self.kind == "p2p":
            send = next((e for e in self.events if e.kind == "send"), None)
            recv = next((e for e in self.events if e.kind == "recv"), None)
            if recv is not None and recv.end:
                posted = max(recv.start, send.start) if send is not None else recv.start
                return max(recv.end - posted, 0.0)
            if send is not None and send.end:
                return send.end - send.start
            return None
        took = [e.end - e.start for e in self.events if e.end]
        return min(took) if took else None


def messages(events) -> tuple[list[Message], dict]:
    """The messages of ``events`` (a Trace or a list of Events), in the order they began,
    and ``{id(event): its Message}``."""
    found: dict = {}
    counts: dict = {}
    of: dict = {}
    for e in sorted(events, key=lambda e: (e.rank, e.seq)):
        fam = family(e.kind)
        if fam != "p2p":
            key = ("c", e.rank, e.group)
            counts[key] = counts.get(key, 0) + 1
            mkey, group = (e.group, counts[key]), e.group
        elif e.peer is None or e.peer < 0:  # a receive from any source: a message alone
            mkey, group = ("any", e.rank, e.seq), (e.rank,)
        else:
            src, dst = (e.rank, e.peer) if e.kind == "send" else (e.peer, e.rank)
            key = (e.kind, src, dst)
            counts[key] = counts.get(key, 0) + 1
            mkey, group = (src, dst, counts[key]), (src, dst)
        msg = found.get(mkey)
        if msg is None:
            msg = found[mkey] = Message(fam, group, e.label, key=mkey)
        msg.events.append(e)
        of[id(e)] = msg
    return sorted(found.values(), key=lambda m: m.start), of


def in_flight_together(events) -> list[list]:
    """One rank's events (in its order) cut into runs that were in flight at once: an event
    joins the run before it if it was posted before all of that run had completed (the
    sends and receives of one ``batch_isend_irecv``). Without ``Event.end`` (an old trace),
    ``start + duration`` stands in for it."""
    runs: list[list] = []
    last_end = None
    for e in sorted(events, key=lambda e: e.seq):
        end = e.end if e.end else e.start + e.duration
        if runs and last_end is not None and e.start < last_end:
            runs[-1].append(e)
            last_end = max(last_end, end)
        else:
            runs.append([e])
            last_end = end
    return runs


def gaps(events) -> list[float]:
    """Seconds between one run of messages in flight and the next, on each rank: the
    compute between a step's messages (for :func:`~shardlab.cost.calibrate`'s ``between``)."""
    out = []
    for rank in sorted({e.rank for e in events}):
        runs = in_flight_together([e for e in events if e.rank == rank])
        ends = [max((e.end or e.start + e.duration) for e in run) for run in runs]
        out += [max(nxt[0].start - end, 0.0) for end, nxt in zip(ends, runs[1:])]
    return out
