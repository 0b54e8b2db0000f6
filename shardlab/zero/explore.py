"""Bars of the formula and of the measurement: :func:`plot`, and the :func:`explorer` that
redraws them as N, the model's size and the stages change.

::

    zero.plot(zero.compare(ranks, model_fn))          # predicted | measured, per stage
    zero.explorer(ranks)                              # sliders; "measure" runs the ranks
"""

from __future__ import annotations

import functools
import io

from shardlab.zero.formula import ADAM_FP32, ADAM_MIXED, predict
from shardlab.zero.report import Row, compare
from shardlab.zero.stages import llama

__all__ = ["ZeroExplorer", "explorer", "llama_sizes", "plot"]

STATES = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868"}  # name -> colour


def llama_sizes(layers: int, hidden: int, vocab: int) -> tuple[int, list[int]]:
    """(Ψ, units) of :func:`~shardlab.zero.llama` without building it. A block: attention
    q and o h² each, k and v h²/2 each (2 of 4 heads), the MLP 3 x 2 h², two norms 2 h:
    9 h² + 2 h; the root: embeddings and output layer V h each, the last norm h."""
    block = 9 * hidden * hidden + 2 * hidden
    root = 2 * vocab * hidden + hidden
    return layers * block + root, [block] * layers + [root]


def _byte_axis(ax, top: float) -> None:
    """Ticks at round numbers of KiB, MiB, GiB (powers of 1024), at most 6 of them."""
    from matplotlib.ticker import MultipleLocator

    power = 0
    while top >= 1024 ** (power + 1) and power < 4:
        power += 1
    unit, name = 1024**power, ("B", "KiB", "MiB", "GiB", "TiB")[power]
    step = next(m for m in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if top / (m * unit) <= 6)
    ax.yaxis.set_major_locator(MultipleLocator(step * unit))
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v / unit:g} {name}")


def _title(layers: int, hidden: int, vocab: int) -> str:
    psi = llama_sizes(layers, hidden, vocab)[0]
    return f"Llama, {layers} blocks of width {hidden}, vocab {vocab}: Ψ = {psi:,}"


