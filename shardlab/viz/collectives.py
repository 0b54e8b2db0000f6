"""``plot_collectives``: a sequence diagram of a :class:`shardlab.trace.Trace`."""

from __future__ import annotations

from collections import Counter, defaultdict

from ._common import human_bytes, new_figure, rank_colour, require_matplotlib

__all__ = ["match_messages", "plot_collectives"]

KIND_COLOURS = {
    "all_reduce": "#fdd49e", "all_gather": "#c7e9c0", "reduce_scatter": "#c6dbef",
    "all_to_all": "#dadaeb", "broadcast": "#fcbba1", "scatter": "#fee391", "gather": "#d9f0a3",
    "reduce": "#fbb4b9", "barrier": "#e0e0e0",
}  # fmt: skip
P2P = ("send", "recv")


def match_messages(events):
    """``(pairs, unmatched)``: the k-th send from a to b pairs with the k-th recv on b from a.

    ``pairs`` is a list of ``(send, recv)``; ``unmatched`` the sends and recvs left over (a
    send to an untraced rank, a recv whose send is missing, a send without a peer).

    Example::

        pairs, unmatched = viz.match_messages(t.events)
        [(s.rank, r.rank, s.bytes) for s, r in pairs]    # (from, to, bytes) per message
    """
    sends, recvs = defaultdict(list), defaultdict(list)
    unmatched = []
    for e in sorted(events, key=lambda e: (e.rank, e.seq)):
        if e.kind not in P2P or e.peer is None:
            unmatched += [e] if e.kind in P2P else []
            continue
        pair = (e.rank, e.peer) if e.kind == "send" else (e.peer, e.rank)
        (sends if e.kind == "send" else recvs)[pair].append(e)
    pairs = []
    for key in sorted(set(sends) | set(recvs)):
        s, r = sends.get(key, []), recvs.get(key, [])
        pairs += list(zip(s, r))
        unmatched += s[len(r) :] + r[len(s) :]
    return pairs, unmatched


def _instances(per_rank):
    """Collective calls across ranks: the k-th call of (kind, group) on each member."""
    seen, out = Counter(), defaultdict(list)
    for rank, evs in per_rank.items():
        for e in evs:
            if e.kind not in P2P:
                key = (e.kind, tuple(e.group))
                out[key + (seen[rank, key],)].append(e)
                seen[rank, key] += 1
    return list(out.values())


def _columns(per_rank, instances, pairs):
    """Event order as columns: after the rank's previous event, a collective's calls in one
    column, a recv after its send. Constraints that cycle are dropped (p2p, then collectives)."""
    for use_coll, use_p2p in ((True, True), (True, False), (False, False)):
        col = {id(e): i for evs in per_rank.values() for i, e in enumerate(evs)}
        n = len(col)
        for _ in range(n + 2):
            changed = False
            for evs in per_rank.values():
                for a, b in zip(evs, evs[1:]):
                    if col[id(b)] < col[id(a)] + 1:
                        col[id(b)], changed = col[id(a)] + 1, True
            for inst in instances if use_coll else ():
                top = max(col[id(e)] for e in inst)
                for e in inst:
                    if col[id(e)] < top:
                        col[id(e)], changed = top, True
            for s, r in pairs if use_p2p else ():
                if col[id(r)] < col[id(s)] + 1:
                    col[id(r)], changed = col[id(s)] + 1, True
            if not changed:
                return col
    raise AssertionError("per-rank order alone never cycles")


