"""``plot_halos``: what each rank owns, receives and pads for a sharded window op.

All halo geometry comes from :func:`shardlab.layout.conv_plan` / :func:`conv_plan_nd`; this module
only draws it.
"""

from __future__ import annotations

from shardlab.layout import conv_plan, conv_plan_nd, offsets

from ._common import (
    PAD_COLOUR,
    boundary_ticks,
    element_grid,
    human_bytes,
    new_figure,
    rank_colour,
    require_matplotlib,
)

__all__ = ["plot_halos", "sent_amounts"]

BAR = 0.32  # half height of a lane's bars
PAD_LABEL = {"zeros": "0", "circular": "wrap", "reflect": "refl", "replicate": "repl"}


def _plan(sizes, kernel_size, stride, dilation, padding, padding_mode, transposed, sizes_w):
    if isinstance(padding, list):
        padding = tuple(padding)
    args = dict(padding_mode=padding_mode, transposed=transposed)
    if sizes_w is None:
        return conv_plan(list(sizes), kernel_size, stride, dilation, padding, **args)
    both = padding if isinstance(padding, (int, str)) else [padding, padding]
    return conv_plan_nd([list(sizes), list(sizes_w)], kernel_size, stride, dilation, both, **args)


def sent_amounts(plan) -> dict[int, int]:
    """Rows (1-D plan) or elements per plane (2-D plan) each rank sends, by rank number."""
    if hasattr(plan, "plans"):
        return {r: plan.elements_sent(c) for r, c in enumerate(plan.coords())}
    return {r: plan.bytes_per_element_sent(r) for r in range(len(plan.in_sizes))}


def plot_halos(
    sizes,
    kernel_size,
    stride=1,
    dilation=1,
    padding=0,
    padding_mode="zeros",
    *,
    transposed=False,
    sizes_w=None,
    bytes_per_row=None,
    ax=None,
    title=None,
):
    """Draw the halo exchange of a window op (conv, pooling, conv-transpose) on sharded input.

    1-D (``sizes``: shard sizes along the sharded dim): one lane per rank with its own rows
    (solid), the rows it receives (hatched, in the sender's colour, an arrow from the sender,
    from further ranks when the halo is wider than a shard), the padding its window reads at
    the domain edges (grey; wrapped / reflected copies for circular / reflect / replicate), its
    window (dotted outline) and what it sends. 2-D (``sizes_w``: shard sizes of a second sharded
    dim, mesh ``len(sizes) x len(sizes_w)``): one panel per rank over the global H x W plane,
    edges and corners in their sender's colour; ``padding`` then applies to both dims.

    ``padding``: int, ``(left, right)``, ``'same'`` or ``'valid'``. ``bytes_per_row``: bytes of
    one input row (product of the other dims x itemsize) to label bytes as well as rows.
    The figure carries ``shardlab_halos``: ``(dst, src, start, stop)`` per received run (2-D:
    ``(dst, src, (h0, h1), (w0, w1))``, ranks row-major), ``shardlab_sent`` (rows / elements
    sent per rank) and ``shardlab_plan``.

    Communicates nothing: the plan is computed from the sizes (``shardlab.layout.conv_plan``),
    the same plan the sharded convolution follows.

    Example::

        viz.plot_halos([5, 5, 4, 4], kernel_size=3, padding="same")       # 1-D, 4 ranks
        viz.plot_halos([6, 6], 5, padding=2, sizes_w=[4, 4])               # 2 x 2 ranks
    """
    plan = _plan(sizes, kernel_size, stride, dilation, padding, padding_mode, transposed, sizes_w)
    require_matplotlib()
    if sizes_w is None:
        fig, ax = _plot_1d(plan, bytes_per_row, ax)
    else:
        from ._halos_2d import plot_2d

        fig = plot_2d(plan, bytes_per_row, ax)
    p = plan if sizes_w is None else plan.plans[0]
    op = "conv_transpose" if transposed else "conv / pool"
    pad = p.padding if sizes_w is None else tuple(q.padding for q in plan.plans)
    auto = (
        f"{op}: kernel {kernel_size}, stride {stride}, dilation {dilation}, padding {pad} "
        f"{padding_mode}\n" + _sizes_text(plan)
    )
    if sizes_w is None:
        ax.set_title(auto if title is None else title, fontsize=10)
    else:
        fig.suptitle(auto if title is None else title, fontsize=10)
    fig.shardlab_plan = plan
    fig.shardlab_sent = sent_amounts(plan)
    return fig


def _sizes_text(plan) -> str:
    if hasattr(plan, "plans"):
        ins = " × ".join(str(list(p.in_sizes)) for p in plan.plans)
        outs = " × ".join(str(list(p.out_sizes)) for p in plan.plans)
        return f"input sizes {ins} → output sizes {outs}"
    return f"input sizes {list(plan.in_sizes)} → output sizes {list(plan.out_sizes)}"


def sent_text(n: int, unit: str, bytes_per_unit) -> str:
    text = f"sends {n} {unit}{'' if n == 1 else 's'}"
    return text + (f" = {human_bytes(n * bytes_per_unit)}" if bytes_per_unit else "")


