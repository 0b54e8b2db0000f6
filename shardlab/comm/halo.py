"""Halo exchange along one sharded dim: each rank assembles the window its outputs read.

::

    rank r-1 [ ...  a b ] rank r [ c d e f ] rank r+1 [ g h ... ]      k = 3, 'same'
                     b ──────────▶ window [ b c d e f g ] ◀──────── g

What moves is exactly :class:`shardlab.layout.ConvPlan` ``recvs`` (the rows the
window reads that the rank does not own, from any rank: multi-hop when shards
are smaller than the halo), point to point. Backward is the mirror image: the
gradient of each received row goes back to its owner and is added there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from shardlab.comm import collectives
from shardlab.comm._once import first_order
from shardlab.comm.p2p import my_coord, post, rank_at
from shardlab.comm.recompute import fenced
from shardlab.layout import ConvPlan
from shardlab.trace import label


def _post(sends, recvs) -> list:
    """Post all sends and receives at once; return their works (wait for them)."""
    ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]  # post() makes them dense
    ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
    return post(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def post_halo(local, plan: ConvPlan, peers, me, dim, offset, cause):
    """Post the window's messages (no autograd): every row this rank sends, a buffer for
    every row it receives. Returns (receive buffers, works)."""
    collectives.sending(local)  # (under torch.compile: never inside a graph)
    rows = lambda t, a, b: t.narrow(dim, a - offset, b - a)  # noqa: E731
    recv_bufs = []
    for _src, a, b in plan.recvs(me):
        shape = list(local.shape)
        shape[dim] = b - a
        recv_bufs.append(local.new_empty(shape))
    with label(cause, "forward"):
        works = _post(
            [(peers[d], rows(local.detach(), a, b)) for d, a, b in plan.sends(me)],
            [(peers[s], buf) for (s, _, _), buf in zip(plan.recvs(me), recv_bufs)],
        )
    return recv_bufs, works


def keep_for_send_back(ctx, local, plan, dim, peers, me, offset, cause) -> None:
    """What :func:`send_back` reads later, on ``ctx`` (``idx`` and ``lead``, how the
    window lies over its rows, are the caller's)."""
    ctx.plan, ctx.dim, ctx.peers, ctx.me, ctx.offset = plan, dim, peers, me, offset
    ctx.local_len, ctx.cause = local.shape[dim], cause
    ctx.buf_len = sum(b - a for _, a, b in plan.blocks(me)) + 1


def send_back(ctx, grad):
    """The window's gradient ``grad`` home: my rows' part added to my block, each
    received row's part sent back to its owner and added there. Returns my block's."""
    plan, dim, me, offset = ctx.plan, ctx.dim, ctx.me, ctx.offset
    collectives.sending(grad)
    shape = list(grad.shape)
    if ctx.idx is None:  # the window is the rows in order: its gradient too
        g_buf = grad.narrow(dim, ctx.lead, ctx.buf_len - 1)
    else:
        shape[dim] = ctx.buf_len
        g_buf = grad.new_zeros(shape).index_add_(dim, ctx.idx, grad)
    shape[dim] = ctx.local_len
    g_local = grad.new_zeros(shape)
    pos, back = 0, []
    for src, a, b in plan.blocks(me):
        part = g_buf.narrow(dim, pos, b - a)
        pos += b - a
        if src == me:
            g_local.narrow(dim, a - offset, b - a).add_(part)
        else:
            back.append((ctx.peers[src], part))
    incoming = []
    for _, a, b in plan.sends(me):
        shape[dim] = b - a
        incoming.append(grad.new_empty(shape))
    with label(ctx.cause, "backward"):
        _wait(
            _post(back, [(ctx.peers[d], buf) for (d, _, _), buf in zip(plan.sends(me), incoming)])
        )
    for (_, a, b), buf in zip(plan.sends(me), incoming):
        g_local.narrow(dim, a - offset, b - a).add_(buf)
    return g_local


@fenced
class Halo(torch.autograd.Function):
    """``window = Halo.apply(local, plan, dim, peers, me, offset, fill, cause)``.

    ``peers[k]`` is the global rank of plan rank ``k``; ``offset`` is the global
    index of ``local``'s first row along ``dim``; ``fill`` is the padding value.
    """

    @staticmethod
    def forward(ctx, local, plan: ConvPlan, dim, peers, me, offset, fill, cause, recipe=None):
        keep_for_send_back(ctx, local, plan, dim, peers, me, offset, cause)
        recv_bufs, works = post_halo(local, plan, peers, me, dim, offset, cause)
        _wait(works)
        window, ctx.idx, ctx.lead = assemble(local, recv_bufs, plan, dim, me, offset, fill)
        if recipe is not None:  # let the caller rebuild this window instead of saving it
            recipe.append((recv_bufs, plan, dim, me, offset, fill))
        return window

    @staticmethod
    @first_order("the halo exchange (convolution, pooling)")
    def backward(ctx, grad):
        return send_back(ctx, grad), None, None, None, None, None, None, None, None


def simple_window(plan, me) -> tuple[int, int] | None:
    """(lead, trail) padding rows when rank ``me``'s window is [pad] * lead + its blocks'
    rows in order + [pad] * trail (no reflection, wrap-around or dilation gap), else None."""
    total = sum(b - a for _, a, b in plan.blocks(me))
    lead, trail = _edges(plan.local_index(me), total)
    return None if lead is None else (lead, trail)


def assemble(local, recv_bufs, plan, dim, me, offset, fill):
    """The window of rank ``me`` from its block and the received rows (no messages).

    Returns (window, idx, lead): ``idx`` None when the window is the rows in order
    with ``lead`` padding rows in front, else the gather index into cat(blocks + pad).
    """
    received = iter(recv_bufs)
    parts = [
        local.narrow(dim, a - offset, b - a) if src == me else next(received)
        for src, a, b in plan.blocks(me)
    ]
    index = plan.local_index(me)
    total = sum(b - a for _, a, b in plan.blocks(me))
    lead, trail = _edges(index, total)
    pad_shape = list(local.shape)
    if lead is not None:  # common case: [pad]*lead + every row in order + [pad]*trail
        pieces = []
        if lead:
            pad_shape[dim] = lead
            pieces.append(local.new_full(pad_shape, fill))
        pieces += parts
        if trail:
            pad_shape[dim] = trail
            pieces.append(local.new_full(pad_shape, fill))
        window = torch.cat(pieces, dim) if pieces else local.narrow(dim, 0, 0).clone()
        return window, None, lead
    pad_shape[dim] = 1
    parts.append(local.new_full(pad_shape, fill))
    buf = torch.cat(parts, dim)  # reflect / circular / dilation gaps: gather by index
    idx = torch.tensor(index, dtype=torch.long, device=local.device)
    idx[idx < 0] = buf.shape[dim] - 1
    return buf.index_select(dim, idx), idx, 0


class WindowRecipe:
    """Saved-tensor hooks that keep a halo window as (block, received rows) and rebuild
    it when backward needs it: the op that reads the window (a convolution saves its
    input) then holds no copy of the block, only the small halos::

        recipe = WindowRecipe(block)
        window = Halo.apply(block, ..., recipe.stages)   # one call per sharded dim
        with recipe.hooks(window):
            y = torch.conv2d(window, w)
    """

    def __init__(self, block: torch.Tensor):
        self.block = block
        self.stages: list = []

    def rebuild(self) -> torch.Tensor:
        x = self.block.detach()
        for recv_bufs, plan, dim, me, offset, fill in self.stages:
            x = assemble(x, recv_bufs, plan, dim, me, offset, fill)[0]
        return x

    def hooks(self, window: torch.Tensor):
        if self.block is None or not self.stages or type(window) is not torch.Tensor:
            # nothing to rebuild from: no hooks, so an enclosing activation checkpoint's
            # own hooks see (and drop) what the op saves; traced by torch.compile, the
            # compiler chooses what the graph saves
            return contextlib.nullcontext()
        ptr, shape = window.data_ptr(), window.shape

        def pack(t):
            if t.data_ptr() == ptr and t.shape == shape and ptr:
                return self
            return t

        def unpack(obj):
            return obj.rebuild() if obj is self else obj

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _edges(index, total):
    """(lead, trail) if ``index`` is ``[pad] * lead + [0 .. total-1] + [pad] * trail``."""
    lead = 0
    while lead < len(index) and index[lead] < 0:
        lead += 1
    body = index[lead : lead + total]
    if list(body) != list(range(total)):
        return None, None
    rest = index[lead + total :]
    if any(i >= 0 for i in rest):
        return None, None
    return lead, len(rest)


def peers_along(mesh, mesh_dim: int) -> tuple[list[int], int]:
    """Global ranks of the ranks that share my coordinates except along ``mesh_dim``."""
    me = my_coord(mesh)
    peers = [
        rank_at(mesh, me[:mesh_dim] + (k,) + me[mesh_dim + 1 :])
        for k in range(mesh.shape[mesh_dim])
    ]
    return peers, me[mesh_dim]
