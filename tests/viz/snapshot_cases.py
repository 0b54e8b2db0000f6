"""Canonical figures kept as PNG snapshots in ``tests/viz/snapshots`` (small, dpi 60).

Rewrite them after an intended change with ``python -m tests.viz.make_snapshots`` or
``python -m pytest tests/viz/test_snapshots.py --update-snapshots``.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import matplotlib.image
import numpy as np
from torch.distributed.tensor import Shard

from shardlab.trace.events import Event, Trace
from shardlab.viz import plot_collectives, plot_halos, plot_placements

SNAPSHOTS = Path(__file__).parent / "snapshots"
DPI = 60
CELL = 8  # pixels averaged per side before comparing
TOLERANCE = 0.006  # fraction of cells allowed to differ (see difference)


def ring_trace(world: int = 3) -> Trace:
    events = []
    for r in range(world):
        group = tuple(range(world))
        args = ("float32", ((6,),), "conv1d.halo forward")
        events.append(Event(r, 0, "send", "isend", group, (r + 1) % world, 24, *args))
        events.append(Event(r, 1, "recv", "irecv", group, (r - 1) % world, 24, *args))
        events.append(
            Event(r, 2, "all_reduce", "all_reduce", group, None, 1536, "float32", ((384,),),
                  "linear.grad")
        )  # fmt: skip
    return Trace(events)


CASES = {
    "placements_shard0_uneven": lambda: plot_placements(
        mesh_shape=(4,), placements=[Shard(0)], global_shape=(18, 3), sizes=[5, 5, 4, 4]
    ),
    "halos_k3_4ranks": lambda: plot_halos([5, 5, 4, 4], 3, padding="same"),
    "collectives_ring": lambda: plot_collectives(ring_trace()),
}


def render(name: str) -> np.ndarray:
    """The case's figure as an RGB float array, drawn with matplotlib's default style."""
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        buf = io.BytesIO()
        CASES[name]().savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    return matplotlib.image.imread(buf, format="png")[..., :3]


def write(name: str) -> Path:
    path = SNAPSHOTS / f"{name}.png"
    SNAPSHOTS.mkdir(exist_ok=True)
    matplotlib.image.imsave(path, render(name))
    return path


def difference(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of 8x8-pixel cells whose average colour differs by more than 0.15.

    Averaging forgives anti-aliasing, hinting and sub-pixel text shifts (< 0.4% of cells);
    a moved block, halo or arrow changes several percent of cells.
    """

    def pool(x):
        h, w = x.shape[0] // CELL * CELL, x.shape[1] // CELL * CELL
        return x[:h, :w].reshape(h // CELL, CELL, w // CELL, CELL, 3).mean(axis=(1, 3))

    return float((np.abs(pool(a) - pool(b)).max(axis=2) > 0.15).mean())
