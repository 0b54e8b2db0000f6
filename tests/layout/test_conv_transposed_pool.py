"""Transposed convolution and pooling (max / avg, ceil_mode) plans, checked against torch."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shardlab.layout import OVERHANG, conv_out_length, conv_plan

from ._conv_helpers import (
    check_lower_bound,
    dependency,
    random_sizes,
    run_sharded,
    tally,
    torch_raises,
)


# ---------------------------------------------------------------- transposed convolution
def transposed_case(sizes, k, st, dl, pad, op):
    length = sum(sizes)
    x, w = torch.randn(1, 1, length), torch.randn(1, 1, k)

    def reference(v, weight=w):
        full = F.conv_transpose1d(v, weight, stride=st, dilation=dl, output_padding=op)
        return full[..., pad[0] : full.shape[-1] - pad[1]]

    if pad[0] == pad[1]:

        def direct():  # noqa: E306
            return F.conv_transpose1d(x, w, None, st, pad[0], op, 1, dl)

        if torch_raises(direct):
            with pytest.raises(ValueError):
                conv_plan(sizes, k, st, dl, pad, transposed=True, output_padding=op)
            return None
        torch.testing.assert_close(direct(), reference(x))
    if reference(x).shape[-1] < 1:
        with pytest.raises(ValueError):
            conv_plan(sizes, k, st, dl, pad, transposed=True, output_padding=op)
        return None
    plan = conv_plan(sizes, k, st, dl, pad, transposed=True, output_padding=op)
    got = run_sharded(plan, x, lambda win, r: F.conv_transpose1d(win, w, stride=st, dilation=dl))
    torch.testing.assert_close(got, reference(x), rtol=1e-12, atol=1e-12)
    check_lower_bound(plan, dependency(lambda v: reference(v, torch.ones(1, 1, k)), length))
    return plan


def test_transposed_random_sweep():
    rng = random.Random(2)
    plans = []
    for _ in range(1000):
        k, st, dl = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
        op = rng.randint(0, max(st, dl) - 1)
        pad = rng.choice([(0, 0), (1, 1), (2, 2), (rng.randint(0, 3), rng.randint(0, 3))])
        plans.append(transposed_case(random_sizes(rng), k, st, dl, pad, op))
    assert sum(map(bool, plans)) > 600
    counts = tally(plans)
    assert min(counts.get(f, 0) for f in ("multi-hop", "empty")) >= 10, counts
    assert counts.get("split source", 0) >= 1, counts  # rarer: dilation > stride, few outputs


def test_transposed_stride_equals_kernel_multiplies_sizes():
    for s in range(1, 4):
        plan = conv_plan([3, 0, 1, 2], s, stride=s, transposed=True)
        assert plan.out_sizes == (3 * s, 0, s, 2 * s)
        assert all(not plan.recvs(r) for r in range(4))
    assert transposed_case([3, 0, 1, 2], 4, 2, 1, (1, 1), 1)


# ---------------------------------------------------------------- pooling
def pool_case(sizes, k, st, dl, pad, ceil_mode, kind):
    length = sum(sizes)
    x = torch.randn(1, 1, length)
    if kind == "max":

        def reference(v):  # noqa: E306
            return F.max_pool1d(v, k, st, pad, dl, ceil_mode=ceil_mode)
    else:

        def reference(v):  # noqa: E306
            return F.avg_pool1d(v, k, st, pad, ceil_mode=ceil_mode, count_include_pad=True)

    if torch_raises(lambda: reference(x)):
        with pytest.raises(ValueError):
            conv_plan(sizes, k, st, dl, pad, ceil_mode=ceil_mode)
        return None
    plan = conv_plan(sizes, k, st, dl, pad, ceil_mode=ceil_mode)
    if kind == "max":
        got = run_sharded(plan, x, lambda win, r: F.max_pool1d(win, k, st, 0, dl), -torch.inf)
        dep = dependency(reference, length)
    else:

        def local(win, r):  # divide by the positions that are not OVERHANG, like torch
            inside = (torch.tensor(plan.index_map(r)) != OVERHANG).to(win.dtype).view(1, 1, -1)
            return F.avg_pool1d(win, k, st) / F.avg_pool1d(inside, k, st)

        got = run_sharded(plan, x, local)
        dep = dependency(reference, length)
    torch.testing.assert_close(got, reference(x), rtol=1e-12, atol=1e-12)
    check_lower_bound(plan, dep)
    return plan


def test_pool_random_sweep():
    rng = random.Random(3)
    plans = []
    for _ in range(1000):
        kind = rng.choice(["max", "avg"])
        k, st = rng.randint(1, 5), rng.randint(1, 3)
        dl = rng.randint(1, 3) if kind == "max" else 1
        pad = rng.randint(0, k // 2)
        plans.append(pool_case(random_sizes(rng), k, st, dl, pad, rng.random() < 0.6, kind))
    assert sum(map(bool, plans)) > 600
    assert tally(plans).get("overhang", 0) >= 20


def test_ceil_mode_overhang_is_marked():
    plan = conv_plan([2, 4], 3, stride=2, ceil_mode=True)  # last window [4, 7) hangs past 6
    assert plan.out_length == 3 == conv_out_length(6, 3, 2, ceil_mode=True)
    assert plan.index_map(1) == (2, 3, 4, 5, OVERHANG) and plan.recvs(0) == ((1, 2, 3),)
    assert pool_case([2, 4], 3, 2, 1, 0, True, "avg") and pool_case([2, 4], 3, 2, 1, 1, True, "max")
