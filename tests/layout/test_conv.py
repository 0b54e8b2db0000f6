"""Halo plans checked against torch itself: every rank assembles its window from the plan only,
runs the op with padding 0, and the concatenation must equal the single-device op."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shardlab.layout import conv_out_length, conv_plan, owner_of, same_padding

from ._conv_helpers import (
    MODES,
    check_lower_bound,
    dependency,
    random_sizes,
    run_sharded,
    tally,
    torch_raises,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


# ---------------------------------------------------------------- forward convolution
def conv_case(sizes, k, st, dl, padding, mode):
    length = sum(sizes)
    x = torch.randn(1, 1, length)
    w = torch.randn(1, 1, k)
    pad = same_padding(k, dl) if padding == "same" else (0, 0) if padding == "valid" else padding
    pad = (pad, pad) if isinstance(pad, int) else pad

    def reference(v, weight=w):
        vp = F.pad(v, pad) if mode == "zeros" else F.pad(v, pad, mode=mode)
        return F.conv1d(vp, weight, stride=st, dilation=dl)

    if torch_raises(lambda: reference(x)):
        with pytest.raises(ValueError):
            conv_plan(sizes, k, st, dl, padding, mode)
        return None
    plan = conv_plan(sizes, k, st, dl, padding, mode)
    if padding == "same" and mode == "zeros":
        torch.testing.assert_close(reference(x), F.conv1d(x, w, padding="same", dilation=dl))
    got = run_sharded(plan, x, lambda win, r: F.conv1d(win, w, stride=st, dilation=dl))
    torch.testing.assert_close(got, reference(x), rtol=1e-12, atol=1e-12)
    check_lower_bound(plan, dependency(lambda v: reference(v, torch.ones(1, 1, k)), length))
    return plan


def test_conv_random_sweep():
    rng = random.Random(0)
    plans = []
    for _ in range(1500):
        sizes = random_sizes(rng)
        k, st, dl = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
        padding = rng.choice(
            ["valid", rng.randint(0, 3), (rng.randint(0, 4), rng.randint(0, 4))]
            + (["same"] if st == 1 else [])
        )
        plans.append(conv_case(sizes, k, st, dl, padding, rng.choice(MODES)))
    assert sum(map(bool, plans)) > 900  # most configurations are valid for torch
    counts = tally(plans)
    assert min(counts.get(f, 0) for f in ("split source", "multi-hop", "empty")) >= 10, counts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("sizes", "k", "st", "dl", "padding"),
    [
        ([3, 0, 1, 4], 3, 1, 1, "same"),  # empty and size-1 shards
        ([1, 1, 1, 1, 1], 5, 1, 1, "same"),  # multi-hop: rank 0 needs rank 2
        ([1, 0, 1, 1, 2], 5, 1, 2, "same"),  # dilated multi-hop
        ([3, 2, 4], 3, 2, 1, 1),  # stride 2 kernel 3
        ([3, 3, 1], 2, 2, 1, 0),  # kernel 2 stride 2 on odd shards
        ([2, 1, 2], 4, 1, 1, "same"),  # even kernel: extra padding on the right
        ([4, 4], 3, 3, 2, (2, 1)),
        ([5], 3, 1, 1, "valid"),  # one rank: nothing to exchange
    ],
)
def test_conv_named_cases(sizes, k, st, dl, padding, mode):
    assert conv_case(sizes, k, st, dl, padding, mode)


def test_multi_hop_and_noncontiguous_recvs():
    plan = conv_plan([1, 1, 1, 1, 1], 5, padding="same")
    assert {src for src, _, _ in plan.recvs(0)} == {1, 2}
    plan = conv_plan([2, 1, 6], 2, dilation=4, padding=(0, 0))  # rank 1: output 2 reads 2, 6
    assert plan.recvs(1) == ((2, 6, 7),)
    plan = conv_plan([1, 1, 2], 3, padding=2, padding_mode="reflect")  # rank 0 reads 2, 1
    assert [tuple(b) for b in plan.recvs(0)] == [(1, 1, 2), (2, 2, 3)]


def test_same_padding_matches_torch():
    x = torch.randn(1, 1, 9)
    for k in range(1, 7):
        for dl in range(1, 4):
            w = torch.randn(1, 1, k)
            ref = F.conv1d(x, w, padding="same", dilation=dl)
            torch.testing.assert_close(F.conv1d(F.pad(x, same_padding(k, dl)), w, dilation=dl), ref)


def test_ownership_rule():
    """Output j -> owner of input clamp(j*stride); transposed: clamp((o + pad_left) // stride)."""
    rng = random.Random(5)
    for _ in range(300):
        sizes = random_sizes(rng, max_size=7)
        k, st, dl, pad = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3), rng.randint(0, 3)
        transposed = rng.random() < 0.4
        op = rng.randint(0, max(st, dl) - 1) if transposed else 0
        try:
            plan = conv_plan(sizes, k, st, dl, pad, transposed=transposed, output_padding=op)
        except ValueError:
            continue
        length = sum(sizes)
        for r in range(len(sizes)):
            for o in range(*plan.out_range(r)):
                anchor = (o + pad) // st if transposed else o * st
                assert owner_of(min(max(anchor, 0), length - 1), sizes) == r


def test_stride1_same_keeps_sizes():
    rng = random.Random(1)
    for _ in range(100):
        sizes = random_sizes(rng, max_size=7)
        k, dl = rng.randint(1, 5), rng.randint(1, 3)
        plan = conv_plan(sizes, k, dilation=dl, padding="same", padding_mode=rng.choice(MODES[::2]))
        assert list(plan.out_sizes) == sizes


