"""Shared by the figures: lazy imports, rank colours, byte formatting, new figures.

Nothing here imports matplotlib or ipywidgets at module import: each figure function calls
:func:`require_matplotlib` first, so ``import shardlab.viz`` stays cheap and works without them.
"""

from __future__ import annotations

import io

# matplotlib's tab10, spelled out so that no colour lookup needs matplotlib at import
TAB10 = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
PAD_COLOUR = "#d9d9d9"


def require_matplotlib():
    """The ``matplotlib`` module, or an ImportError that says how to install it."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401
        import matplotlib.patches  # noqa: F401
        import matplotlib.transforms  # noqa: F401
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("shardlab.viz needs matplotlib: pip install matplotlib") from exc
    return matplotlib


def require_ipywidgets():
    """The ``ipywidgets`` module, or an ImportError that says how to install it."""
    try:
        import ipywidgets
    except ImportError as exc:
        raise ImportError("shardlab.viz explorers need ipywidgets: pip install ipywidgets") from exc
    return ipywidgets


def rank_colour(rank: int) -> str:
    """tab10 colour of a rank (cycling after 10 ranks)."""
    return TAB10[rank % len(TAB10)]


def human_bytes(n: int | float) -> str:
    """``24 B``, ``1.5 KiB``, ``3.0 MiB``, ``2.0 GiB`` (powers of 1024).

    Example::

        viz.human_bytes(1536)      # '1.5 KiB'
    """
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def ranks_text(ranks) -> str:
    """``rank 3`` or ``ranks 0, 1, 2``."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def new_figure(figsize: tuple[float, float], ax=None):
    """``(figure, axes)``: ``ax``'s own figure if given, else a new pyplot-free Figure.

    A new figure is not registered with pyplot (no global state, nothing to close, no double
    display in notebooks); it shows itself in Jupyter through ``_repr_png_``.
    """
    require_matplotlib()
    if ax is not None:
        return ax.figure, ax
    fig = make_figure(figsize)
    return fig, fig.add_subplot()


def make_figure(figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    fig.get_layout_engine().set(w_pad=0.12, h_pad=0.08)
    FigureCanvasAgg(fig)
    fig._repr_png_ = lambda: figure_png(fig)  # Jupyter displays the returned figure
    fig._repr_html_ = lambda: wide_figure_html(fig)  # wider than a notebook: scroll
    return fig


NOTEBOOK_PX = 950


def wide_figure_html(fig) -> str | None:
    """A figure wider than a notebook's output (950 px) as a horizontally scrolling image
    at its own size (a long message timeline keeps readable labels instead of shrinking);
    None for narrower figures (Jupyter then shows the PNG)."""
    import base64

    if fig.get_figwidth() * fig.dpi <= NOTEBOOK_PX:
        return None
    data = base64.b64encode(figure_png(fig)).decode()
    return (
        "<div style='overflow-x:auto; max-width:100%'>"
        f"<img src='data:image/png;base64,{data}' style='max-width:none'></div>"
    )


def figure_png(fig, dpi: float | None = None) -> bytes:
    """The figure rendered as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def boundary_ticks(ax, axis: str, sizes, limit: int = 24) -> None:
    """Ticks at the piece boundaries along ``axis`` ('x' or 'y'), if not too many."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    bounds = sorted(set(bounds))
    if len(bounds) <= limit:
        (ax.set_xticks if axis == "x" else ax.set_yticks)(bounds)


def element_grid(ax, axis: str, lo: float, hi: float, limit: int = 64) -> None:
    """Light lines between elements along ``axis`` when there are few enough to count."""
    if hi - lo > limit or hi <= lo:
        return
    at = range(int(lo), int(hi) + 1)
    style = {"colors": "#bbbbbb", "lw": 0.4, "zorder": 0.5}
    if axis == "x":
        ax.vlines(at, 0, 1, transform=ax.get_xaxis_transform(), **style)
    else:
        ax.hlines(at, 0, 1, transform=ax.get_yaxis_transform(), **style)
