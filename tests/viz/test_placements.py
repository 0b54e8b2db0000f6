"""plot_placements over the space of meshes, placements and (uneven, empty) sizes: the drawn
rectangles are exactly ``ShardLayout.local_box`` along the shown dims."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch
from matplotlib.colors import to_rgb
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.layout import ShardLayout
from shardlab.viz import as_layout, plot_placements
from shardlab.viz._common import rank_colour
from shardlab.viz.placements import shown_dims

from ._helpers import composition, rank_rectangles, rectangles, render

MESHES = [(1,), (2,), (3,), (4,), (1, 2), (2, 1), (2, 2), (3, 2)]


def random_sizes(rng, shape, mesh, placements):
    """Per mesh dim: None, a random composition, or for a dim sharded twice one per piece."""
    entries, outer = [], None
    for m, p in enumerate(placements):
        if not isinstance(p, Shard):
            entries.append(None)
            continue
        nested = m == 1 and placements[0] == p
        wholes = outer if nested else [shape[p.dim]]
        entry = [composition(rng, w, mesh[m]) for w in wholes]
        entries.append(entry if nested else entry[0])
        if m == 0:
            outer = entry[0]
    return entries


def check_blocks(fig, layout: ShardLayout) -> None:
    """Stored and drawn rectangles against the layout math."""
    dims = fig.shardlab_dims
    assert dims == shown_dims(layout)
    ax = fig.axes[0]
    coords = layout.coords()
    assert [b[0] for b in fig.shardlab_blocks] == list(range(len(coords)))
    for r, rows, cols in fig.shardlab_blocks:
        box = layout.local_box(coords[r])
        assert rows == (box[dims[0]] if len(dims) == 2 else (0, 1))
        assert cols == (box[dims[-1]] if dims else (0, 1))
        empty = layout.numel(coords[r]) == 0
        assert (r in fig.shardlab_empty) == empty
        drawn = [g[:4] for g in rank_rectangles(ax, r)]
        if empty:  # a thick line (or dot) in the rank's colour instead of a block
            assert any(to_rgb(line.get_color()) == to_rgb(rank_colour(r)) for line in ax.lines)
        else:
            want = (cols[0], rows[0], cols[1] - cols[0], rows[1] - rows[0])
            assert want in drawn, (r, want, drawn)


def check_coverage(fig, layout: ShardLayout) -> None:
    """Every cell of the drawn grid is held by as many ranks as the mesh dims that do not
    cut a drawn dim (replicas, partial values, a hidden sharded dim)."""
    dims = fig.shardlab_dims
    splitting = [m for m, p in enumerate(layout.placements) if getattr(p, "dim", -1) in dims]
    hidden = [d for d in range(len(layout.global_shape)) if d not in dims]
    if any(layout.global_shape[d] == 0 for d in range(len(layout.global_shape))) or any(
        len(layout.sizes_along(d)) > 1 for d in hidden
    ):
        return
    want = math.prod(n for m, n in enumerate(layout.mesh_shape) if m not in splitting)
    nrows = layout.global_shape[dims[0]] if len(dims) == 2 else 1
    ncols = layout.global_shape[dims[-1]] if dims else 1
    for i, j in itertools.product(range(nrows), range(ncols)):
        held = [
            r
            for r, rows, cols in fig.shardlab_blocks
            if rows[0] <= i < rows[1] and cols[0] <= j < cols[1]
        ]
        assert len(held) == want, (i, j, held)


@pytest.mark.parametrize("mesh", MESHES)
def test_every_placement_combination(mesh):
    rng = random.Random(hash(mesh) % 1000)
    shape = (rng.randint(1, 9), rng.randint(0, 6))
    choices = [Shard(0), Shard(1), Replicate(), Partial()]
    for k, places in enumerate(itertools.product(choices, repeat=len(mesh))):
        sizes = random_sizes(rng, shape, mesh, places)
        layout = ShardLayout.build(shape, mesh, places, sizes)
        fig = plot_placements(layout)
        check_blocks(fig, layout)
        check_coverage(fig, layout)
        if k % 8 == 3:
            render(fig)


def test_random_sweep_any_rank_and_dims():
    rng = random.Random(1234)
    for k in range(40):
        mesh = rng.choice(MESHES)
        shape = tuple(rng.randint(0, 6) for _ in range(rng.randint(0, 4)))
        choices = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]
        places = [rng.choice(choices) for _ in mesh]
        layout = ShardLayout.build(shape, mesh, places, random_sizes(rng, shape, mesh, places))
        dims = None
        if len(shape) >= 2 and rng.random() < 0.4:
            dims = tuple(rng.sample(range(len(shape)), 2))
        fig = plot_placements(layout, dims=dims)
        assert fig.shardlab_dims == shown_dims(layout, dims)
        if dims is None:
            check_blocks(fig, layout)
        check_coverage(fig, layout)
        if k % 10 == 0:
            render(fig)


def test_uneven_title_and_blocks():
    fig = plot_placements(
        mesh_shape=(4,), placements=[Shard(0)], global_shape=(18, 3), sizes=[5, 5, 4, 4]
    )
    title = fig.axes[0].get_title()
    assert "Shard(0) sizes [5, 5, 4, 4] on mesh dim 0" in title
    assert fig.shardlab_blocks == [
        (0, (0, 5), (0, 3)), (1, (5, 10), (0, 3)), (2, (10, 14), (0, 3)), (3, (14, 18), (0, 3)),
    ]  # fmt: skip
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == [f"rank {r}: {s}" for r, s in enumerate(["(5, 3)"] * 2 + ["(4, 3)"] * 2)]


def test_empty_shard_is_drawn_and_listed():
    fig = plot_placements(mesh_shape=(4,), placements=[Shard(0)], global_shape=(5,))
    assert fig.shardlab_empty == [3]  # chunk sizes (2, 2, 1, 0)
    assert fig.shardlab_blocks[3] == (3, (0, 1), (5, 5))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "rank 3: empty (0,)" in labels
    assert any("r3" in t.get_text() for t in fig.axes[0].texts)
    render(fig)


def test_replicate_and_partial_look_different_from_shard():
    shard = plot_placements(mesh_shape=(2,), placements=[Shard(0)], global_shape=(4, 4))
    rep = plot_placements(mesh_shape=(2,), placements=[Replicate()], global_shape=(4, 4))
    part = plot_placements(mesh_shape=(2,), placements=[Partial()], global_shape=(4, 4))
    assert rep.shardlab_blocks == part.shardlab_blocks == [(0, (0, 4), (0, 4)), (1, (0, 4), (0, 4))]
    ax = shard.axes[0]
    assert all(front for r in (0, 1) for *_, front in rank_rectangles(ax, r))
    ax = rep.axes[0]  # rank 1's copy is stacked behind rank 0's, with an offset
    assert [f for *_, f in rank_rectangles(ax, 0)] == [True]
    assert [f for *_, f in rank_rectangles(ax, 1)] == [False]
    assert "replicated" in " ".join(t.get_text() for t in ax.texts)
    ax = part.axes[0]
    dashed = [p for p in ax.patches if p.get_linestyle() == "--"]
    assert len(dashed) == 2
    assert "partial sum" in " ".join(t.get_text() for t in ax.texts)
    assert "Partial(sum) on mesh dim 0" in ax.get_title()
    for fig in (rep, part):
        render(fig)


def test_dim_sharded_twice():
    layout = ShardLayout.build((5, 2), (2, 2), [Shard(0), Shard(0)], [[3, 2], [[2, 1], [1, 1]]])
    fig = plot_placements(layout)
    assert [b[1] for b in fig.shardlab_blocks] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    check_coverage(fig, layout)
    one_d = plot_placements(layout, dims=(0,))
    assert [b[2] for b in one_d.shardlab_blocks] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    render(one_d)


def test_inputs_sharding_attribute_dtensor_and_tensor(tmp_path):
    layout = ShardLayout.build((6, 4), (2,), [Shard(1)], [1, 3])
    assert as_layout(SimpleNamespace(sharding=layout)) is layout
    fake = SimpleNamespace(
        device_mesh=SimpleNamespace(shape=(2, 2)), placements=(Shard(0), Replicate()),
        shape=torch.Size([6, 4]), layout=torch.strided,
    )  # fmt: skip
    assert as_layout(fake) == ShardLayout.build((6, 4), (2, 2), [Shard(0), Replicate()])
    got = as_layout(torch.zeros(6, 4), mesh_shape=(2,), placements=[Shard(0)], sizes=[5, 1])
    assert got.sizes_along(0) == (5, 1)
    fig = plot_placements(SimpleNamespace(sharding=layout), ax=None, title="mine")
    assert fig.axes[0].get_title() == "mine"
    assert [b[2] for b in fig.shardlab_blocks] == [(0, 1), (1, 4)]
    fig.savefig(tmp_path / "x.png")


def test_draw_into_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot(1, 2, 2)
    out = plot_placements(mesh_shape=(3,), placements=[Shard(0)], global_shape=(6,), ax=ax)
    assert out is fig
    assert len(rectangles(ax)) == 3
    render(fig)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(placements=[Shard(0)]), TypeError),
        (dict(placements=[Shard(2)], global_shape=(3, 3)), ValueError),
        (dict(placements=[Shard(0)], global_shape=(3, 3), dims=(0, 0)), ValueError),
        (dict(placements=[Shard(0)], global_shape=(3, 3), dims=(5,)), ValueError),
    ],
)
def test_bad_input_raises(kwargs, error):
    with pytest.raises(error):
        plot_placements(mesh_shape=(2,), **kwargs)


def test_unknown_object_raises():
    with pytest.raises(TypeError, match="cannot draw"):
        plot_placements(object())
