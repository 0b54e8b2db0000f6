"""2-D domain parallelism (H on mesh dim 0, W on mesh dim 1) as a product of 1-D plans,
checked against torch's conv2d / conv_transpose2d on one device."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shardlab.layout import conv_plan_nd, offsets

from ._conv_helpers import MODES, random_sizes

DT = torch.float64


def assemble(plan, coord, x):
    """Rank ``coord``'s window from its own block and received blocks only (grid order)."""
    (sh, sw) = (plan.plans[0].in_sizes, plan.plans[1].in_sizes)
    oh, ow = offsets(sh), offsets(sw)

    def held(src):  # the block rank ``src`` holds
        i, j = src
        return x[..., oh[i] : oh[i] + sh[i], ow[j] : ow[j] + sw[j]]

    nh, nw = plan.buffer_shape(coord)
    buf = torch.zeros(*x.shape[:-2], nh + 1, nw + 1, dtype=x.dtype)  # + pad row and column
    for b in plan.blocks(coord):
        (h0, h1), (w0, w1) = b.box
        i, j = b.src
        piece = held(b.src)[..., h0 - oh[i] : h1 - oh[i], w0 - ow[j] : w1 - ow[j]]
        assert piece.shape[-2:] == b.shape, "box outside the source's block"
        buf[..., b.at[0] : b.at[0] + b.shape[0], b.at[1] : b.at[1] + b.shape[1]] = piece
    idx_h, idx_w = (torch.tensor(i, dtype=torch.long) for i in plan.local_index(coord))
    idx_h[idx_h < 0], idx_w[idx_w < 0] = nh, nw
    return buf.index_select(-2, idx_h).index_select(-1, idx_w)


def needed_2d(f, shape, box):
    """Inputs read by outputs in ``box``, from autograd of the single-device op (ones kernel)."""
    x = torch.randn(1, 1, *shape, dtype=DT, requires_grad=True)
    (h0, h1), (w0, w1) = box
    f(x)[..., h0:h1, w0:w1].sum().backward()
    return {tuple(i) for i in torch.nonzero(x.grad[0, 0]).tolist()}


def reference_2d(v, weight, cfg):
    """The single-device op: F.pad (like nn.Conv2d) then conv2d, or conv_transpose2d + crop."""
    st, dl, pad, mode, op = cfg["st"], cfg["dl"], cfg["pad"], cfg["mode"], cfg["op"]
    if cfg["transposed"]:
        full = F.conv_transpose2d(v, weight, stride=st, dilation=dl, output_padding=op)
        h, w = full.shape[-2:]
        return full[..., pad[0][0] : h - pad[0][1], pad[1][0] : w - pad[1][1]]
    flat = (*pad[1], *pad[0])  # F.pad wants the last dim first
    vp = F.pad(v, flat) if mode == "zeros" else F.pad(v, flat, mode=mode)
    return F.conv2d(vp, weight, stride=st, dilation=dl)


def random_cfg(rng):
    st = tuple(rng.randint(1, 3) for _ in range(2))
    dl = tuple(rng.randint(1, 2) for _ in range(2))
    transposed = rng.random() < 0.3
    return dict(
        sizes=[random_sizes(rng, max_size=4), random_sizes(rng, max_size=4)],
        k=tuple(rng.randint(1, 4) for _ in range(2)),
        st=st,
        dl=dl,
        pad=[(rng.randint(0, 2), rng.randint(0, 2)) for _ in range(2)],
        transposed=transposed,
        mode="zeros" if transposed else rng.choice(MODES),
        op=tuple(
            rng.randint(0, max(s, d) - 1) if transposed else 0 for s, d in zip(st, dl, strict=True)
        ),
    )


def test_conv2d_random_sweep():
    rng = random.Random(0)
    done = 0
    for _ in range(400):
        cfg = random_cfg(rng)
        sizes, k = cfg["sizes"], cfg["k"]
        shape = tuple(sum(s) for s in sizes)
        args = (
            sizes,
            k,
            cfg["st"],
            cfg["dl"],
            cfg["pad"],
            cfg["mode"],
            cfg["transposed"],
            cfg["op"],
        )
        x, w = torch.randn(1, 1, *shape, dtype=DT), torch.randn(1, 1, *k, dtype=DT)
        try:
            ref = reference_2d(x, w, cfg)
            assert min(ref.shape) > 0
        except (RuntimeError, AssertionError):
            with pytest.raises(ValueError):
                conv_plan_nd(*args)
            continue
        plan = conv_plan_nd(*args)
        got = torch.full_like(ref, torch.nan)
        for coord in plan.coords():
            (a0, a1), (b0, b1) = plan.out_box(coord)
            if a0 == a1 or b0 == b1:
                assert not plan.recvs(coord)
                continue
            win = assemble(plan, coord, x)
            if cfg["transposed"]:
                y = F.conv_transpose2d(win, w, stride=cfg["st"], dilation=cfg["dl"])
                (c0, c1), (d0, d1) = plan.crop(coord)
                y = y[..., c0:c1, d0:d1]
            else:
                y = F.conv2d(win, w, stride=cfg["st"], dilation=cfg["dl"])
            got[..., a0:a1, b0:b1] = y
            check_lower_bound_2d(plan, coord, cfg, shape, k)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        sent = sum(plan.elements_sent(c) for c in plan.coords())
        assert sent == sum(plan.elements_received(c) for c in plan.coords())
        done += 1
    assert done > 200


def check_lower_bound_2d(plan, coord, cfg, shape, k):
    """Received elements == needed minus own block, each exactly once (corners included)."""
    ones = torch.ones(1, 1, *k, dtype=DT)
    needed = needed_2d(lambda v: reference_2d(v, ones, cfg), shape, plan.out_box(coord))
    received = [
        (h, v) for b in plan.recvs(coord) for h in range(*b.box[0]) for v in range(*b.box[1])
    ]
    (oh, ow), (i, j), sizes = (offsets(s) for s in cfg["sizes"]), coord, cfg["sizes"]
    own = {
        (h, v)
        for h, v in needed
        if oh[i] <= h < oh[i] + sizes[0][i] and ow[j] <= v < ow[j] + sizes[1][j]
    }
    assert sorted(received) == sorted(needed - own)
    assert plan.elements_received(coord) == len(received)


def test_corners_come_from_diagonal_ranks():
    plan = conv_plan_nd([[2, 2], [2, 2]], 3, padding="same")
    srcs = {b.src for b in plan.recvs((0, 0))}
    assert srcs == {(0, 1), (1, 0), (1, 1)}
    corner = [b for b in plan.recvs((0, 0)) if b.src == (1, 1)]
    assert [b.box for b in corner] == [((2, 3), (2, 3))]
    assert ((0, 0), ((2, 3), (2, 3))) in plan.sends((1, 1))


def test_conv_plan_nd_argument_errors():
    with pytest.raises(ValueError, match="stride"):
        conv_plan_nd([[2], [2]], 1, stride=(1, 1, 1))
    with pytest.raises(TypeError, match="sizes"):
        conv_plan_nd([], 1)
    with pytest.raises(ValueError, match="coord"):
        conv_plan_nd([[2], [2]], 1).blocks((0, 1))
