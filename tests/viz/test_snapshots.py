"""Canonical figures against their PNG snapshots (``--update-snapshots`` rewrites them)."""

import io

import matplotlib
import matplotlib.image
import pytest

from shardlab.viz import plot_halos

from .snapshot_cases import CASES, DPI, SNAPSHOTS, TOLERANCE, difference, render, write


@pytest.mark.parametrize("name", sorted(CASES))
def test_snapshot(name, update_snapshots):
    if update_snapshots:
        write(name)
    path = SNAPSHOTS / f"{name}.png"
    assert path.exists(), f"no snapshot {path}: run python -m tests.viz.make_snapshots"
    want = matplotlib.image.imread(path)[..., :3]
    got = render(name)
    assert got.shape == want.shape
    assert difference(got, want) < TOLERANCE, f"{name} differs from {path}"


def test_snapshots_detect_small_changes_but_not_font_rendering():
    base = render("halos_k3_4ranks")
    assert difference(base, base) == 0.0
    circular = plot_halos([5, 5, 4, 4], 3, padding="same", padding_mode="circular")
    assert difference(base, as_array(circular)) > TOLERANCE
    with matplotlib.rc_context({"text.hinting": "none"}):
        unhinted = as_array(plot_halos([5, 5, 4, 4], 3, padding="same"))
    assert difference(base, unhinted) < TOLERANCE


def as_array(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    buf.seek(0)
    return matplotlib.image.imread(buf, format="png")[..., :3]
