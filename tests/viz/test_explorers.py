"""The explorers driven programmatically: controls redraw, bad input shows an error."""

from __future__ import annotations

import html
import warnings

import pytest
from matplotlib.figure import Figure
from torch.distributed.tensor import Replicate, Shard

import shardlab.viz.explorers as explorers
from shardlab.layout import conv_plan
from shardlab.viz import HaloExplorer, PlacementExplorer, halo_explorer, placement_explorer


@pytest.fixture
def fast_png(monkeypatch):
    """Skip the PNG rendering of every redraw (test_halo_controls_redraw keeps it)."""
    monkeypatch.setattr(explorers, "figure_png", lambda fig, dpi=None: str(id(fig)).encode())


def expected_bytes(sizes, bytes_per_row=4, **kwargs):
    plan = conv_plan(sizes, **kwargs)
    return {r: plan.bytes_per_element_sent(r) * bytes_per_row for r in range(len(sizes))}


def test_halo_controls_redraw():
    e = halo_explorer(static=False)
    assert isinstance(e, HaloExplorer) and e.error_message is None
    assert e.bytes_sent == expected_bytes([5, 5, 4, 4], kernel_size=3, padding="same")
    first, image = e.figure, e.image.value
    e.controls["kernel"].value = 5
    assert e.figure is not first and e.image.value != image
    assert e.bytes_sent == expected_bytes([5, 5, 4, 4], kernel_size=5, padding="same")
    e.controls["dilation"].value = 2
    e.controls["padding_mode"].value = "circular"
    want = expected_bytes(
        [5, 5, 4, 4], kernel_size=5, dilation=2, padding="same", padding_mode="circular"
    )
    assert e.bytes_sent == want and e.bytes_sent[0] > 0
    e.controls["bytes_per_row"].value = 12
    assert e.bytes_sent == {r: n * 3 for r, n in want.items()}
    assert "rows sent" in e.table.value
    assert e.plan.padding_mode == "circular"


def test_ranks_and_sizes_stay_consistent(fast_png):
    e = HaloExplorer(kernel=3, padding=1, stride=2, sizes=[6, 6, 6], ranks=3, length=18)
    e.controls["ranks"].value = 4
    assert e.controls["sizes"].value == "5,5,5,3"
    assert e.figure.shardlab_plan.in_sizes == (5, 5, 5, 3)
    e.controls["length"].value = 8
    assert e.controls["sizes"].value == "2,2,2,2"
    e.controls["sizes"].value = "1, 0, 12"  # uneven, with an empty shard
    assert (e.controls["ranks"].value, e.controls["length"].value) == (3, 13)
    assert e.figure.shardlab_plan.in_sizes == (1, 0, 12)
    assert e.bytes_sent == expected_bytes([1, 0, 12], kernel_size=3, stride=2, padding=1)
    e.controls["sizes"].value = "70,2"  # past the slider's maximum: the slider grows
    assert e.controls["length"].value == 72 and e.error_message is None


@pytest.mark.parametrize(
    "control, value, message",
    [
        ("sizes", "5,x,4", "not a whole number"),
        ("sizes", "0,0", "no input rows"),
        ("sizes", "3,-1", ">= 0"),
        ("padding", "left", "not a whole number"),
        ("padding", "1,2,3", "padding"),
        ("sizes_w", "2,y", "sizes_w"),
        ("bytes_per_row", -4, "bytes_per_row must be >= 0"),
    ],
)
def test_bad_input_shows_an_error(fast_png, control, value, message):
    e = HaloExplorer()
    good = e.figure
    e.controls[control].value = value  # no exception
    assert message in e.error_message
    assert html.escape(message) in e.error.value
    assert e.figure is good  # the last good figure stays
    e.controls[control].value = HaloExplorer.DEFAULTS[control]
    assert e.error_message is None and e.error.value == ""


def test_plan_rejections_show_an_error(fast_png):
    e = HaloExplorer()
    e.controls["stride"].value = 2  # with padding 'same'
    assert "same" in e.error_message
    e.controls["padding"].value = "1"
    assert e.error_message is None
    e.controls["transposed"].value = True
    assert e.error_message is None and e.figure.shardlab_plan.transposed
    e.controls["padding_mode"].value = "reflect"
    assert "transposed" in e.error_message


