"""What a trace holds: one :class:`Event` per message, and views of them.

Recording (``record.py``) and viewing (here, and ``shardlab.viz``) are apart:
a :class:`Trace` is plain data that can be pickled, saved as JSON and drawn.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

__all__ = ["Event", "Trace", "COLLECTIVES", "POINT_TO_POINT"]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "barrier",
)
POINT_TO_POINT = ("send", "recv")


@dataclass
class Event:
    """One collective or point-to-point message, as seen by one rank.

    ``bytes`` is this rank's payload: the input it hands to a collective
    (for ``all_gather`` its own shard, for ``reduce_scatter`` its whole input,
    for ``scatter`` the chunk it receives),
    the tensor it sends (``send``) or receives (``recv``). ``group`` lists the
    global ranks of the process group, ``peer`` is the global rank on the other
    end of a send/recv (the root of a broadcast/scatter/gather/reduce).
    ``label`` names the shardlab op and phase that caused it (``"conv2d.halo
    forward"``), ``api`` is ``"c10d"`` (torch.distributed) or ``"functional"``.
    ``mesh_dim`` is the mesh dim (axis) the event runs along: the collective's group, or
    for a message the mesh dim whose group holds both ends (None: the whole world of a
    2-D mesh, or no mesh given to ``trace``).
    ``duration`` is the time of the call in seconds (for an asynchronous op,
    the time to issue it). ``end`` is when this rank saw the message complete
    (``time.perf_counter()``, as ``start``): its ``Work.wait()`` returned (``dist.all_reduce``
    waits at once, ``batch_isend_irecv``'s caller later; ``wait_tensor`` for a functional
    collective); 0.0 where it was not waited for inside the trace. ``end - start`` is the
    message's time on this rank, waiting for the other ranks included.
    ``splits``: for an ``all_to_all``, the bytes this rank hands each rank of the group, in
    group order (summing to ``bytes``; its own share stays on the rank); None otherwise.
    """

    rank: int
    seq: int
    kind: str
    op: str
    group: tuple[int, ...]
    peer: int | None
    bytes: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    label: str = ""
    mesh_dim: int | None = None
    api: str = "c10d"
    start: float = 0.0
    duration: float = 0.0
    end: float = 0.0
    splits: tuple[int, ...] | None = None

    @property
    def is_p2p(self) -> bool:
        """True for a point-to-point message (``send``/``recv``), False for a collective."""
        return self.kind in POINT_TO_POINT


@dataclass
class Trace:
    """Events of one ``with shardlab.trace() as t:`` block, from every rank traced.

    Plain data (a list of :class:`Event`): it pickles, saves as JSON (:meth:`to_json`) and
    draws (:func:`shardlab.viz.plot_collectives`). Filter with keyword arguments: ``rank``,
    ``kind`` (a name or a tuple), ``label`` (a prefix), ``peer``.

    Example::

        t.counts(rank=0)                          # {'all_reduce': 1, 'send': 2, ...}
        t.bytes(rank=1, kind="recv")              # what rank 1 received, in bytes
        t.filter(label="conv2d").table()          # one line per event
    """

    events: list[Event] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def ranks(self) -> list[int]:
        """The ranks that recorded events, sorted."""
        return sorted({e.rank for e in self.events})

    def filter(self, *, rank=None, kind=None, label=None, peer=None) -> Trace:
        """A sub-trace. ``kind`` may be a name or a tuple of names; ``label``
        matches as a prefix (``"conv2d"`` matches ``"conv2d.halo forward"``)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        out = [
            e
            for e in self.events
            if (rank is None or e.rank == rank)
            and (kinds is None or e.kind in kinds)
            and (label is None or e.label.startswith(label))
            and (peer is None or e.peer == peer)
        ]
        return Trace(out)

    def counts(self, by: str = "kind", **where) -> dict:
        """How many events, grouped ``by`` an Event field (default: kind).

        Each rank's events count, so one all-reduce on 4 ranks counts 4; use
        ``rank=0`` to count what one rank did."""
        return dict(Counter(getattr(e, by) for e in self.filter(**where).events))

    def bytes(self, rank: int | None = None, **where) -> int:
        """Total payload bytes of the events matching ``rank`` and ``where``."""
        return sum(e.bytes for e in self.filter(rank=rank, **where).events)

    def table(self, **where) -> str:
        """A text table, one row per event, ordered by rank then sequence."""
        rows = sorted(self.filter(**where).events, key=lambda e: (e.rank, e.seq))
        head = ("rank", "#", "kind", "group", "peer", "bytes", "dtype", "shape", "label", "ms")
        body = [
            (
                str(e.rank),
                str(e.seq),
                e.kind,
                _ranks_str(e.group),
                "" if e.peer is None else str(e.peer),
                str(e.bytes),
                e.dtype,
                " ".join("x".join(map(str, s)) or "()" for s in e.shapes),
                e.label,
                f"{e.duration * 1e3:.2f}",
            )
            for e in rows
        ]
        widths = [
            max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)
        ]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The events as a JSON list of objects (one per event; :meth:`from_json` reads it)."""
        return json.dumps([asdict(e) for e in self.events])

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """The trace that :meth:`to_json` wrote."""
        events = []
        for d in json.loads(text):
            d["group"] = tuple(d["group"])
            d["shapes"] = tuple(tuple(s) for s in d["shapes"])
            if d.get("splits") is not None:
                d["splits"] = tuple(d["splits"])
            events.append(Event(**d))
        return cls(events)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts().items()))
        return f"Trace({len(self.events)} events on ranks {self.ranks()}: {counts})"


def _ranks_str(group: tuple[int, ...]) -> str:
    if group and list(group) == list(range(group[0], group[0] + len(group))):
        return f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])
    return ",".join(map(str, group))