def window_in_input(p, r) -> tuple[int, int]:
    """Rank r's window as input indices (forward windows are in padded positions)."""
    w0, w1 = p.window(r)
    shift = 0 if p.transposed else p.padding[0]
    return w0 - shift, w1 - shift


def _plot_1d(plan, bytes_per_row, ax):
    """One lane per rank. Patches go in with add_artist: no autoscaling (limits are set)."""
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    sizes = plan.in_sizes
    nranks, length = len(sizes), sum(sizes)
    starts = offsets(sizes)
    own_figure = ax is None
    fig, ax = new_figure((9.0, 1.6 + 0.75 * nranks), ax)
    halos, lo, hi = [], 0, length
    mode = "zeros" if plan.transposed else plan.padding_mode
    for r in range(nranks):
        y = r
        ax.add_artist(Rectangle((0, y - BAR), length, 2 * BAR, fc="none", ec="#999999", lw=0.6))
        if sizes[r]:
            own = Rectangle((starts[r], y - BAR), sizes[r], 2 * BAR, fc=rank_colour(r), alpha=0.5)
            ax.add_artist(own)
            ax.add_artist(
                Rectangle((starts[r], y - BAR), sizes[r], 2 * BAR, fc="none", ec=rank_colour(r))
            )
        for src, start, stop in plan.recvs(r):
            halos.append((r, src, start, stop))
            ax.add_artist(
                Rectangle(
                    (start, y - BAR),
                    stop - start,
                    2 * BAR,
                    fc=rank_colour(src),
                    ec="black",
                    hatch="///",
                    lw=0.8,
                    zorder=3,
                )
            )
            x = (start + stop) / 2
            ax.text(
                x,
                y,
                f"r{src}",
                ha="center",
                va="center",
                fontsize=7,
                zorder=4,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"},
            )
            y0 = src + (BAR if src < r else -BAR)
            y1 = r - (BAR if src < r else -BAR)
            ax.add_artist(
                FancyArrowPatch(
                    (x, y0),
                    (x, y1),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    lw=1.2,
                    color=rank_colour(src),
                    alpha=0.8,
                    zorder=5,
                )
            )
        if plan.out_sizes[r]:
            i0, i1 = window_in_input(plan, r)
            lo, hi = min(lo, i0), max(hi, i1)
            for a, b in ((i0, min(i1, 0)), (max(i0, length), i1)):
                if b > a:
                    ax.add_artist(
                        Rectangle(
                            (a, y - BAR),
                            b - a,
                            2 * BAR,
                            fc=PAD_COLOUR,
                            ec="#777777",
                            hatch="xx" if mode == "zeros" else "..",
                            lw=0.8,
                            zorder=3,
                        )
                    )
                    ax.text(
                        (a + b) / 2,
                        y,
                        PAD_LABEL[mode],
                        ha="center",
                        va="center",
                        fontsize=6,
                        zorder=4,
                        rotation=90 if b - a < 2 else 0,
                    )
            ax.add_artist(
                Rectangle(
                    (i0, y - BAR - 0.08),
                    i1 - i0,
                    2 * BAR + 0.16,
                    fc="none",
                    ec="black",
                    ls=":",
                    lw=1.0,
                    zorder=6,
                )
            )
    for r in range(nranks):
        sends = plan.sends(r)
        rows = sum(b - a for _, a, b in sends)
        to = ", ".join(f"→r{d}: {b - a}" for d, a, b in sends)
        out0, out1 = plan.out_range(r)
        lines = [sent_text(rows, "row", bytes_per_row) + (f" ({to})" if to else "")]
        lines.append(f"computes out [{out0}, {out1})" if out1 > out0 else "computes nothing")
        ax.text(
            hi + 0.7,
            r,
            "\n".join(lines),
            va="center",
            ha="left",
            fontsize=8,
            color=rank_colour(r),
            clip_on=False,
        )
    ax.set_xlim(lo - 0.5, hi + 0.5)
    ax.set_ylim(nranks - 0.4, -0.6)
    ax.set_yticks(range(nranks), [f"rank {r}\nowns {sizes[r]}" for r in range(nranks)])
    for label, r in zip(ax.get_yticklabels(), range(nranks)):
        label.set_color(rank_colour(r))
    boundary_ticks(ax, "x", sizes)
    element_grid(ax, "x", lo, hi)
    ax.set_xlabel("input index along the sharded dim (shard boundaries ticked)")
    ax.tick_params(labelsize=8)
    handles = [
        Patch(fc="#cccccc", ec="#555555", label="own rows (rank colour)"),
        Patch(fc="white", ec="black", hatch="///", label="received halo (sender colour)"),
        Patch(
            fc=PAD_COLOUR,
            ec="#777777",
            hatch="xx" if mode == "zeros" else "..",
            label=f"padding ({mode})",
        ),
        Patch(fc="none", ec="black", ls=":", label="window read"),
    ]
    if own_figure:
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    else:
        ax.legend(handles=handles, fontsize=7)
    fig.shardlab_halos = halos
    return fig, ax
