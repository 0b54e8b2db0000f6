"""``plot_placements``: which rank holds which block of a global tensor."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Shard

from shardlab.layout import ShardLayout, format_sizes

from ._common import (
    boundary_ticks,
    element_grid,
    new_figure,
    rank_colour,
    ranks_text,
    require_matplotlib,
)

__all__ = ["as_layout", "plot_placements", "shown_dims"]

STACK_POINTS = 6.0  # display offset between stacked copies of a replicated block


def as_layout(obj=None, *, mesh_shape=None, placements=None, global_shape=None, sizes=None):
    """A :class:`ShardLayout` from a layout, a ShardTensor (its ``.sharding``), a DTensor, a tensor
    plus ``mesh_shape`` and ``placements``, or ``mesh_shape`` + ``placements`` +
    ``global_shape`` (+ ``sizes``).

    Example::

        viz.as_layout(mesh_shape=(2, 2), placements=[Shard(0), Replicate()],
                      global_shape=(6, 4), sizes=[[4, 2], None])
    """
    explicit = mesh_shape is not None or placements is not None or global_shape is not None
    layout = obj if isinstance(obj, ShardLayout) else getattr(obj, "sharding", None)
    if isinstance(layout, ShardLayout):
        if explicit:
            raise TypeError(
                "give either a layout (or a ShardTensor) or mesh_shape/placements/"
                "global_shape, not both"
            )
        return layout if sizes is None else layout.with_sizes(sizes)
    if obj is not None and hasattr(obj, "device_mesh") and hasattr(obj, "placements"):
        mesh, places = obj.device_mesh.shape, obj.placements  # a DTensor
        return ShardLayout.build(tuple(obj.shape), tuple(mesh), tuple(places), sizes)
    if obj is not None and hasattr(obj, "shape") and global_shape is None:
        global_shape = tuple(obj.shape)  # a plain tensor with an explicit mesh and placements
    elif obj is not None:
        raise TypeError(
            f"cannot draw a {type(obj).__name__}: pass a ShardLayout, a ShardTensor, "
            "a DTensor, or mesh_shape=, placements= and global_shape="
        )
    if mesh_shape is None or placements is None or global_shape is None:
        raise TypeError("mesh_shape, placements and global_shape are all needed without a layout")
    return ShardLayout.build(global_shape, mesh_shape, placements, sizes)


def shown_dims(layout: ShardLayout, dims: Sequence[int] | None = None) -> tuple[int, ...]:
    """The tensor dims drawn: 0 (a scalar), 1 (a single row) or 2 (rows, columns)."""
    ndim = len(layout.global_shape)
    if dims is not None:
        dims = tuple(dims)
        if not 1 <= len(dims) <= 2 or any(not -ndim <= d < ndim for d in dims):
            raise ValueError(f"dims must be one or two dims of a {ndim}-d tensor, got {dims}")
        dims = tuple(d % ndim for d in dims)
        if len(set(dims)) != len(dims):
            raise ValueError(f"dims must be two different dims, got {dims}")
        return dims
    if ndim <= 1:
        return tuple(range(ndim))
    sharded = sorted({p.dim for p in layout.placements if hasattr(p, "dim")})
    if len(sharded) == 2:
        return tuple(sharded)
    if len(sharded) == 1:
        d = sharded[0]
        return (d, ndim - 1) if d != ndim - 1 else (ndim - 2, d)
    return (ndim - 2, ndim - 1)


def _title(layout: ShardLayout) -> str:
    parts = []
    for m, (p, entry) in enumerate(zip(layout.placements, layout.sizes)):
        shown = None if entry is None else entry[0] if len(entry) == 1 else entry
        parts.append(format_sizes(p, shown, m))
    joined = ", ".join(parts)
    return ",\n".join(parts) if len(joined) > 72 else joined


def _shape_text(shape) -> str:
    return str(tuple(shape))


def plot_placements(
    tensor_or_layout=None,
    *,
    mesh_shape=None,
    placements=None,
    global_shape=None,
    sizes=None,
    dims=None,
    ax=None,
    title=None,
):
    """Draw the global tensor as blocks coloured by the rank that holds them.

    Input: a :class:`~shardlab.layout.ShardLayout`, anything whose ``.layout`` is one, a
    DTensor, or ``mesh_shape`` + ``placements`` + ``global_shape`` (+ ``sizes``, see
    :meth:`ShardLayout.build`). ``dims=(d0, d1)`` picks the tensor dims drawn as rows and
    columns (default: the sharded dims, else the last two; a 1-D tensor is one row).

    Rank = row-major mesh coordinate index. Each block shows its rank(s) and local shape.
    Replicated blocks are drawn as a stack of copies, one per rank holding it; Partial blocks
    have dashed edges and say "partial sum"; empty shards are thick lines at their position,
    listed in the legend. The returned Figure carries ``shardlab_blocks``: one
    ``(rank, (row0, row1), (col0, col1))`` per rank, its global box along the drawn dims (a
    1-D view has rows ``(0, 1)``), ``shardlab_dims`` and ``shardlab_empty`` (empty ranks).

    Communicates nothing: it draws a layout (call it in the kernel, or on one rank).

    Example::

        from shardlab import viz
        viz.plot_placements(mesh_shape=(4,), placements=[Shard(0)], global_shape=(18, 3),
                            sizes=[[5, 5, 4, 4]])
        viz.plot_placements(st)          # a ShardTensor: its ``.sharding``
    """
    layout = as_layout(
        tensor_or_layout,
        mesh_shape=mesh_shape,
        placements=placements,
        global_shape=global_shape,
        sizes=sizes,
    )
    dims = shown_dims(layout, dims)
    require_matplotlib()
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.transforms import ScaledTranslation

    shape = layout.global_shape
    nrows = shape[dims[0]] if len(dims) == 2 else 1
    ncols = shape[dims[-1]] if dims else 1
    coords = layout.coords()

    def box2(coord):
        box = layout.local_box(coord)
        rows = box[dims[0]] if len(dims) == 2 else (0, 1)
        cols = box[dims[-1]] if dims else (0, 1)
        return rows, cols

    blocks = [(r, *box2(c)) for r, c in enumerate(coords)]
    empty = [r for r, c in enumerate(coords) if layout.numel(c) == 0]
    groups: dict[tuple, list[int]] = {}
    for r, rows, cols in blocks:
        if r not in empty:
            groups.setdefault((rows, cols), []).append(r)
    partial = [p for p in layout.placements if isinstance(p, Partial)]
    cut = sorted({p.dim for p in layout.placements if isinstance(p, Shard)} - set(dims))

    height = 2.3 if len(dims) < 2 else min(max(6.0 * nrows / max(ncols, 1), 2.0), 5.0) + 1.4
    fig, ax = new_figure((8.0, height), ax)
    step = ScaledTranslation(STACK_POINTS / 72, STACK_POINTS / 72, fig.dpi_scale_trans)

    def stacked(k):  # transform of the k-th copy behind the front one
        t = ax.transData
        for _ in range(k):
            t = t + step
        return t

    for (rows, cols), ranks in groups.items():
        for k in reversed(range(len(ranks))):
            r = ranks[k]
            ax.add_artist(
                Rectangle(
                    (cols[0], rows[0]),
                    cols[1] - cols[0],
                    rows[1] - rows[0],
                    facecolor=rank_colour(r),
                    alpha=0.85 if k == 0 else 0.7,
                    edgecolor="black",
                    lw=1.4,
                    linestyle="--" if partial else "-",
                    hatch="//" if partial else None,
                    transform=stacked(k),
                    clip_on=False,
                    zorder=2 + (len(ranks) - k) * 0.01,
                )
            )
        _block_text(ax, layout, coords, ranks, (rows, cols), (nrows, ncols), partial, cut)

    marks: dict[tuple, list[int]] = {}  # empty shards at the same place share one label
    for r in empty:
        marks.setdefault(box2(coords[r]), []).append(r)
    for (rows, cols), ranks in marks.items():
        flat = rows[0] == rows[1]  # no rows: a horizontal line, else a vertical one
        for i, r in enumerate(ranks):
            dx, dy = (0, -3 * i) if flat else (3 * i, 0)
            shift = ScaledTranslation(dx / 72, dy / 72, fig.dpi_scale_trans)
            ax.plot(
                [cols[0], cols[1] if flat else cols[0]],
                [rows[0], rows[0] if flat else rows[1]],
                color=rank_colour(r), lw=3, marker="o" if cols[0] == cols[1] else None,
                solid_capstyle="butt", zorder=5, clip_on=False, transform=ax.transData + shift,
            )  # fmt: skip
        ax.annotate(
            "empty: " + ", ".join(f"r{r}" for r in ranks), (cols[0], rows[0]), xytext=(4, 3),
            textcoords="offset points", fontsize=8, zorder=6, annotation_clip=False,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
        )  # fmt: skip

    ax.set_xlim(0, max(ncols, 1))
    ax.set_ylim(max(nrows, 1), 0)
    if len(dims) < 2:
        ax.set_yticks([])
    else:
        d = dims[0]
        ax.set_ylabel(_axis_text(layout, d))
        boundary_ticks(ax, "y", layout.sizes_along(d))
        element_grid(ax, "y", 0, nrows)
    if dims:
        d = dims[-1]
        ax.set_xlabel(_axis_text(layout, d))
        boundary_ticks(ax, "x", layout.sizes_along(d))
        element_grid(ax, "x", 0, ncols)
    ax.tick_params(labelsize=8)

    stack = max([len(g) for g in groups.values()] + [len(empty)])
    handles = []
    for r, c in enumerate(coords):
        where = f" {c}" if len(c) > 1 else ""
        what = "empty " + _shape_text(layout.local_shape(c)) if r in empty else None
        what = what or _shape_text(layout.local_shape(c))
        label = f"rank {r}{where}: {what}"
        handles.append(Patch(facecolor=rank_colour(r), edgecolor="black", label=label))
    if partial:
        style = {"facecolor": "white", "edgecolor": "black", "linestyle": "--", "hatch": "//"}
        over = [
            f"{p.reduce_op} over mesh dim {m}"
            for m, p in enumerate(layout.placements)
            if isinstance(p, Partial)
        ]
        handles.append(Patch(**style, label="partial: " + ", ".join(over)))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        borderaxespad=0.5 + STACK_POINTS * (stack - 1) / 8,
        title=f"mesh {layout.mesh_shape}",
        title_fontsize=8,
        frameon=False,
    )
    hidden = [d for d in range(len(shape)) if d not in dims]
    sub = f"global shape {_shape_text(shape)} on mesh {layout.mesh_shape}"
    if hidden:
        sub += f", showing dims {dims} (not {tuple(hidden)})"
    pad = 6 + STACK_POINTS * (stack - 1)
    ax.set_title(title if title is not None else f"{_title(layout)}\n{sub}", fontsize=10, pad=pad)

    fig.shardlab_blocks = blocks
    fig.shardlab_dims = dims
    fig.shardlab_empty = empty
    fig.shardlab_layout = layout
    return fig


def _axis_text(layout: ShardLayout, d: int) -> str:
    pieces = layout.sizes_along(d)
    if len(pieces) == 1:
        return f"dim {d} ({layout.global_shape[d]}): not sharded"
    return f"dim {d} ({layout.global_shape[d]}): sizes {list(pieces)}"


def _block_text(ax, layout, coords, ranks, box, extent, partial, cut) -> None:
    """Rank(s), local shape and partial / replicated / stacked, as much as fits the block."""
    (rows, cols), (nrows, ncols) = box, extent
    h, w = (rows[1] - rows[0]) / max(nrows, 1), (cols[1] - cols[0]) / max(ncols, 1)
    if w < 0.035 or h < 0.08:
        return
    local = _shape_text(layout.local_shape(coords[ranks[0]]))
    lines = [ranks_text(ranks)] if w >= 0.12 else [f"r{','.join(map(str, ranks))}"]
    if w >= 0.08 and h >= 0.2:
        lines.append(local + (" each" if len(ranks) > 1 else ""))
        if partial and h >= 0.3:
            names = sorted({str(p.reduce_op) for p in partial})
            lines.append("partial " + "/".join(names))
        elif len(ranks) > 1 and h >= 0.3:  # a hidden cut dim also stacks ranks
            lines.append(f"slices of dim {', '.join(map(str, cut))}" if cut else "replicated")
    ax.text(
        (cols[0] + cols[1]) / 2,
        (rows[0] + rows[1]) / 2,
        "\n".join(lines),
        ha="center",
        va="center",
        fontsize=8,
        zorder=4,
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.75},
    )
