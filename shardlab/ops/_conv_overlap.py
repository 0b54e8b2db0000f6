"""A convolution whose halo messages travel while it computes.

One sharded spatial dim, rank r's window along it (k = 3, padding 1, stride 1)::

    window   [ 0 | a b c d e f | g ]        my rows a..f; g comes from rank r+1
    outputs    0   1 2 3 4       5          1..4 read my rows only (the interior)

1. post the halo messages (receives and sends, point to point);
2. the window buffer: padding, my rows, and zeros where the received rows go; the
   convolution of all of it while the messages travel: the interior outputs are
   final, the outputs at the two ends (0 and 5 here) provisional;
3. wait; the received rows into the window; the two ends again, from the now
   complete window, over their provisional values.

The same messages and results as exchanging first (``conv.halo_overlap(False)``),
the same memory (one window, saved for backward as before), and the exchange hidden
behind the whole convolution. Backward as :class:`shardlab.comm.halo.Halo`'s: the
window's gradient, its received rows' part sent home.
"""

from __future__ import annotations

import torch

from shardlab.comm._once import first_order
from shardlab.comm.halo import keep_for_send_back, post_halo, send_back, simple_window
from shardlab.comm.recompute import fenced, kept

aten = torch.ops.aten


def interior(plan, me, offset, k, s, d):
    """The window's geometry when some of rank ``me``'s outputs read its own rows only
    and some read halo rows (else None: nothing to overlap). Returns (first, before,
    width, o0, o1, outputs): ``first``, my first row the window holds (a strided window
    may skip my first rows); ``before``, the window rows in front of it; ``o0..o1``, the
    interior of ``outputs``."""
    simple = simple_window(plan, me)
    if simple is None:
        return None
    lead, trail = simple
    blocks = list(plan.blocks(me))
    mine = [i for i, (src, _, _) in enumerate(blocks) if src == me]
    if len(mine) != 1:
        return None
    _, a, b = blocks[mine[0]]
    before = lead + sum(hi - lo for _, lo, hi in blocks[: mine[0]])
    width = lead + sum(hi - lo for _, lo, hi in blocks) + trail
    e = d * (k - 1) + 1  # rows one output reads
    outputs = (width - e) // s + 1 if width >= e else 0
    o0, o1 = -(-before // s), (before + (b - a) - e) // s
    if outputs != plan.out_sizes[me] or not 0 <= o0 <= o1 < outputs:
        return None
    if (o0, o1) == (0, outputs - 1):  # every output reads my rows only
        return None
    return a - offset, before, width, o0, o1, outputs


def _window(x, recv_bufs, plan, me, dim, first, before, width, received=True):
    """The window buffer: zeros, my rows at ``before``, the received rows in place
    (``received=False``: zeros there, for now)."""
    shape = list(x.shape)
    shape[dim] = width  # (N, C, ..., width, ...)
    window = x.new_empty(shape)
    mine = _mine_rows(plan, me)
    window.narrow(dim, 0, before).zero_()  # padding and received rows: zeros for now
    window.narrow(dim, before, mine).copy_(x.narrow(dim, first, mine))
    window.narrow(dim, before + mine, width - before - mine).zero_()
    if received:
        _fill(window, recv_bufs, plan, me, dim)
    return window


def _fill(window, recv_bufs, plan, me, dim) -> None:
    pos, received = simple_window(plan, me)[0], iter(recv_bufs)
    for src, lo, hi in plan.blocks(me):
        if src != me:
            window.narrow(dim, pos, hi - lo).copy_(next(received))
        pos += hi - lo


@fenced
class OverlappedConv(torch.autograd.Function):
    """``y = OverlappedConv.apply(x, w, b, along, conv_args, cause, rebuild)``: steps 1-3.

    ``along``: (dim, plan, peers, me, offset, :func:`interior`'s geometry, k, s, d of
    that dim); ``conv_args``: torch's (stride, padding, dilation, groups), padding 0
    along ``dim``; ``rebuild``: ``x`` stays alive anyway (an input image), so backward
    rebuilds the window from it and the received rows instead of keeping a copy."""

    @staticmethod
    def forward(ctx, x, w, b, along, conv_args, cause, rebuild=False):
        dim, plan, peers, me, offset, geo, k, s, d = along
        first, before, width, o0, o1, outputs = geo
        stride, padding, dilation, groups = conv_args
        e = d * (k - 1) + 1  # rows one output reads

        def conv(t):
            zeros = [0] * len(stride)
            return torch.convolution(t, w, b, stride, padding, dilation, False, zeros, groups)

        recv_bufs, works = post_halo(x, plan, peers, me, dim, offset, cause)  # 1.
        try:
            window = _window(x, recv_bufs, plan, me, dim, first, before, width, received=False)
            y = conv(window)  # 2. the interior final, the two ends provisional
        finally:  # 3. (also when 2. raised: a posted receive left behind would take the
            for work in works:  # peer's next message)
                work.wait()
        _fill(window, recv_bufs, plan, me, dim)
        if o0 > 0:  # outputs 0 .. o0-1 read window rows 0 .. (o0-1)s + e
            y.narrow(dim, 0, o0).copy_(conv(window.narrow(dim, 0, (o0 - 1) * s + e)))
        if o1 < outputs - 1:  # outputs o1+1 .. read window rows from (o1+1)s
            rows = (outputs - 2 - o1) * s + e
            y.narrow(dim, o1 + 1, outputs - 1 - o1).copy_(
                conv(window.narrow(dim, (o1 + 1) * s, rows))
            )
        if rebuild:
            ctx.save_for_backward(x, w, *recv_bufs)
            ctx.geometry = (first, before, width)
        else:
            ctx.save_for_backward(window, w)
        ctx.rebuild, ctx.conv_args, ctx.has_bias = rebuild, conv_args, b is not None
        keep_for_send_back(ctx, x, plan, dim, peers, me, offset, cause)
        ctx.idx, ctx.lead = None, simple_window(plan, me)[0]  # the rows in order
        return y

    @staticmethod
    @first_order("convolution (halos overlapped)")
    def backward(ctx, gy):
        window, w, *recv_bufs = kept(ctx)
        if ctx.rebuild:
            window = _window(window, recv_bufs, ctx.plan, ctx.me, ctx.dim, *ctx.geometry)
        stride, padding, dilation, groups = ctx.conv_args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g_window, gw, gb = aten.convolution_backward(
            gy, window, w, [w.shape[0]] if ctx.has_bias else None, stride, padding,
            dilation, False, [0] * len(stride), groups, [need_x, need_w, need_b],
        )  # fmt: skip
        # no input gradient wanted (an image): no messages either, as with Halo
        g_x = send_back(ctx, g_window) if need_x else None
        return g_x, gw if need_w else None, gb if need_b else None, None, None, None, None


def _mine_rows(plan, me) -> int:
    """How many of my rows the window holds."""
    return sum(hi - lo for src, lo, hi in plan.blocks(me) if src == me)
