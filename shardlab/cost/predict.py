"""Predict a trace's communication time with a cost model, beside what was measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.cost.formulas import wire_bytes
from shardlab.cost.model import _median
from shardlab.cost.pairing import in_flight_together, messages

__all__ = ["MessageCost", "Prediction", "predict"]


@dataclass
class MessageCost:
    """One message of the trace: its bytes (from the trace) and seconds (the model's, and
    measured: None where the trace does not know when it completed)."""

    kind: str  # "p2p", "all_reduce", ...
    label: str
    group: tuple[int, ...]  # a collective's ranks, or (sender, receiver)
    nbytes: int  # one rank's payload, Event.bytes
    bytes: int  # its events' bytes, summed over the ranks that traced it
    wire_bytes: float  # bytes one rank sends in a row, by the model's algorithm
    predicted: float
    measured: float | None


@dataclass
class Prediction:
    """What :func:`predict` returns: per message (``rows``), per rank and per step.

    Attributes:
        rows: one :class:`MessageCost` per message, in the order they began.
        ranks: rank -> ``{"predicted", "measured", "in_calls"}`` seconds of communication
            in the step. Messages a rank had in flight at once (a halo's sends and receives)
            count once, as the longest of them; ``measured`` times each message from its
            last participant's post (no waiting for late ranks; given several steps, its
            median over them); ``in_calls`` is the wall time the rank spent with a message
            in flight, waiting included (the median over the steps).
        where: the model's ``where``.
    """

    rows: list[MessageCost]
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)
    where: str = ""

    @property
    def predicted(self) -> float:
        """Seconds of the step's predicted communication (its slowest rank's)."""
        return max((r["predicted"] for r in self.ranks.values()), default=0.0)

    @property
    def measured(self) -> float:
        """Seconds of the step's measured communication (its slowest rank's)."""
        return max((r["measured"] for r in self.ranks.values()), default=0.0)

    @property
    def ratio(self) -> float:
        """``predicted / measured`` (1.0 is exact; nan without a measured time)."""
        return self.predicted / self.measured if self.measured else float("nan")

    @property
    def bytes(self) -> int:
        """The bytes of every message, as the trace counts them (= ``trace.bytes()``)."""
        return sum(r.bytes for r in self.rows)

    def by(self, what: str = "kind") -> dict[str, dict]:
        """Totals per ``kind`` or ``label``: ``{"messages", "bytes", "wire_bytes",
        "predicted", "measured"}`` (seconds summed over the messages, each once)."""
        if what not in ("kind", "label"):
            raise ValueError(f"what: 'kind' or 'label', got {what!r}")
        out: dict[str, dict] = {}
        for r in self.rows:
            d = out.setdefault(getattr(r, what), dict.fromkeys(
                ("messages", "bytes", "wire_bytes", "predicted", "measured"), 0))  # fmt: skip
            d["messages"] += 1
            d["bytes"] += r.bytes
            d["wire_bytes"] += r.wire_bytes
            d["predicted"] += r.predicted
            d["measured"] += r.measured or 0.0
        return out

    def table(self, by: str = "kind") -> str:
        """A text table: one line per ``kind`` (or ``label``), then one per rank and the step."""
        ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
        ratio = lambda p, m: f"{p / m:.2f}" if m else "-"  # noqa: E731
        head = (by, "messages", "bytes", "wire bytes", "predicted ms", "measured ms", "ratio")
        body = [
            (k, str(d["messages"]), str(d["bytes"]), f"{d['wire_bytes']:.0f}",
             ms(d["predicted"]), ms(d["measured"]), ratio(d["predicted"], d["measured"]))
            for k, d in sorted(self.by(by).items())
        ]  # fmt: skip
        body += [
            (f"rank {r}", "", "", "", ms(d["predicted"]), ms(d["measured"]),
             ratio(d["predicted"], d["measured"]))
            for r, d in sorted(self.ranks.items())
        ]  # fmt: skip
        body.append(("step", str(len(self.rows)), str(self.bytes), "", ms(self.predicted),
                     ms(self.measured), ratio(self.predicted, self.measured)))  # fmt: skip
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
        fmt = lambda row: "  ".join(  # noqa: E731
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        title = f"communication, predicted{' by ' + self.where if self.where else ''}"
        return "\n".join([title, fmt(head), *map(fmt, body)])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        ms = f"predicted {self.predicted * 1e3:.3f} ms, measured {self.measured * 1e3:.3f} ms"
        return f"Prediction({len(self.rows)} messages, {self.bytes} bytes, step {ms})"


def predict(trace, model) -> Prediction:
    """Each message's and the step's communication time by ``model``, beside the measured.

    Args:
        trace: a :class:`shardlab.trace.Trace` (or a list of its events) of one step,
            best from every rank (opened in the kernel around ``ranks.run``, or the ranks'
            events put together); or a list of traces of the same step run several times:
            each message's measured time is then its median over them (a step on a busy
            machine has outliers; the model was fitted to medians too).
        model: a :class:`~shardlab.cost.CostModel` (:func:`~shardlab.cost.calibrate`).

    Steps:

    1. pair the ranks' events into messages (:func:`~shardlab.cost.messages`);
    2. each message: the model's seconds for its kind, bytes and group size, and the
       measured seconds (:meth:`~shardlab.cost.Message.measured`);
    3. each rank: its events cut into runs in flight at once; a run costs its longest
       message; the rank's communication time is the sum over its runs;
    4. the step: its slowest rank.

    Communicates nothing (it reads the trace).
    """
    if model is None or not hasattr(model, "time"):
        raise TypeError(f"model: a shardlab.cost.CostModel, got {type(model).__name__}")
    steps = _steps(trace)
    events = steps[0]
    msgs, of = messages(events)
    measured = {m.key: [m.measured()] for m in msgs}
    for k, other in enumerate(steps[1:], 1):
        again, _ = messages(other)
        if {m.key: (m.kind, m.nbytes) for m in again} != {m.key: (m.kind, m.nbytes) for m in msgs}:
            raise ValueError(f"trace: step {k} of the list sends other messages than step 0")
        for m in again:
            measured[m.key].append(m.measured())
    rows, cost = [], {}
    for m in msgs:
        kind = "send" if m.kind == "p2p" else m.kind
        predicted = model.time(kind, m.nbytes, m.p)
        known = [t for t in measured[m.key] if t is not None]
        cost[id(m)] = (predicted, _median(known) if known else None)
        rows.append(MessageCost(m.kind, m.label, m.group, m.nbytes, m.bytes,
                                wire_bytes(kind, m.nbytes, m.p, model.algorithm(kind)),
                                predicted, cost[id(m)][1]))  # fmt: skip
    ranks = {}
    for rank in sorted({e.rank for e in events}):
        runs = in_flight_together([e for e in events if e.rank == rank])
        ranks[rank] = {
            "predicted": sum(max(cost[id(of[id(e)])][0] for e in run) for run in runs),
            "measured": sum(max(cost[id(of[id(e)])][1] or 0.0 for e in run) for run in runs),
            "in_calls": _median([_in_calls(step, rank) for step in steps]),
        }
    return Prediction(rows, ranks, getattr(model, "where", ""))


def _steps(trace) -> list[list]:
    """The events of each step: one trace (or a list of events), or a list of traces."""
    if isinstance(trace, (list, tuple)) and trace and hasattr(trace[0], "events"):
        return [list(t.events) for t in trace]
    if isinstance(trace, (list, tuple)) or hasattr(trace, "events"):
        return [list(getattr(trace, "events", trace))]
    raise TypeError(f"trace: a shardlab.trace.Trace or a list of them, got {type(trace).__name__}")


def _in_calls(events, rank) -> float:
    """Seconds ``rank`` had a message in flight (waiting for other ranks included)."""
    runs = in_flight_together([e for e in events if e.rank == rank])
    return sum(max((e.end or e.start + e.duration) for e in run) - run[0].start for run in runs)