def test_pad_plans_keep_every_row_where_it_is():
    """F.pad's plan (a window of 1, ``shift`` = the left pad): the edge ranks grow by the
    pads, each row stays on its rank, and the only rows received are those the padding
    copies from another rank (none for zeros); the result equals torch's pad."""
    rng = random.Random(2)
    for _ in range(300):
        sizes = random_sizes(rng, max_size=6)
        left, right = rng.randint(0, 4), rng.randint(0, 4)
        mode = rng.choice(MODES)
        x = torch.randn(1, 1, sum(sizes))
        torch_mode = "constant" if mode == "zeros" else mode
        try:
            ref = F.pad(x, (left, right), mode=torch_mode)
        except RuntimeError:
            continue
        plan = conv_plan(sizes, 1, 1, 1, (left, right), padding_mode=mode, shift=left)
        nonempty = [r for r, n in enumerate(sizes) if n]
        grown = list(sizes)
        grown[nonempty[0]] += left
        grown[nonempty[-1]] += right
        assert list(plan.out_sizes) == grown, (sizes, left, right, mode)
        got = run_sharded(plan, x, lambda win, r: win)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        needed = {  # the global rows each rank's padding copies, from anyone
            r: {g for g in plan.index_map(r) if g >= 0} - set(range(*_own(sizes, r)))
            for r in range(len(sizes))
        }
        assert {r: plan.rows_received(r) for r in needed} == {r: len(v) for r, v in needed.items()}
        if mode == "zeros":
            assert all(plan.rows_received(r) == 0 for r in range(len(sizes)))


def _own(sizes, r):
    start = sum(sizes[:r])
    return start, start + sizes[r]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(sizes=[0, 0], kernel_size=3), ValueError, "sizes"),
        (dict(sizes=[], kernel_size=3), ValueError, "sizes"),
        (dict(sizes=[2, -1], kernel_size=3), ValueError, "sizes[1]"),
        (dict(sizes=[2, 1.5], kernel_size=3), TypeError, "sizes[1]"),
        (dict(sizes=[4], kernel_size=0), ValueError, "kernel_size"),
        (dict(sizes=[4], kernel_size=3, stride=0), ValueError, "stride"),
        (dict(sizes=[4], kernel_size=3, dilation=0), ValueError, "dilation"),
        (dict(sizes=[4], kernel_size=3, stride=True), TypeError, "stride"),
        (dict(sizes=[4], kernel_size=3, padding=-1), ValueError, "padding"),
        (dict(sizes=[4], kernel_size=3, padding=(1, 2, 3)), ValueError, "padding"),
        (dict(sizes=[4], kernel_size=3, padding="full"), ValueError, "padding"),
        (dict(sizes=[4], kernel_size=3, stride=2, padding="same"), ValueError, "stride 1"),
        (dict(sizes=[4], kernel_size=3, padding_mode="mirror"), ValueError, "padding_mode"),
        (dict(sizes=[2, 2], kernel_size=3, padding=4, padding_mode="reflect"), ValueError, "4"),
        (dict(sizes=[2, 1], kernel_size=3, padding=4, padding_mode="circular"), ValueError, "3"),
        (dict(sizes=[2], kernel_size=5), ValueError, "kernel_size"),
        (dict(sizes=[4], kernel_size=3, output_padding=1), ValueError, "output_padding"),
        (
            dict(sizes=[4], kernel_size=3, stride=2, transposed=True, output_padding=2),
            ValueError,
            "output_padding",
        ),
        (
            dict(sizes=[4], kernel_size=3, transposed=True, padding_mode="reflect"),
            ValueError,
            "zeros",
        ),
        (dict(sizes=[1], kernel_size=1, transposed=True, padding=1), ValueError, "output"),
    ],
)
def test_conv_plan_errors(kwargs, exc, words):
    with pytest.raises(exc, match=None) as info:
        conv_plan(**kwargs)
    assert words in str(info.value)


def test_conv_out_length_matches_torch():
    rng = random.Random(4)
    for _ in range(300):
        length, k, st, dl = (
            rng.randint(1, 12),
            rng.randint(1, 5),
            rng.randint(1, 3),
            rng.randint(1, 3),
        )
        pad = rng.randint(0, k // 2)
        try:
            ref = F.max_pool1d(torch.zeros(1, 1, length), k, st, pad, dl, ceil_mode=True).shape[-1]
        except RuntimeError:
            with pytest.raises(ValueError):
                conv_out_length(length, k, st, dl, pad, pad, ceil_mode=True)
            continue
        assert conv_out_length(length, k, st, dl, pad, pad, ceil_mode=True) == ref


def test_str_speaks_plainly():
    text = str(conv_plan([3, 2, 0, 3], 3, padding="same"))
    assert "in sizes [3, 2, 0, 3] -> out sizes [3, 2, 0, 3]" in text
    assert "rank 1: out [3, 5), window [3, 7), recv [2, 3) from rank 0, [5, 6) from rank 3" in text


def test_plans_are_kept_per_arguments_and_errors_are_not():
    plan = conv_plan((5, 0, 4), 3, padding=1)
    assert conv_plan((5, 0, 4), 3, padding=1) is plan  # kept (a plan is immutable)
    assert conv_plan((5, 0, 4), 3, padding=2) is not plan
    listed = conv_plan([5, 0, 4], 3, padding=1)  # a list: not hashable, planned anew
    assert listed is not plan and listed == plan
    assert plan.local_index(2) is plan.local_index(2)
    for _ in range(2):
        with pytest.raises(ValueError, match="output_padding"):
            conv_plan([5, 0, 4], 3, output_padding=1)
    with pytest.raises(TypeError, match="stride"):  # True == 1, but refused, not a hit
        conv_plan((5, 0, 4), 3, True)
    with pytest.raises(TypeError, match="kernel_size"):
        conv_plan((5, 0, 4), 3.0, padding=1)