def test_unexpected_errors_are_shown_too(fast_png, monkeypatch):
    e = HaloExplorer()

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(explorers, "plot_halos", boom)
    e.controls["kernel"].value = 5
    assert e.error_message == "RuntimeError: boom"


def test_second_sharded_dim(fast_png):
    e = HaloExplorer(sizes="3,3", padding=1)
    e.controls["sizes_w"].value = "2,2"
    assert len(e.figure.axes) == 4
    assert set(e.bytes_sent) == {0, 1, 2, 3} and "elements sent" in e.table.value


def test_placement_controls_redraw(fast_png):
    e = placement_explorer(static=False)
    assert isinstance(e, PlacementExplorer)
    assert e.local_shapes == {0: (5, 3), 1: (5, 3), 2: (4, 3), 3: (4, 3)}
    e.controls["sizes"].value = ""
    assert e.local_shapes == {0: (5, 3), 1: (5, 3), 2: (5, 3), 3: (3, 3)}
    e.controls["mesh"].value = "2x2"  # placements still 1 entry: error shown
    assert "placements has 1 entries" in e.error_message
    e.controls["placements"].value = "S(0), R"
    assert e.error_message is None
    assert e.local_shapes == {0: (9, 3), 1: (9, 3), 2: (9, 3), 3: (9, 3)}
    assert e.figure.shardlab_layout.placements == (Shard(0), Replicate())
    e.controls["shape"].value = "4, 6, 8"
    e.controls["dims"].value = "1,-1"
    assert e.figure.shardlab_dims == (1, 2)
    assert "global box" in e.table.value
    e.controls["placements"].value = "Shart(0), R"
    assert "cannot read" in e.error_message
    e.controls["placements"].value = "P, Shard(2)"
    e.controls["sizes"].value = "None, [1, 7]"
    assert e.error_message is None and e.local_shapes[1] == (4, 6, 7)


def test_placement_explorer_accepts_python_values(fast_png):
    e = PlacementExplorer(
        mesh=(2, 2), placements=[Shard(0), Shard(0)], shape=(5,), sizes=[[3, 2], [[2, 1], [1, 1]]]
    )
    assert e.error_message is None
    assert [e.local_shapes[r] for r in range(4)] == [(2,), (1,), (1,), (1,)]


def test_static_fallback(fast_png, monkeypatch):
    fig = halo_explorer(static=True, kernel=5, sizes="4,4")
    assert isinstance(fig, Figure) and fig.shardlab_plan.kernel_size == 5
    with warnings.catch_warnings(record=True) as caught:  # no kernel in pytest
        warnings.simplefilter("always")
        fig = placement_explorer(shape="8,2", sizes="")
    assert isinstance(fig, Figure)
    assert "static figure" in str(caught[-1].message)

    def missing():
        raise ImportError("shardlab.viz explorers need ipywidgets: pip install ipywidgets")

    monkeypatch.setattr(explorers, "require_ipywidgets", missing)
    with pytest.warns(UserWarning, match="pip install ipywidgets"):
        assert isinstance(halo_explorer(), Figure)
    with pytest.raises(ImportError, match="ipywidgets"):
        HaloExplorer()


def test_unknown_control_and_display(fast_png):
    with pytest.raises(TypeError, match="unknown controls"):
        HaloExplorer(kernal=3)
    with pytest.raises(TypeError, match="unknown controls"):
        placement_explorer(static=True, mesh_shape=(2,))
    bundle = PlacementExplorer()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    # a static snapshot for pages without a kernel (the docs): values, figure, table
    snapshot = bundle["text/html"]
    assert "mesh <code>4</code>" in snapshot and "data:image/png;base64," in snapshot
    assert "<table>" in snapshot
    bad = HaloExplorer(sizes="5,x")._repr_mimebundle_()["text/html"]
    assert "sizes" in bad and "data:image/png" not in bad
