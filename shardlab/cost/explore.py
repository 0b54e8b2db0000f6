"""The projection as bars (:func:`plot_projection`), and an explorer that redraws them as
the cluster's parameters change (:func:`projection_explorer`).

::

    steps = {"U-Net": (unet_step, {8: Degrees(domain=8), 64: ..., 512: ...}, Growth(...))}
    shardlab.cost.plot_projection([project(step, Cluster(), d, growth) for d in ...])
    shardlab.cost.projection_explorer(steps)       # sliders: bandwidths, FLOP/s, ...
"""

from __future__ import annotations

import io
from dataclasses import fields, replace

from shardlab.cost.cluster import DIMS, Cluster, project

__all__ = ["ProjectionExplorer", "plot_projection", "projection_explorer"]

COLOURS = {"compute": "#8c8c8c", "tensor": "#c44e52", "sequence": "#8172b2"}
COLOURS |= {"domain": "#4c72b0", "data": "#dd8452"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def _png(fig, dpi=90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def plot_projection(projections, *, title: str | None = None, notes=()):
    """Bars per projection (one per scale): compute beside communication stacked by dim, in
    seconds per step; a label says whether communication hides behind compute (perfect
    overlap assumed) or by how much it sticks out. The cluster's parameters, their sources
    and which are assumptions, the growth and ``notes`` are written under the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not projections:
        raise ValueError("projections: nothing to draw")
    cluster, growth = projections[0].cluster, projections[0].growth
    lines = [f"{cluster.name}:"] + [f"  {a}" for a in cluster.assumptions()]
    lines.append(
        f"step grown per rank: tokens x{growth.tokens:g}, width x{growth.width:g}, "
        f"layers x{growth.layers:g}, bytes per element x{growth.dtype:g} (assumed)"
    )
    lines.append(
        "assumed: perfect overlap of communication with compute; rings over the slowest "
        "link a group spans; scaling rules of shardlab.cost.cluster"
    )
    lines += list(notes)
    fig = Figure(figsize=(8.5, 3.2 + 0.13 * len(lines)), layout="constrained")
    FigureCanvasAgg(fig)
    fig._repr_png_ = lambda: _png(fig)  # Jupyter shows the returned figure
    ax, notes_ax = fig.subplots(2, 1, height_ratios=[3.2, 0.13 * len(lines)])
    top = 0.0
    for i, p in enumerate(projections):
        ax.bar(i - 0.2, p.compute, 0.36, color=COLOURS["compute"],
               label="compute" if i == 0 else None)  # fmt: skip
        bottom = 0.0
        for dim in DIMS:
            s = p.comm.get(dim, 0.0)
            if s:
                name = "data (gradients)" if dim == "data" else dim
                ax.bar(i + 0.2, s, 0.36, bottom=bottom, color=COLOURS[dim], label=name)
                bottom += s
        verdict = "hides" if p.hidden else f"exposed {_ms(p.exposed)}"
        ax.text(i, max(p.compute, bottom) * 1.03, verdict, ha="center", va="bottom", fontsize=8)
        top = max(top, p.compute, bottom)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=8, loc="upper left")
    ticks = [f"{p.degrees.gpus} GPUs\n{p.degrees}" for p in projections]
    ax.set_xticks(range(len(projections)), ticks, fontsize=8)
    ax.set_ylim(0, top * 1.25 or 1)
    ax.yaxis.set_major_formatter(lambda v, _pos: _ms(v) if v else "0")
    ax.set_ylabel("seconds per step")
    ax.set_title(title or f"{projections[0].step}: compute | communication per dim", fontsize=10)
    notes_ax.axis("off")
    notes_ax.text(0, 1, "\n".join(lines), fontsize=6.5, va="top", family="monospace",
                  transform=notes_ax.transAxes)  # fmt: skip
    return fig


# the explorer's sliders: parameter -> (options, scale to the unit shown, label)
_SLIDERS = {
    "ib_bandwidth": ([6.25, 12.5, 25, 50, 100, 200], 1e9, "IB GB/s"),
    "nvlink_bandwidth": ([75, 150, 300, 450, 900], 1e9, "NVLink GB/s"),
    "flops": ([125, 250, 495, 989, 1979, 4000], 1e12, "TFLOP/s"),
    "mfu": ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1, "MFU"),
    "ib_latency": ([2, 5, 10, 20, 50], 1e-6, "IB α µs"),
    "gpus_per_node": ([4, 8, 16, 72], 1, "GPUs/node"),
}


class ProjectionExplorer:
    """Sliders for the cluster's parameters and a choice of step; the bars of
    :func:`plot_projection` redrawn at each change. ``steps``: name -> ``(Step, {gpus:
    Degrees}, Growth)``; ``controls``: name -> widget; ``figure``: the current figure;
    ``projections``: the current ones."""

    def __init__(self, steps: dict, cluster: Cluster | None = None):
        import ipywidgets as w

        if not steps:
            raise ValueError("steps: name -> (Step, {gpus: Degrees}, Growth), at least one")
        self.steps, self.cluster = steps, cluster or Cluster()
        self.controls = {
            name: w.SelectionSlider(
                options=[(f"{v:g}", v * unit) for v in options],
                value=min(
                    (v * unit for v in options), key=lambda x: abs(x - getattr(self.cluster, name))
                ),  # fmt: skip
                description=label,
            )
            for name, (options, unit, label) in _SLIDERS.items()
        }
        self.controls["step"] = w.Dropdown(options=list(steps), description="step")
        self.image = w.Image(format="png")
        self.text = w.HTML()
        for c in self.controls.values():
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.HBox(
            [w.VBox(list(self.controls.values())), w.VBox([self.image, self.text])]
        )
        self.figure, self.projections = None, []
        self.update()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def current(self) -> Cluster:
        """The cluster the sliders describe."""
        changes = {k: c.value for k, c in self.controls.items() if k != "step"}
        changes["gpus_per_node"] = int(changes["gpus_per_node"])
        names = {f.name for f in fields(Cluster)}
        return replace(self.cluster, **{k: v for k, v in changes.items() if k in names})

    def update(self) -> None:
        """Project the chosen step again on the sliders' cluster and redraw."""
        step, degrees, growth = self.steps[self.controls["step"].value]
        cluster = self.current()
        self.projections = [project(step, cluster, d, growth) for _, d in sorted(degrees.items())]
        self.figure = plot_projection(self.projections)
        self.image.value = _png(self.figure)
        self.text.value = "<br>".join(f"<small>{p}</small>" for p in self.projections)


def projection_explorer(steps: dict, cluster: Cluster | None = None, *, static=None):
    """The :class:`ProjectionExplorer` (display it, or its ``.widget``). ``static=True``, or
    no ipywidgets: the figure of the first step on ``cluster``."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        static = True
    if static:
        step, degrees, growth = next(iter(steps.values()))
        cluster = cluster or Cluster()
        return plot_projection(
            [project(step, cluster, d, growth) for _, d in sorted(degrees.items())]
        )
    return ProjectionExplorer(steps, cluster)