def plot_collectives(trace, *, by="seq", ax=None, max_events=200, title=None):
    """Draw a trace as a sequence diagram: one lane per rank, order (``by="seq"``) or time
    (``by="time"``: start and duration, in ms) along x.

    Point-to-point messages are arrows from the send to its recv (the k-th send from a to b
    pairs with the k-th recv on b from a); a send or recv without its partner is a dashed
    stub marked "unmatched". Collectives are boxes spanning the lanes of their group (the k-th
    call of a kind on a group, on each member), labelled with kind, bytes per rank and the
    cause label. Only the first ``max_events`` events are drawn.

    The figure carries ``shardlab_arrows`` (``(src, dst, bytes)`` per matched message),
    ``shardlab_dangling`` (``(src, dst, bytes, "send" | "recv")``), ``shardlab_collectives``
    (``(kind, group, ranks seen)``) and ``shardlab_lanes``.

    Example::

        with shardlab.trace() as t:          # in the kernel: every rank's events come back
            ranks.run(step)
        viz.plot_collectives(t)
    """
    if by not in ("seq", "time"):
        raise ValueError(f"by must be 'seq' or 'time', got {by!r}")
    everything = list(getattr(trace, "events", trace))
    order = (lambda e: (e.start, e.rank, e.seq)) if by == "time" else (lambda e: (e.seq, e.rank))
    events = sorted(everything, key=order)[: max(int(max_events), 0)]
    require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    lanes = sorted(
        {e.rank for e in events}
        | {g for e in events for g in e.group}
        | {e.peer for e in events if e.peer is not None}
    )
    lane = {r: i for i, r in enumerate(lanes)}
    per_rank = defaultdict(list)
    for e in sorted(events, key=lambda e: (e.rank, e.seq)):
        per_rank[e.rank].append(e)
    instances = _instances(per_rank)
    pairs, unmatched = match_messages(events)
    if by == "seq":
        col = _columns(per_rank, instances, pairs)
        span = {id(e): (col[id(e)] - 0.35, col[id(e)] + 0.35) for e in events}
        ends = {id(e): (col[id(e)], col[id(e)]) for e in events}  # where arrows leave / arrive
        extent, step = (max(col.values(), default=0) + 1), 0.6
    else:
        t0 = min((e.start for e in events), default=0.0)
        last = max((e.start + e.duration - t0 for e in events), default=0.0) * 1e3
        least = max(last, 1e-3) * 0.006
        span = {}
        for e in events:
            a = (e.start - t0) * 1e3
            span[id(e)] = (a, a + max(e.duration * 1e3, least))
        ends = {id(e): (span[id(e)][0], span[id(e)][1]) for e in events}
        extent, step = max(last, 1e-3), max(last, 1e-3) * 0.06

    width = min(max(1.6 * extent + 2.5, 6.0), 24.0) if by == "seq" else 9.0
    fig, ax = new_figure((width, 1.4 + 0.75 * max(len(lanes), 1)), ax)
    for r, i in lane.items():
        ax.axhline(i, color=rank_colour(r), lw=0.8, alpha=0.5, zorder=0)
    small = by == "seq" and extent > 40  # too many columns for text in every box

    collectives = []
    slots = _slots(instances, span, lane) if by == "seq" else {}
    for inst in instances:
        e0 = inst[0]
        members = sorted({lane[g] for g in e0.group} | {lane[e.rank] for e in inst})
        a = min(span[id(e)][0] for e in inst)
        b = max(span[id(e)][1] for e in inst)
        if id(inst) in slots:  # several calls overlap in this column: side by side
            k, n = slots[id(inst)]
            a, b = a + (b - a) * k / n, a + (b - a) * (k + 1) / n
        colour = KIND_COLOURS.get(e0.kind, "#eeeeee")
        runs = _runs(members)
        for lo, hi in runs:
            ax.add_artist(
                Rectangle(
                    (a, lo - 0.3), b - a, hi - lo + 0.6, fc=colour, ec="#555555", lw=0.9, zorder=2
                )
            )
        if len(runs) > 1:
            ax.plot(
                [(a + b) / 2] * 2,
                [members[0], members[-1]],
                ls="--",
                color="#555555",
                lw=0.8,
                zorder=1.5,
            )
        amounts = sorted({e.bytes for e in inst})
        size = human_bytes(amounts[0])
        if len(amounts) > 1:
            size = f"{size}–{human_bytes(amounts[-1])}"
        narrow = id(inst) in slots
        text = f"{e0.kind}\n{size}" + ("/rank" if len(e0.group) > 1 and not narrow else "")
        text += f"\n{e0.label}" if e0.label else ""
        if len(runs) > 1:
            text += "\n{" + ",".join(map(str, e0.group)) + "}"
        for lo, hi in runs if not small else ():
            ax.text(
                (a + b) / 2,
                (lo + hi) / 2,
                text,
                ha="center",
                va="center",
                fontsize=7,
                zorder=3,
                clip_on=True,
            )
        collectives.append((e0.kind, tuple(e0.group), len(inst)))

    labels = {s.label for s, _ in pairs}
    shared = labels.pop() if len(labels) == 1 else ""  # one cause: said once, in the legend
    arrows = []
    for s, r in pairs:
        x0, y0 = ends[id(s)][0], lane[s.rank]
        x1, y1 = ends[id(r)][1], lane[r.rank]
        _arrow(ax, FancyArrowPatch, (x0, y0), (x1, y1), rank_colour(s.rank), "-")
        ax.plot([x0], [y0], "o", color=rank_colour(s.rank), ms=5, zorder=4)
        ax.plot([x1], [y1], "s", color=rank_colour(s.rank), ms=4, zorder=4)
        text = human_bytes(s.bytes) + (f"\n{s.label}" if s.label and not shared else "")
        if not small:
            ax.text(
                x0 + 0.4 * (x1 - x0),  # not the middle: a ring's arrows cross there
                y0 + 0.4 * (y1 - y0),
                text,
                fontsize=7,
                ha="center",
                va="center",
                zorder=6,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
            )
        arrows.append((s.rank, r.rank, s.bytes))

    dangling = []
    for e in unmatched:
        x, y = ends[id(e)][0 if e.kind == "send" else 1], lane[e.rank]
        ax.plot([x], [y], "o" if e.kind == "send" else "s", color=rank_colour(e.rank), ms=5)
        src, dst = (e.rank, e.peer) if e.kind == "send" else (e.peer, e.rank)
        if e.peer is not None and e.peer != e.rank:
            other = (x + step, lane[e.peer]) if e.kind == "send" else (x - step, lane[e.peer])
            pts = ((x, y), other) if e.kind == "send" else (other, (x, y))
            _arrow(ax, FancyArrowPatch, *pts, "#d62728", "--")
            ax.text(*other, "unmatched", fontsize=7, color="#d62728", ha="center", va="bottom")
        dangling.append((src, dst, e.bytes, e.kind))

    ax.set_ylim(len(lanes) - 0.4, -0.6)
    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes])
    for label, r in zip(ax.get_yticklabels(), lanes):
        label.set_color(rank_colour(r))
    if by == "seq":
        ax.set_xlim(-0.6, extent - 0.4)
        ax.set_xlabel("event order (each rank's calls left to right)")
        ax.set_xticks(range(int(extent)) if extent <= 40 else [])
    else:
        ax.set_xlim(-step / 2, extent + step / 2)
        ax.set_xlabel("time since the first call (ms)")
    ax.tick_params(labelsize=8)
    kinds = [k for k in KIND_COLOURS if any(c[0] == k for c in collectives)]
    kinds += sorted({c[0] for c in collectives} - set(kinds))
    handles = [Patch(fc=KIND_COLOURS.get(k, "#eeeeee"), ec="#555555", label=k) for k in kinds]
    message = "send → recv" + (f": {shared}" if shared else " (message)")
    handles.append(Line2D([], [], color="#555555", marker="o", label=message))
    if dangling:
        handles.append(Line2D([], [], color="#d62728", ls="--", label="unmatched send / recv"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    counts = Counter(e.kind for e in events)
    auto = f"{len(everything)} events on ranks {lanes}: " + ", ".join(
        f"{k} ×{n}" for k, n in sorted(counts.items())
    )
    if len(events) < len(everything):
        auto += f"\n(first {len(events)} of {len(everything)} events drawn)"
    ax.set_title(auto if title is None else title, fontsize=10)
    fig.shardlab_arrows = arrows
    fig.shardlab_dangling = dangling
    fig.shardlab_collectives = collectives
    fig.shardlab_lanes = lanes
    return fig


def _slots(instances, span, lane):
    """Calls drawn in the same column whose lane ranges overlap get side-by-side slots:
    ``{id(instance): (slot, slots in its column)}`` for those columns only."""
    by_column = defaultdict(list)
    for inst in instances:
        lanes = [lane[g] for g in inst[0].group] + [lane[e.rank] for e in inst]
        by_column[min(span[id(e)][0] for e in inst)].append((min(lanes), max(lanes), inst))
    out = {}
    for column in by_column.values():
        ends: list[int] = []  # last lane used by each slot
        placed = []
        for lo, hi, inst in sorted(column, key=lambda c: c[:2]):
            k = next((i for i, end in enumerate(ends) if end < lo), len(ends))
            ends[k : k + 1] = [hi]
            placed.append((k, inst))
        if len(ends) > 1:
            out.update({id(inst): (k, len(ends)) for k, inst in placed})
    return out


def _runs(sorted_lanes):
    """Consecutive lane indices as ``(first, last)`` runs: [0, 1, 3] -> [(0, 1), (3, 3)]."""
    runs = []
    for i in sorted_lanes:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _arrow(ax, cls, start, stop, colour, style):
    ax.add_artist(
        cls(
            start,
            stop,
            arrowstyle="-|>",
            mutation_scale=12,
            lw=1.3,
            color=colour,
            linestyle=style,
            zorder=5,
            shrinkA=3,
            shrinkB=3,
        )
    )
