"""Shared by the viz tests: random shard sizes and reading back what a figure drew."""

from __future__ import annotations

import io

from matplotlib.artist import Artist
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle

from shardlab.viz._common import rank_colour


def composition(rng, total: int, parts: int) -> list[int]:
    """Random sizes >= 0 summing to ``total`` (zeros are common)."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def render(fig, dpi: int = 20) -> bytes:
    """Draw the whole figure with Agg (layout engine included); PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    data = buf.getvalue()
    assert data.startswith(b"\x89PNG")
    return data


def rectangles(ax, colour=None, hatch=None):
    """Rectangles of ``ax`` (optionally of one face colour, ignoring alpha, and hatch) as
    ``(x, y, width, height, front)``; ``front`` is False for a copy drawn with an offset."""
    out = []
    for p in ax.patches:
        if not isinstance(p, Rectangle):
            continue
        if colour is not None and to_rgb(p.get_facecolor()) != to_rgb(colour):
            continue
        if hatch is not None and p.get_hatch() != hatch:
            continue
        front = Artist.get_transform(p) is ax.transData
        out.append((p.get_x(), p.get_y(), p.get_width(), p.get_height(), front))
    return out


def rank_rectangles(ax, rank: int, hatch=None):
    return rectangles(ax, rank_colour(rank), hatch)
