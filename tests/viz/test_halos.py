"""plot_halos over the space of window ops: the drawn halos are exactly the plan's recvs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from matplotlib.figure import Figure

from shardlab.layout import conv_plan, conv_plan_nd
from shardlab.viz import plot_halos
from shardlab.viz._common import PAD_COLOUR, rank_colour
from shardlab.viz.halos import BAR

from ._helpers import composition, rectangles, render

MODES = ("zeros", "reflect", "replicate", "circular")
PADDINGS = (0, 1, 2, (1, 2), (0, 3), "same", "valid")


def random_config(rng):
    nranks = rng.randint(1, 4)
    sizes = composition(rng, rng.randint(1, 12), nranks)
    if sum(sizes) == 0:
        sizes[0] = 1
    transposed = rng.random() < 0.2
    return dict(
        sizes=sizes,
        kernel_size=rng.randint(1, 5),
        stride=rng.choice((1, 1, 2)),
        dilation=rng.choice((1, 1, 2)),
        padding=rng.choice(PADDINGS),
        padding_mode="zeros" if transposed else rng.choice(MODES),
        transposed=transposed,
    )


def plan_or_error(cfg):
    args = dict(cfg)
    sizes = args.pop("sizes")
    try:
        return conv_plan(sizes, **args), None
    except ValueError as exc:
        return None, exc


def check_1d(fig, plan) -> None:
    want = [(r, src, a, b) for r in range(len(plan.in_sizes)) for src, a, b in plan.recvs(r)]
    assert fig.shardlab_halos == want
    assert fig.shardlab_sent == {
        r: plan.bytes_per_element_sent(r) for r in range(len(plan.in_sizes))
    }
    ax = fig.axes[0]
    drawn = Counter()
    for src in set(range(len(plan.in_sizes))):
        for x, y, w, h, _ in rectangles(ax, rank_colour(src), hatch="///"):
            drawn[round(y + BAR), src, x, x + w] += 1
            assert h == pytest.approx(2 * BAR)
    assert drawn == Counter(want)
    for r, n in enumerate(plan.in_sizes):  # own rows: a solid bar in the lane
        if n:
            own = [g for g in rectangles(ax, rank_colour(r)) if round(g[1] + BAR) == r]
            assert any(g[2] == n for g in own)
    pads = rectangles(ax, PAD_COLOUR)
    for r in range(len(plan.in_sizes)):
        w0, w1 = plan.window(r)
        shift = 0 if plan.transposed else plan.padding[0]
        i0, i1 = w0 - shift, w1 - shift
        lane = [g for g in pads if round(g[1] + BAR) == r]
        want_pad = plan.out_sizes[r] and (i0 < 0 or i1 > sum(plan.in_sizes))
        assert bool(lane) == bool(want_pad), (r, i0, i1, lane)


def test_random_sweep_1d():
    rng = random.Random(7)
    checked = 0
    for k in range(60):
        cfg = random_config(rng)
        plan, error = plan_or_error(cfg)
        if error is not None:
            with pytest.raises(ValueError) as info:
                plot_halos(**cfg)
            assert str(info.value) == str(error)
            continue
        fig = plot_halos(**cfg)
        check_1d(fig, plan)
        checked += 1
        if k % 15 == 0:
            render(fig)
    assert checked > 30


@pytest.mark.parametrize(
    "cfg",
    [
        dict(sizes=[5, 5, 4, 4], kernel_size=3, padding="same"),
        dict(sizes=[6, 6, 6], kernel_size=3, stride=2, padding=1),
        dict(sizes=[4, 4, 4], kernel_size=3, dilation=2, padding="same"),
        dict(sizes=[5, 5, 4, 4], kernel_size=3, padding=1, padding_mode="circular"),
        dict(sizes=[3, 0, 3, 2], kernel_size=5, padding="same", padding_mode="reflect"),
        dict(sizes=[1, 1, 1, 1, 1], kernel_size=7, padding="same", padding_mode="replicate"),
        dict(sizes=[3, 3, 2], kernel_size=4, stride=2, padding=1, transposed=True),
    ],
    ids=["k3", "stride2", "dilation2", "circular", "reflect-empty", "multihop", "transposed"],
)
def test_canonical_configs(cfg):
    plan, error = plan_or_error(cfg)
    assert error is None
    fig = plot_halos(**cfg, bytes_per_row=12)
    check_1d(fig, plan)
    text = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert f"sends {plan.bytes_per_element_sent(0)} row" in text
    render(fig)


def test_multihop_and_wrap_sources():
    fig = plot_halos([1, 1, 1, 1, 1], 5, padding="same")
    assert (0, 2, 2, 3) in fig.shardlab_halos  # two ranks away
    fig = plot_halos([5, 5, 4, 4], 3, padding=1, padding_mode="circular")
    assert (0, 3, 17, 18) in fig.shardlab_halos and (3, 0, 0, 1) in fig.shardlab_halos
    assert sum(1 for t in fig.axes[0].texts if t.get_text() == "wrap") == 2


def test_two_sharded_dims():
    rng, rendered = random.Random(11), False
    for _ in range(10):
        sizes_h = composition(rng, rng.randint(1, 8), rng.randint(1, 3))
        sizes_w = composition(rng, rng.randint(1, 8), rng.randint(1, 3))
        if not sum(sizes_h) or not sum(sizes_w):
            continue
        args = dict(
            kernel_size=rng.randint(1, 4),
            padding=rng.choice((0, 1, "same", (0, 2))),
            padding_mode=rng.choice(MODES),
        )
        pad = args["padding"]  # plot_halos: one padding for both dims
        both = dict(args, padding=pad if isinstance(pad, (int, str)) else [pad, pad])
        try:
            plan = conv_plan_nd([sizes_h, sizes_w], **both)
        except ValueError:
            continue
        fig = plot_halos(sizes_h, sizes_w=sizes_w, **args)
        nw = len(sizes_w)
        want = [
            (i * nw + j, b.src[0] * nw + b.src[1], *b.box)
            for i, j in plan.coords()
            for b in plan.recvs((i, j))
        ]
        assert fig.shardlab_halos == want
        assert len(fig.axes) == len(sizes_h) * nw
        for rank, (i, j) in enumerate(plan.coords()):
            ax = fig.axes[rank]
            hatched = sorted(g[:4] for g in rectangles(ax, hatch="///"))
            boxes = sorted((w0, h0, w1 - w0, h1 - h0) for _, _, (h0, h1), (w0, w1) in
                           [h for h in want if h[0] == rank])  # fmt: skip
            assert hatched == boxes
            assert fig.shardlab_sent[rank] == plan.elements_sent((i, j))
        if not rendered:
            render(fig)
            rendered = True


def test_corners_come_from_diagonal_ranks():
    fig = plot_halos([3, 3], 3, padding="same", sizes_w=[3, 3])
    assert (0, 3, (3, 4), (3, 4)) in fig.shardlab_halos  # rank (0,0) gets (1,1)'s corner


def test_given_axes():
    fig = Figure()
    ax = fig.add_subplot(2, 1, 1)
    assert plot_halos([2, 2], 3, padding=1, ax=ax) is fig
    ax2 = fig.add_subplot(2, 1, 2)
    assert plot_halos([2, 2], 3, padding=1, sizes_w=[2, 1], ax=ax2) is fig
    assert len(fig.axes) == 1 + 4
    render(fig)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(sizes=[4, 4], kernel_size=3, stride=2, padding="same"), "same"),
        (dict(sizes=[0, 0], kernel_size=3), "no input rows"),
        (dict(sizes=[2, 1], kernel_size=9), "output would have"),
        (dict(sizes=[2, 2], kernel_size=3, padding=4, padding_mode="reflect"), "too large"),
    ],
)
def test_rejected_configs_raise_the_plan_error(args, match):
    with pytest.raises(ValueError, match=match):
        plot_halos(**args)
