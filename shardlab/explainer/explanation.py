"""What :func:`shardlab.explain` returns: :class:`ModuleRecord` rows per rank, and the
:class:`Explanation` that shows them (text table, HTML, JSON, figure). Plain data:
picklable, drawn without any process group."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["Explanation", "ModuleRecord"]


@dataclass
class ModuleRecord:
    """One module, one phase, one rank: a row of an :class:`Explanation`.

    Attributes:
        name: the module's qualified name in the model (``"encoder.layer.0"``).
        kind: the module's class name.
        phase: ``"forward"`` or ``"backward"``.
        order: call order (forward) or the order its first autograd node ran (backward).
        depth: nesting depth in the model.
        inputs: the input layouts, e.g. ``"(2, 3, 32, 32) Shard(2) [9, 8, 8, 7]"``.
        outputs: the output layouts.
        events: ``(kind, bytes, peer, mesh_dim, label)`` of each message and collective
            the module caused.
        seconds: its time on this rank.
        peak_bytes: its peak memory, or None when not measured (``memory=False``).
    """

    name: str
    kind: str  # the module's class name
    phase: str  # "forward" or "backward"
    order: int  # call order (forward) / first node run (backward)
    depth: int
    inputs: list[str] = field(default_factory=list)  # layouts, e.g. "Shard(2) [9, 8, 8, 7]"
    outputs: list[str] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)  # (kind, bytes, peer, mesh_dim, label)
    seconds: float = 0.0
    peak_bytes: int | None = 0  # None: not measured (``memory=False``)

    @property
    def bytes_received(self) -> int:
        """The bytes this rank received in this module (its ``recv`` messages plus the
        payloads of its collectives)."""
        return sum(b for k, b, *_ in self.events if k == "recv") + sum(
            b for k, b, *_ in self.events if k not in ("send", "recv")
        )

    @property
    def gathers(self) -> list[str]:
        """The ops that gathered a whole tensor onto this rank in this module because no
        rule covers their layout (``whole-tensor fallback for <op>``), each once, in
        order."""
        out: list[str] = []
        for *_, lab in self.events:
            for cause in _GATHERS:
                if lab.startswith(cause) and lab[len(cause) :] not in out:
                    out.append(lab[len(cause) :])
        return out


_GATHERS = ("whole-tensor fallback for ",)


def _mib(peaks):
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2**20 if peaks else "-"


def _cell(c) -> str:
    return f"{c:.2f}" if isinstance(c, float) else str(c)


@dataclass
class Explanation:
    """Per rank, per module and phase: :class:`ModuleRecord` rows (``ranks[r]``).

    What :func:`shardlab.explain` returns. Plain data (picklable, drawn without a process
    group): :meth:`table` (text; HTML in notebooks), :meth:`to_json`, :meth:`plot`,
    :meth:`totals`.

    Example::

        ex = ranks.run(step)[0]          # step() returns shardlab.explain(model, x)
        print(ex.table())
        ex.totals(rank=1)                # {'messages': 12, 'collectives': 3, 'bytes': ...}
        ex.plot()
    """

    ranks: list[list[ModuleRecord]]

    def rows(self, rank: int = 0) -> list[ModuleRecord]:
        """The :class:`ModuleRecord` rows of rank ``rank``, in call order."""
        return self.ranks[rank]

    def totals(self, rank: int) -> dict:
        """Messages, collectives and bytes of rank ``rank`` over every module."""
        ev = [e for r in self.ranks[rank] for e in r.events]
        return {
            "messages": sum(1 for e in ev if e[0] in ("send", "recv")),
            "collectives": sum(1 for e in ev if e[0] not in ("send", "recv")),
            "bytes": sum(e[1] for e in ev),
        }

    def gathers(self) -> dict[str, list[str]]:
        """``{module name: [op, ...]}``: where, on any rank, an op gathered a whole tensor
        because no rule covers its layout (see :class:`shardlab.GatherWarning`)."""
        out: dict[str, list[str]] = {}
        for rows in self.ranks:
            for r in rows:
                for op in r.gathers:
                    ops = out.setdefault(r.name, [])
                    if op not in ops:
                        ops.append(op)
        return out

    def _summary(self):
        """(name, kind, phase, in, out, collectives, messages, max bytes, max ms, max MiB)."""
        out = []
        for i, r in enumerate(self.ranks[0]):
            same = [rows[i] for rows in self.ranks if i < len(rows)]
            counts: dict = {}
            for e in r.events:
                if e[0] not in ("send", "recv"):
                    counts[e[0]] = counts.get(e[0], 0) + 1
            out.append(
                (
                    "  " * (r.depth - 1) + r.name.rsplit(".", 1)[-1],
                    r.kind,
                    r.phase,
                    "; ".join(r.inputs[:2]),
                    "; ".join(r.outputs[:1]),
                    ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
                    max(sum(1 for e in x.events if e[0] in ("send", "recv")) for x in same),
                    max(sum(e[1] for e in x.events) for x in same),
                    1e3 * max(x.seconds for x in same),
                    _mib(x.peak_bytes for x in same),
                )
            )
        return out

    HEAD = (
        "module",
        "type",
        "phase",
        "inputs",
        "output",
        "collectives",
        "msgs",
        "bytes",
        "ms",
        "MiB",
    )

    def table(self, width: int = 48) -> str:
        """Text: one line per module and phase (numbers: max over ranks)."""
        lines = [" | ".join(self.HEAD)]
        for row in self._summary():
            cells = [_cell(c)[:width] for c in row]
            lines.append(" | ".join(cells))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{h}</th>" for h in self.HEAD)
        body = "".join(
            "<tr>"
            + "".join(f"<td style='text-align:left'>{html.escape(_cell(c))}</td>" for c in row)
            + "</tr>"
            for row in self._summary()
        )
        return f"<table><tr>{head}</tr>{body}</table>"

    def to_json(self) -> str:
        """``{"ranks": [[row, ...], ...]}``: every :class:`ModuleRecord` as an object."""
        return json.dumps({"ranks": [[asdict(r) for r in rows] for rows in self.ranks]})

    def plot(self, ax=None, max_rows: int | None = None):
        """Modules down, ranks across: bytes each rank moved per module and phase
        (colour, log scale), the count of messages / collectives written in each cell."""
        import numpy as np

        from shardlab.viz._common import make_figure

        rows = self.ranks[0][:max_rows]
        n = len(self.ranks)
        data = np.zeros((len(rows), n))
        text = [["" for _ in range(n)] for _ in rows]
        for i in range(len(rows)):
            for r in range(n):
                rec = self.ranks[r][i]
                data[i, r] = sum(e[1] for e in rec.events)
                msgs = sum(1 for e in rec.events if e[0] in ("send", "recv"))
                coll = len(rec.events) - msgs
                text[i][r] = (f"{msgs}m " if msgs else "") + (f"{coll}c" if coll else "")
        if ax is None:  # drawn at the size a notebook shows it (950 px wide), text >= 9 px
            fig = make_figure((9.5, 1.0 + 0.24 * len(rows)))  # shows itself in Jupyter
            ax = fig.add_subplot()
        im = ax.imshow(np.log10(data + 1), aspect="auto", cmap="Blues")
        for i in range(len(rows)):
            for r in range(n):
                if text[i][r]:
                    ax.text(r, i, text[i][r], ha="center", va="center", fontsize=8)
        ax.set_yticks(
            range(len(rows)),
            [f"{'.'.join(x.name.split('.')[-2:])} ({x.phase[0]})" for x in rows],
            fontsize=8,
        )
        ax.set_xticks(range(n), [f"rank {r}" for r in range(n)], fontsize=9)
        ax.xaxis.tick_top()
        ax.figure.colorbar(im, ax=ax, label="log10(bytes + 1)", fraction=0.04)
        ax.set_title("bytes per module and rank (m: messages, c: collectives)", fontsize=10)
        return ax.figure
