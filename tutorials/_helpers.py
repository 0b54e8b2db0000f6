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
