"""Notebook-only helpers for the tutorials (kept out of the library on purpose)."""

import matplotlib.pyplot as plt


def plot_all_reduce(before, after, title="all_reduce(sum)"):
    """Draw each rank's value before and after an all-reduce, one colour per rank."""
    n = len(before)
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 2, figsize=(7, 2.6), sharey=True)
    for ax, values, name in zip(axes, (before, after), ("before", "after")):
        vals = [float(v.sum()) for v in values]
        ax.bar(range(n), vals, color=[colors[r % 10] for r in range(n)])
        for r, v in enumerate(vals):
            ax.text(r, v, f"{v:g}", ha="center", va="bottom")
        ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
        ax.set_title(name)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_mesh(mesh_ranks, names=("dim 0", "dim 1"), title="DeviceMesh"):
    """Draw a 2-D mesh of ranks as a grid: each cell shows the rank and its coordinate.

    ``mesh_ranks`` is the mesh as nested lists (``mesh.mesh.tolist()``). Rows are mesh dim
    0, columns mesh dim 1; a row of the grid is one group of mesh dim 1, a column one group
    of mesh dim 0.
    """
    rows, cols = len(mesh_ranks), len(mesh_ranks[0])
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(1.4 * cols + 1.2, 1.1 * rows + 0.8))
    for i, row in enumerate(mesh_ranks):
        for j, r in enumerate(row):
            ax.add_patch(plt.Rectangle((j, -i - 1), 0.92, 0.92, color=colors[r % 10], alpha=0.6))
            ax.text(j + 0.46, -i - 0.42, f"rank {r}", ha="center", fontsize=10, weight="bold")
            ax.text(j + 0.46, -i - 0.75, f"({i}, {j})", ha="center", fontsize=9)
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-rows - 0.1, 0.1)
    ax.set_xlabel(f"{names[1]} →  (a row is one {names[1]} group)")
    ax.set_ylabel(f"← {names[0]}")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title)
    fig.tight_layout()
    return fig
