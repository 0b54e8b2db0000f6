"""The 2-D (two sharded dims) panel grid of :func:`shardlab.viz.plot_halos`."""

from __future__ import annotations

from shardlab.layout import offsets

from ._common import PAD_COLOUR, boundary_ticks, make_figure, rank_colour
from .halos import sent_text, window_in_input


def plot_2d(plan, bytes_per_row, ax):
    from matplotlib.patches import Patch, Rectangle

    ph, pw = plan.plans
    nh, nw = plan.mesh_shape
    height, width = sum(ph.in_sizes), sum(pw.in_sizes)
    if ax is None:
        fig = make_figure((min(2.9 * nw + 1.2, 16), min(2.6 * nh + 1.4, 14)))
        grid = fig.add_gridspec(nh, nw)
    else:
        if ax.get_subplotspec() is None:
            raise ValueError("a 2-D plot_halos needs ax from a grid (fig.add_subplot / subplots)")
        fig, grid = ax.figure, ax.get_subplotspec().subgridspec(nh, nw)
        ax.remove()
    hs, ws = offsets(ph.in_sizes), offsets(pw.in_sizes)
    halos, windows = [], {}
    for i, j in plan.coords():
        if ph.out_sizes[i] and pw.out_sizes[j]:
            windows[i, j] = (window_in_input(ph, i), window_in_input(pw, j))
    lo_h = min([0] + [w[0][0] for w in windows.values()])
    hi_h = max([height] + [w[0][1] for w in windows.values()])
    lo_w = min([0] + [w[1][0] for w in windows.values()])
    hi_w = max([width] + [w[1][1] for w in windows.values()])
    mode = "zeros" if ph.transposed else ph.padding_mode
    for rank, (i, j) in enumerate(plan.coords()):
        sub = fig.add_subplot(grid[i, j])
        if (i, j) in windows:
            (a0, a1), (b0, b1) = windows[i, j]
            sub.add_artist(
                Rectangle(
                    (b0, a0),
                    b1 - b0,
                    a1 - a0,
                    fc=PAD_COLOUR,
                    ec="black",
                    ls=":",
                    hatch="xx" if mode == "zeros" else "..",
                    zorder=1,
                )
            )
        sub.add_artist(Rectangle((0, 0), width, height, fc="white", ec="#999999", zorder=1.5))
        for q, (qi, qj) in enumerate(plan.coords()):
            box = (ws[qj], hs[qi]), pw.in_sizes[qj], ph.in_sizes[qi]
            if q == rank:
                sub.add_artist(Rectangle(*box, fc=rank_colour(q), alpha=0.55, zorder=2))
            sub.add_artist(Rectangle(*box, fc="none", ec="#bbbbbb", lw=0.6, zorder=2.5))
        for b in plan.recvs((i, j)):
            src = b.src[0] * nw + b.src[1]
            (h0, h1), (w0, w1) = b.box
            halos.append((rank, src, (h0, h1), (w0, w1)))
            sub.add_artist(
                Rectangle(
                    (w0, h0),
                    w1 - w0,
                    h1 - h0,
                    fc=rank_colour(src),
                    ec="black",
                    hatch="///",
                    lw=0.7,
                    zorder=3,
                )
            )
        if (i, j) in windows:
            sub.add_artist(
                Rectangle(
                    (b0, a0), b1 - b0, a1 - a0, fc="none", ec="black", ls=":", lw=1.0, zorder=4
                )
            )
        sent = plan.elements_sent((i, j))
        sub.set_title(
            f"rank {rank} {(i, j)}: {sent_text(sent, 'element', bytes_per_row)}",
            fontsize=8,
            color=rank_colour(rank),
        )
        sub.set_xlim(lo_w - 0.5, hi_w + 0.5)
        sub.set_ylim(hi_h + 0.5, lo_h - 0.5)
        boundary_ticks(sub, "x", pw.in_sizes)
        boundary_ticks(sub, "y", ph.in_sizes)
        sub.tick_params(labelsize=7)
        sub.set_aspect("equal", adjustable="box")
    handles = [Patch(fc=rank_colour(r), label=f"rank {r}") for r in range(nh * nw)]
    handles += [
        Patch(fc="white", ec="black", hatch="///", label="received (sender colour)"),
        Patch(
            fc=PAD_COLOUR,
            ec="black",
            hatch="xx" if mode == "zeros" else "..",
            label=f"padding ({mode})",
        ),
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 6),
        fontsize=8,
        frameon=False,
    )
    fig.shardlab_halos = halos
    return fig
