"""Interactive explorers (ipywidgets) around :func:`plot_halos` and :func:`plot_placements`.

Each explorer is a small class: ``controls`` (name -> widget), an :meth:`update` that every
control's callback calls, and the current ``figure``. Bad input (sizes that don't parse, a
configuration the plan rejects) is shown in the widget (``error_message``), never raised.

Fallback: ``halo_explorer(static=None)`` (the default) builds widgets only when ipywidgets
imports and an IPython kernel (a notebook front end) is running; otherwise it warns and returns
the static figure for the initial values. ``static=True`` always returns the figure,
``static=False`` always builds the widgets (ImportError if ipywidgets is missing).
"""

from __future__ import annotations

import base64
import html
import warnings

from shardlab.layout import chunk_sizes

from ._common import figure_png, human_bytes, require_ipywidgets
from ._parse import parse_ints, parse_padding, parse_placements, parse_sizes
from .halos import plot_halos
from .placements import plot_placements

__all__ = ["HaloExplorer", "PlacementExplorer", "halo_explorer", "placement_explorer"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
WIDTH_PX = 950  # a notebook's output width: images are drawn at the size they are shown


def _dpi(fig) -> float:
    """Draw at the size shown: at most 950 px wide, never below 72 dpi (10 pt text stays
    >= 10 px), never stretched by the browser."""
    return max(72.0, min(110.0, WIDTH_PX / fig.get_figwidth()))


def _non_negative(name: str, value) -> int:
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _no_frontend_reason() -> str | None:
    """Why widgets cannot be shown here, or None if they can."""
    try:
        require_ipywidgets()
        from IPython import get_ipython
    except ImportError as exc:
        return str(exc)
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return "no Jupyter kernel is running (widgets need a notebook front end)"
    return None


def _make(cls, static, initial):
    if static is None:
        reason = _no_frontend_reason()
        static = reason is not None
        if static:
            warnings.warn(f"{reason}: showing a static figure instead", stacklevel=3)
    return cls.static_figure(**initial) if static else cls(**initial)


def halo_explorer(*, static: bool | None = None, **initial):
    """Live :func:`plot_halos` with controls (names and defaults: :class:`HaloExplorer`).

    ``static``: None (default) = widgets if ipywidgets imports and a Jupyter kernel runs, else
    a warning and the static figure of the initial values; True = that figure; False = widgets.

    Communicates nothing. In the docs (no kernel) it shows its initial state: the controls'
    values, the figure and the table.

    Example::

        viz.halo_explorer(kernel=5, sizes="9,3,3,3", padding="same")
    """
    return _make(HaloExplorer, static, initial)


def placement_explorer(*, static: bool | None = None, **initial):
    """Live :func:`plot_placements` with mesh, placements, shape, sizes and dims controls
    (:class:`PlacementExplorer`); ``static`` as in :func:`halo_explorer`.

    Example::

        viz.placement_explorer(mesh="2,2", placements="Shard(0), Shard(1)", shape="8,6")
    """
    return _make(PlacementExplorer, static, initial)


class _Explorer:
    DEFAULTS: dict = {}

    def __init__(self, **initial):
        values = self._initial(initial)
        w = require_ipywidgets()
        self.controls = self._controls(w, values)
        self.figure = None
        self.error_message: str | None = None
        self.image = w.Image(format="png")
        self.table = w.HTML()
        self.error = w.HTML()
        self._syncing = False
        boxes = list(self.controls.values())
        half = (len(boxes) + 1) // 2
        panel = w.HBox([w.VBox(boxes[:half]), w.VBox(boxes[half:])])
        self.widget = w.VBox([panel, self.error, self.image, self.table])
        for name, control in self.controls.items():
            control.observe(self._callback(name), names="value")
        self.update()

    @classmethod
    def _values_to_figure(cls, values: dict):
        raise NotImplementedError

    @classmethod
    def _initial(cls, initial: dict) -> dict:
        unknown = set(initial) - set(cls.DEFAULTS)
        if unknown:
            raise TypeError(f"unknown controls {sorted(unknown)}; known: {sorted(cls.DEFAULTS)}")
        return {**cls.DEFAULTS, **initial}

    @classmethod
    def static_figure(cls, **initial):
        """The figure for ``initial`` values, without widgets (errors raise)."""
        return cls._values_to_figure(cls._initial(initial))

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _callback(self, name):
        def changed(_change):
            if not self._syncing:
                self._syncing = True
                try:
                    self._sync(name)
                finally:
                    self._syncing = False
                self.update()

        return changed

    def _sync(self, name: str) -> None:
        """Keep controls that describe the same thing consistent (none by default)."""

    def update(self):
        """Redraw from the controls; returns the figure, or None (error shown)."""
        try:
            fig = self._values_to_figure(self.values())
        except Exception as exc:  # shown, not raised: a callback has nobody to raise to
            known = isinstance(exc, (ValueError, TypeError, ImportError))
            self.error_message = str(exc) if known else f"{type(exc).__name__}: {exc}"
            self.error.value = f"<b style='color:#c00'>⚠ {html.escape(self.error_message)}</b>"
            return None
        self.error_message = None
        self.error.value = ""
        self.figure = fig
        dpi = _dpi(fig)
        self.image.value = figure_png(fig, dpi=dpi)
        # the PNG's own width: the browser shows it 1:1 (no 1.7x stretch, no soft text)
        self.image.layout.width = f"{round(fig.get_figwidth() * dpi)}px"
        self.image.layout.max_width = "none"
        self.table.value = self._table(fig)
        return fig

    def _table(self, fig) -> str:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, and a static snapshot of it (``text/html``) for pages without a
        kernel (the docs): the controls' values, the figure and the table. Front ends with
        ipywidgets show the widget."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):  # (data, metadata)
            bundle = bundle[0]
        return {**bundle, "text/html": self.snapshot_html()}

    def snapshot_html(self) -> str:
        """The explorer's state as HTML: each control's value, the error or the figure (an
        inline PNG at its own width), and the table."""
        values = ", ".join(
            f"{name} <code>{html.escape(str(value))}</code>"
            for name, value in self.values().items()
        )
        parts = [f"<p class='shardlab-explorer-values'>{values}</p>"]
        if self.error_message is not None:
            parts.append(self.error.value)
        else:
            png = base64.b64encode(self.image.value).decode()
            width = self.image.layout.width
            parts.append(f"<img src='data:image/png;base64,{png}' style='width:{width}' alt=''>")
            parts.append(self.table.value)
        return f"<div class='shardlab-explorer'>{''.join(parts)}</div>"


class HaloExplorer(_Explorer):
    """Controls: kernel, stride, dilation, padding (same / valid / 1 / 1,2), padding_mode,
    transposed, ranks, length, sizes (uneven, "5,5,4,4"; moving ranks or length re-splits
    evenly, typing sizes moves them), sizes_w (a second sharded dim: 2-D), bytes_per_row.

    ``figure`` is the current :func:`plot_halos` figure, ``bytes_sent`` ``{rank: bytes}``.

    Example::

        ex = viz.HaloExplorer(kernel=3, sizes="5,5,4,4")
        ex.controls["kernel"].value = 5      # redraws
        ex.bytes_sent                        # {0: 8, 1: 16, 2: 16, 3: 8}
    """

    DEFAULTS = dict(
        kernel=3, stride=1, dilation=1, padding="same", padding_mode="zeros", transposed=False,
        ranks=4, length=18, sizes="5,5,4,4", sizes_w="", bytes_per_row=4,
    )  # fmt: skip

    def _controls(self, w, v):
        def text(s):
            if s is None or isinstance(s, (str, int)):
                return "" if s is None else str(s)
            return ",".join(map(str, s))

        try:  # typed sizes decide the number of ranks and the length
            sizes = parse_ints(v["sizes"], "sizes")
            v = dict(v, ranks=max(len(sizes), 1), length=max(sum(sizes), 1))
        except ValueError:
            pass

        def slider(name, lo, hi):
            return w.IntSlider(value=v[name], min=lo, max=max(hi, v[name]), description=name)

        return {
            "kernel": slider("kernel", 1, 9),
            "stride": slider("stride", 1, 4),
            "dilation": slider("dilation", 1, 4),
            "padding": w.Text(value=text(v["padding"]), description="padding",
                              placeholder="same, valid, 1 or 1,2"),
            "padding_mode": w.Dropdown(options=PADDING_MODES, value=v["padding_mode"],
                                       description="mode"),
            "transposed": w.Checkbox(value=v["transposed"], description="transposed"),
            "ranks": slider("ranks", 1, 8),
            "length": slider("length", 1, 64),
            "sizes": w.Text(value=text(v["sizes"]), description="sizes",
                            placeholder="uneven, e.g. 5,5,4,4"),
            "sizes_w": w.Text(value=text(v["sizes_w"]), description="sizes W",
                              placeholder="2nd sharded dim, e.g. 3,3"),
            "bytes_per_row": w.IntText(value=v["bytes_per_row"], description="bytes/row"),
        }  # fmt: skip

    def _sync(self, name):
        c = self.controls
        if name in ("ranks", "length"):
            c["sizes"].value = ",".join(map(str, chunk_sizes(c["length"].value, c["ranks"].value)))
        elif name == "sizes":
            try:
                sizes = parse_ints(c["sizes"].value, "sizes")
            except ValueError:
                return  # update() shows the error
            for key, value in (("ranks", len(sizes)), ("length", sum(sizes))):
                c[key].max = max(c[key].max, value)
                c[key].value = max(value, c[key].min)

    @classmethod
    def _values_to_figure(cls, v):
        sizes = parse_ints(v["sizes"], "sizes", allow_empty=True)
        if sizes is None:
            sizes = list(chunk_sizes(int(v["length"]), int(v["ranks"])))
        return plot_halos(
            sizes, int(v["kernel"]), int(v["stride"]), int(v["dilation"]),
            parse_padding(v["padding"]), v["padding_mode"], transposed=bool(v["transposed"]),
            sizes_w=parse_ints(v["sizes_w"], "sizes_w", allow_empty=True),
            bytes_per_row=_non_negative("bytes_per_row", v["bytes_per_row"]) or None,
        )  # fmt: skip

    @property
    def plan(self):
        """The halo plan of the current figure (``shardlab.layout.conv_plan``), or None."""
        return None if self.figure is None else self.figure.shardlab_plan

    @property
    def bytes_sent(self) -> dict[int, int]:
        """``{rank: bytes sent}`` for the current figure (rows x bytes_per_row)."""
        if self.figure is None:
            return {}
        per = self.controls["bytes_per_row"].value
        return {r: n * per for r, n in self.figure.shardlab_sent.items()}

    def _table(self, fig) -> str:
        unit = "elements" if hasattr(fig.shardlab_plan, "plans") else "rows"
        rows = "".join(
            f"<tr><td>rank {r}</td><td>{n}</td><td>{human_bytes(self.bytes_sent[r])}</td></tr>"
            for r, n in fig.shardlab_sent.items()
        )
        return f"<table><tr><th>rank</th><th>{unit} sent</th><th>bytes</th></tr>{rows}</table>"


class PlacementExplorer(_Explorer):
    """Controls: mesh ("4" or "2,2"), placements ("Shard(0), Replicate()", short "S(0) R"),
    shape ("18,3"), sizes (blank: DTensor's even split; "5,5,4,4"; "[4,3], [2,2,1]"), dims
    (blank: automatic; "0,2"). ``figure`` is the current :func:`plot_placements` figure and
    ``local_shapes`` ``{rank: local shape}``.

    Example::

        ex = viz.PlacementExplorer(mesh="4", shape="18,3", sizes="5,5,4,4")
        ex.local_shapes                      # {0: (5, 3), 1: (5, 3), 2: (4, 3), 3: (4, 3)}
    """

    DEFAULTS = dict(mesh="4", placements="Shard(0)", shape="18,3", sizes="5,5,4,4", dims="")

    def _controls(self, w, v):
        def text(name, placeholder):
            value = "" if v[name] is None else v[name]
            if not isinstance(value, str):
                value = ", ".join(map(repr if name != "placements" else str, value))
            return w.Text(value=value, description=name, placeholder=placeholder)

        return {
            "mesh": text("mesh", "4 or 2,2"),
            "placements": text("placements", "Shard(0), Replicate()"),
            "shape": text("shape", "18,3"),
            "sizes": text("sizes", "blank = even; 5,5,4,4"),
            "dims": text("dims", "blank = auto; 0,1"),
        }

    @classmethod
    def _values_to_figure(cls, v):
        return plot_placements(
            mesh_shape=parse_ints(v["mesh"], "mesh"),
            placements=parse_placements(v["placements"]),
            global_shape=parse_ints(v["shape"], "shape", allow_empty=True) or [],
            sizes=parse_sizes(v["sizes"]),
            dims=parse_ints(v["dims"], "dims", allow_empty=True, minimum=None),
        )

    @property
    def local_shapes(self) -> dict[int, tuple[int, ...]]:
        """``{rank: local shape}`` of the current layout (``{}`` while it shows an error)."""
        if self.figure is None:
            return {}
        layout = self.figure.shardlab_layout
        return {r: layout.local_shape(c) for r, c in enumerate(layout.coords())}

    def _table(self, fig) -> str:
        layout = fig.shardlab_layout
        rows = "".join(
            f"<tr><td>rank {r} {c}</td><td>{layout.local_shape(c)}</td>"
            f"<td>{layout.local_box(c)}</td></tr>"
            for r, c in enumerate(layout.coords())
        )
        return f"<table><tr><th>rank</th><th>local shape</th><th>global box</th></tr>{rows}</table>"
