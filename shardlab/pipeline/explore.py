"""The timeline drawn (:func:`plot`) and explored with live controls (:func:`explorer`)."""

from __future__ import annotations

import io

from shardlab.pipeline.timeline import KINDS, _Table, bubble, formula, replay

__all__ = ["COLOURS", "PipelineExplorer", "explorer", "plot"]

COLOURS = _Table(
    "The colour :func:`plot` gives each kind of action (see :data:`KINDS`).",
    {"F": "#6baed6", "B": "#74c476", "I": "#fd8d3c", "W": "#9e9ac8"},
)


def plot(actions, *, title: str | None = None, ax=None, stages: int | None = None):
    """Each rank's actions as boxes on its row (rank 0 on top) against time in ms:
    forward blue, backward green, its input part orange and weight part purple (zero
    bubble); the micro-batch number inside; a rank's second stage (interleaved schedules)
    hatched. White is idle. ``stages`` (the number of pipeline stages, default the ranks)
    puts ``(p-1)/(m+p-1)`` in the title beside the measured :func:`bubble`.

    Returns the matplotlib Figure (or ``ax``'s); ``fig.shardlab_boxes`` holds
    ``(rank, stage, microbatch, kind, start_ms, end_ms)`` for each box drawn."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    actions = list(actions)
    ranks = sorted({a.rank for a in actions})
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(ranks) + 1.3))
    else:
        fig = ax.figure
    t0 = min(a.start for a in actions)
    first_stage = {r: min(a.stage for a in actions if a.rank == r) for r in ranks}
    boxes = []
    for a in actions:
        y = len(ranks) - 1 - ranks.index(a.rank)
        x0, x1 = (a.start - t0) * 1e3, (a.end - t0) * 1e3
        hatch = "//" if a.stage != first_stage[a.rank] else None
        ax.add_patch(Rectangle((x0, y + 0.08), x1 - x0, 0.84, facecolor=COLOURS[a.kind],
                               edgecolor="k", linewidth=0.4, hatch=hatch))  # fmt: skip
        ax.text((x0 + x1) / 2, y + 0.5, str(a.microbatch), ha="center", va="center", fontsize=7)
        boxes.append((a.rank, a.stage, a.microbatch, a.kind, x0, x1))
    end = max(b[5] for b in boxes)
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(0, len(ranks))
    ax.set_yticks([len(ranks) - 0.5 - i for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel("ms")
    kinds = [k for k in KINDS if any(a.kind == k for a in actions)]
    handles = [Patch(facecolor=COLOURS[k], edgecolor="k", label=f"{k}: {KINDS[k]}") for k in kinds]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    m = len({a.microbatch for a in actions})
    p = stages or len(ranks)
    text = f"bubble {bubble(actions):.0%} measured; (p-1)/(m+p-1) = {formula(p, m):.0%}"
    ax.set_title(f"{title}: {text}" if title else text, fontsize=10)
    fig.tight_layout()
    fig.shardlab_boxes = boxes
    return fig


class PipelineExplorer:
    """Controls for the schedule and the number of micro-batches; each choice runs
    ``run(schedule, microbatches)`` once (it returns the recorded actions and the traced
    events of every rank, e.g. from :func:`shardlab.pipeline.step` on a pool of ranks) and
    draws its replayed timeline (:func:`replay`, :func:`plot`) with the measured bubble
    beside the formula. ``results``: (schedule, m) -> (actions, events); ``figure``: the
    current figure; ``bubbles``: (schedule, m) -> measured bubble fraction."""

    def __init__(self, run, *, schedule: str = "1F1B", microbatches: int = 8,
                 schedules=("GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble"),
                 stages: int | None = None):  # fmt: skip
        import ipywidgets as w

        self.run, self.stages = run, stages
        self.results: dict = {}
        self.bubbles: dict = {}
        self.controls = {
            "schedule": w.Dropdown(
                options=list(schedules), value=schedule, description="schedule"
            ),  # fmt: skip
            "microbatches": w.IntSlider(
                value=microbatches, min=4, max=16, description="micro-batches"
            ),  # fmt: skip
        }
        self.status = w.HTML()
        self.image = w.Image(format="png")
        for c in self.controls.values():
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([w.HBox(list(self.controls.values())), self.status, self.image])
        self.figure = None
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, and a static snapshot (``text/html``: the choice, the figure
        and the bubble) for pages without a kernel (the docs)."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):  # (data, metadata)
            bundle = bundle[0]
        return {**bundle, "text/html": self.snapshot_html()}

    def snapshot_html(self) -> str:
        """The explorer's state as HTML: the controls' values, the status, the figure."""
        import base64
        import html

        values = ", ".join(
            f"{name} <code>{html.escape(str(c.value))}</code>" for name, c in self.controls.items()
        )
        png = base64.b64encode(self.image.value).decode()
        return (
            f"<div class='shardlab-explorer'><p class='shardlab-explorer-values'>{values}</p>"
            f"{self.status.value}<img src='data:image/png;base64,{png}' alt=''></div>"
        )

    def update(self):
        """Run (once per choice) and draw the controls' schedule and micro-batches."""
        key = (self.controls["schedule"].value, self.controls["microbatches"].value)
        try:
            if key not in self.results:
                self.status.value = "<small>running on the ranks...</small>"
                self.results[key] = self.run(*key)
            actions, events = self.results[key]
            ideal = replay(actions, events)
            self.bubbles[key] = bubble(ideal)
            self.figure = plot(ideal, title=f"{key[0]}, m = {key[1]}", stages=self.stages)
        except Exception as exc:  # shown, not raised: a callback has nobody to raise to
            self.status.value = f"<b style='color:#c00'>⚠ {type(exc).__name__}: {exc}</b>"
            return None
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=80)
        self.image.value = buf.getvalue()
        self.status.value = (
            f"<small>replayed with one core per rank; bubble {self.bubbles[key]:.0%}</small>"
        )
        return self.figure


def explorer(run, *, static: bool | None = None, **initial):
    """The pipeline explorer (:class:`PipelineExplorer`) around ``run(schedule,
    microbatches) -> (actions, events)``. ``static=True``, or no ipywidgets: the figure
    of the initial choice only."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        static = True
    if static:
        actions, events = run(initial.get("schedule", "1F1B"), initial.get("microbatches", 8))
        return plot(replay(actions, events), stages=initial.get("stages"))
    return PipelineExplorer(run, **initial)