def _png(fig, dpi=90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def plot(items, *, title: str | None = None):
    """A bar chart of bytes per rank, one group per item of ``items``: a
    :class:`~shardlab.zero.Prediction` (one bar), or a :class:`~shardlab.zero.Row` (the
    prediction, and beside it what the rank holding the most measured). Parameters,
    gradients and optimizer state kept between steps are stacked; a black tick marks the
    peak of a step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 1.6 * len(items) + 1.5), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    fig._repr_png_ = lambda: _png(fig)  # Jupyter shows the returned figure
    ax = fig.add_subplot()
    top, ticks, labels = 0.0, [], []
    for i, item in enumerate(items):
        pred = item.predicted if isinstance(item, Row) else item
        bars = [("formula", pred.params, pred.grads, pred.optim, pred.peak)]
        if isinstance(item, Row):  # the rank that holds the most, each quantity
            w = item.worst
            bars.append(("measured", w("params"), w("grads"), w("optim"), w("peak")))
        for j, (kind, *values, peak) in enumerate(bars):
            x = i + (j - (len(bars) - 1) / 2) * 0.38
            bottom = 0.0
            for (name, colour), v in zip(STATES.items(), values):
                ax.bar(x, v, 0.36, bottom=bottom, color=colour, alpha=0.55 if j else 1.0,
                       hatch="//" if j else None, label=name if i == j == 0 else None)  # fmt: skip
                bottom += v
            ax.plot([x - 0.18, x + 0.18], [peak, peak], color="black", lw=2,
                    label="peak of a step" if i == j == 0 else None)  # fmt: skip
            ax.text(x, max(peak, bottom), kind[0], ha="center", va="bottom", fontsize=8)
            top = max(top, peak, bottom)
        ticks.append(i)
        labels.append(f"stage {pred.stage}\nN = {pred.ranks}")
    ax.set_xticks(ticks, labels)
    ax.set_ylim(0, top * 1.15 or 1)
    _byte_axis(ax, top * 1.15 or 1)
    ax.set_ylabel("bytes per rank")
    ax.legend(fontsize=8, loc="upper right")
    key = "f: formula, m: measured (hatched)"
    ax.set_title(f"{title}\n{key}" if title else key, fontsize=10)
    return fig


class ZeroExplorer:
    """Sliders for N, the Llama's blocks, width and vocabulary, the stages and the
    precision; the predicted bars, and the measured ones beside them once "measure" has
    run the stages on ``ranks`` (only for N = its ranks and float32, up to ``max_params``).
    ``controls``: name -> widget; ``figure``: the current figure; ``rows``: what was
    measured, by (layers, hidden, vocab, N)."""

    def __init__(self, ranks=None, *, layers=6, hidden=64, vocab=256, n=None,
                 max_params=20_000_000):  # fmt: skip
        import ipywidgets as w

        self.ranks, self.max_params = ranks, max_params
        self.rows: dict[tuple, list[Row]] = {}
        n = n or (ranks.world_size if ranks is not None else 4)
        self.controls = {
            "n": w.SelectionSlider(
                options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                value=n,
                description="N ranks",
            ),  # fmt: skip
            "layers": w.IntSlider(value=layers, min=1, max=128, description="blocks"),
            "hidden": w.SelectionSlider(
                options=[2**k for k in range(4, 15)], value=hidden, description="width"
            ),  # fmt: skip
            "vocab": w.SelectionSlider(
                options=[2**k for k in range(6, 18)], value=vocab, description="vocab"
            ),  # fmt: skip
            "stages": w.SelectMultiple(
                options=[0, 1, 2, 3], value=(0, 1, 2, 3), description="stages"
            ),  # fmt: skip
            "mixed": w.Checkbox(value=False, description="paper's mixed precision (K = 12)"),
        }
        self.button = w.Button(description="measure on the ranks")
        self.status = w.HTML()
        self.image = w.Image(format="png")
        for c in self.controls.values():
            c.observe(lambda _change: self.update(), names="value")
        self.button.on_click(lambda _b: self.measure())
        self.widget = w.HBox([w.VBox([*self.controls.values(), self.button, self.status]),
                              self.image])  # fmt: skip
        self.figure = None
        self.update()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _key(self):
        c = self.controls
        return (c["layers"].value, c["hidden"].value, c["vocab"].value, c["n"].value)

    def can_measure(self) -> str | None:
        """Why "measure" cannot run now, or None."""
        layers, hidden, vocab, n = self._key()
        if self.ranks is None:
            return "no ranks given: formula only"
        if n != self.ranks.world_size:
            return f"measured on N = {self.ranks.world_size} only (these ranks)"
        if self.controls["mixed"].value:
            return "measured in float32 only"
        if llama_sizes(layers, hidden, vocab)[0] > self.max_params:
            return f"over {self.max_params:,} parameters: formula only"
        return None

    def measure(self) -> None:
        """Run the stages on the ranks (seconds), then redraw."""
        if self.can_measure() is None:
            layers, hidden, vocab, _ = self._key()
            model_fn = functools.partial(llama, layers=layers, hidden=hidden, vocab=vocab)
            self.status.value = "measuring..."
            self.rows[self._key()] = compare(self.ranks, model_fn)
        self.update()

    def update(self) -> None:
        """Draw the bars again for the controls' values (the measured ones where run)."""
        layers, hidden, vocab, n = self._key()
        psi, units = llama_sizes(layers, hidden, vocab)
        stages = sorted(self.controls["stages"].value)
        measured = {r.stage: r for r in self.rows.get(self._key(), [])}
        precision = ADAM_MIXED if self.controls["mixed"].value else ADAM_FP32
        items = [
            measured[s] if s in measured and not self.controls["mixed"].value
            else predict(psi, n, s, units=units, **precision)
            for s in stages
        ]  # fmt: skip
        self.figure = plot(items, title=_title(layers, hidden, vocab))
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=90)
        self.image.value = buf.getvalue()
        reason = self.can_measure()
        self.button.disabled = reason is not None
        note = "peaks without activations" if not measured else "peaks with measured activations"
        self.status.value = f"<small>{reason or 'measure: float32 Adam, 2 steps'}; {note}</small>"


def explorer(ranks=None, *, static: bool | None = None, **initial):
    """The ZeRO explorer (:class:`ZeroExplorer`, its ``.widget`` to display) around a
    :class:`shardlab.Ranks` pool (None: the formula only). ``static=True``, or no
    ipywidgets: the figure of the initial values (:func:`plot` of the four stages)."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        static = True
    if static:
        n = initial.get("n") or (ranks.world_size if ranks is not None else 4)
        sizes = [initial.get(k, d) for k, d in (("layers", 6), ("hidden", 64), ("vocab", 256))]
        psi, units = llama_sizes(*sizes)
        return plot([predict(psi, n, s, units=units) for s in range(4)], title=_title(*sizes))
    return ZeroExplorer(ranks, **initial)
