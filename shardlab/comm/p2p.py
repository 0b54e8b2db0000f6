"""How layouts change: the collectives behind ShardTensor, on local tensors.

Everything here takes a rank's local tensor and two :class:`ShardLayout` s and
returns the rank's new local tensor; autograd lives in ``api.py``. The *what*
(which global boxes move between which ranks) comes from
:func:`shardlab.layout.redistribute_plan`; this module only carries it out:

1. Partial mesh dims are reduced first (``all_reduce`` over that mesh dim's group).
2. Shard/Replicate changes move exactly the boxes of the plan, point to point
   (``batch_isend_irecv``): an all-gather-v, an all-to-all-v or a gather, with
   the lower bound of bytes and no ``all_to_all`` (gloo has none on CPU).
3. A Partial target keeps the value on coordinate 0 of that mesh dim and zeros
   elsewhere (no communication).
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import collectives, gathers, traced
from shardlab.layout import ShardLayout, redistribute_plan
from shardlab.trace import label

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}


def my_coord(mesh) -> tuple[int, ...]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError("this rank is not part of the mesh")
    for c in coord:
        if type(c) is not int:
            _symbolic_coord(coord)
    return tuple(coord)


def _symbolic_coord(coord) -> None:
    """A mesh coordinate that is no number: torch's ``LocalTensorMode`` (one process that
    simulates every rank: a coordinate holds each simulated rank's value)."""
    mode = sys.modules.get("torch.distributed._local_tensor")
    if mode is not None and getattr(mode, "local_tensor_mode", lambda: None)() is not None:
        raise NotImplementedError(
            "ShardTensors do not run under torch's LocalTensorMode (one process simulating "
            f"every rank: this mesh coordinate is {list(coord)}, one value per simulated "
            "rank); plain DTensors do, with shardlab's patch on or off. Run ShardTensors "
            "on real ranks: shardlab.Ranks(n), %%ranks, or torchrun"
        )


def rank_at(mesh, coord) -> int:
    """Global rank at mesh coordinate ``coord`` (for point-to-point messages). The grid is
    read once per mesh (``DeviceMesh.mesh`` rebuilds a tensor at every access)."""
    hit = _GRIDS.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        with traced.outside_modes():  # a real grid, also while torch.compile traces
            grid = mesh.mesh
            ranks = grid.flatten().tolist()
        coords = itertools.product(*(range(n) for n in grid.shape))
        if len(_GRIDS) >= 256:
            del _GRIDS[next(iter(_GRIDS))]
        _GRIDS[id(mesh)] = hit = (mesh, dict(zip(coords, ranks)))
    return hit[1][tuple(coord)]


_GRIDS: dict = {}  # id(mesh) -> (the mesh, {coordinate: global rank})


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it can travel: dense, with conjugate / negative views resolved (a lazy
    ``conj()`` would fail in the backend on the sending rank only)."""
    return t.resolve_conj().resolve_neg().contiguous()


def needs_staging(device_type: str, backend: str) -> bool:
    """gloo moves device (CUDA) tensors in collectives, but its point-to-point
    messages abort on them: there they travel through host memory."""
    return device_type != "cpu" and backend == "gloo"


class _Staged:
    """The works of point-to-point messages that travel through host memory:
    ``wait()`` waits for them, then copies each received buffer to its device tensor
    (every other call waits on all the works too)."""

    def __init__(self, works: list, copies: list):
        self.works, self.copies = works, copies

    def wait(self, *args) -> bool:
        for w in self.works:
            w.wait(*args)
        for dst, host in self.copies:
            dst.copy_(host)
        self.works, self.copies = [], []
        return True


def post(ops: list) -> list:
    """``batch_isend_irecv`` of ``ops``, every sent tensor made :func:`wire`-ready (dense).

    Where the group's backend cannot send the tensors' device (:func:`needs_staging`),
    every message goes through host memory: sends copy to the host first, receives land
    in host buffers and reach their tensors when the returned work is waited for (one
    work for all of them)."""
    if not ops or collectives.exchange(ops):  # traced by torch.compile: done
        return []
    ready = [
        dist.P2POp(op.op, wire(op.tensor), op.peer, op.group, op.tag)
        if op.op is dist.isend
        and (op.tensor.is_conj() or op.tensor.is_neg() or not op.tensor.is_contiguous())
        else op
        for op in ops
    ]
    if not needs_staging(ready[0].tensor.device.type, dist.get_backend(ready[0].group)):
        return dist.batch_isend_irecv(ready)
    host_ops, copies = [], []
    for op in ready:
        if op.op is dist.isend:
            host = op.tensor.to("cpu", copy=True)
        else:
            host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
            copies.append((op.tensor, host))
        host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
    return [_Staged(dist.batch_isend_irecv(host_ops), copies)]


def run_p2p(ops: list) -> None:
    """Post every point-to-point op at once and wait for all (traced, under
    ``torch.compile``, as one ``shardlab::exchange``)."""
    for work in post(ops):
        work.wait()


def move(local: torch.Tensor, src: ShardLayout, dst: ShardLayout, mesh) -> torch.Tensor:
    """Carry out ``redistribute_plan(src, dst)`` for this rank (no Partial on either side).

    Every rank computes the same plan; for each (sender, receiver) pair the
    messages are posted in plan order on both ends, so they match.
    """
    me = my_coord(mesh)
    out = local.new_empty(dst.local_shape(me))
    ops, received = [], []
    plan = redistribute_plan(src, dst)
    if type(local) is not torch.Tensor and not all(mv.local for mv in plan):
        collectives.sending(local)  # a message on some rank (traced: shardlab.comm.traced)
    for mv in plan:
        if mv.local and mv.dst == me:
            _put(out, mv.dst_slices(), _take(local, mv.src_slices()))  # a local copy
        elif mv.src == me:
            piece = _take(local, mv.src_slices()).contiguous()
            ops.append(dist.P2POp(dist.isend, piece, rank_at(mesh, mv.dst)))
        elif mv.dst == me:
            shape = [
                len(s) if not isinstance(s, slice) else s.stop - s.start for s in mv.dst_slices()
            ]
            buf = local.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, buf, rank_at(mesh, mv.src)))
            received.append((mv, buf))
    run_p2p(ops)
    for mv, buf in received:
        _put(out, mv.dst_slices(), buf)
    return out


def _take(t: torch.Tensor, sel: tuple) -> torch.Tensor:
    """``t`` at a per-dim selection: slices (block dims) or index arrays (strided dims)."""
    if all(isinstance(s, slice) for s in sel):
        return t[sel]
    for d, s in enumerate(sel):
        if isinstance(s, slice):
            t = t.narrow(d, s.start, s.stop - s.start)
        else:
            t = t.index_select(d, torch.as_tensor(s, device=t.device))
    return t


def _put(out: torch.Tensor, sel: tuple, value: torch.Tensor) -> None:
    """``out[sel] = value`` for a cartesian selection (slices and index arrays)."""
    if all(isinstance(s, slice) for s in sel):
        out[sel] = value
        return
    index = []
    for d, s in enumerate(sel):
        idx = (
            torch.arange(s.start, s.stop, device=out.device)
            if isinstance(s, slice)
            else torch.as_tensor(s, device=out.device)
        )
        shape = [1] * out.ndim
        shape[d] = -1
        index.append(idx.view(shape))
    out.index_put_(tuple(index), value)


def _as_replicate(layout: ShardLayout, mesh_dims) -> ShardLayout:
    """``layout`` with the (non-Shard) placements of ``mesh_dims`` read as Replicate."""
    places = tuple(
        Replicate() if m in mesh_dims and not isinstance(p, Shard) else p
        for m, p in enumerate(layout.placements)
    )
    return layout.replace(placements=places)


def _reduce_scatter_v(local, m, d, sizes, mesh, op) -> torch.Tensor:
    """Partial on mesh dim ``m`` -> Shard(d) with ``sizes``: every rank sends each peer
    the peer's slice of its partial value and sums what it receives for its own."""
    me = my_coord(mesh)
    collectives.sending(local, mesh.get_group(m))
    starts = [sum(sizes[:k]) for k in range(len(sizes))]

    def piece(t, k):
        index = [slice(None)] * t.ndim
        index[d] = slice(starts[k], starts[k] + sizes[k])
        return t[tuple(index)]

    mine = piece(local, me[m]).clone()
    ops, bufs = [], []
    for k in range(mesh.shape[m]):
        if k == me[m]:
            continue
        peer = rank_at(mesh, me[:m] + (k,) + me[m + 1 :])
        if sizes[k]:
            ops.append(dist.P2POp(dist.isend, piece(local, k).contiguous(), peer))
        if sizes[me[m]]:
            bufs.append(torch.empty(mine.shape, dtype=mine.dtype, device=mine.device))
            ops.append(dist.P2POp(dist.irecv, bufs[-1], peer))
    run_p2p(ops)
    for b in bufs:
        mine = (
            mine + b
            if op == "sum"
            else torch.maximum(mine, b)
            if op == "max"
            else torch.minimum(mine, b)
        )
    return mine


_ORDERED = {  # float dtype -> (int dtype of its width, the int a reduction sends it as)
    torch.float64: (torch.int64, torch.int64),
    torch.float32: (torch.int32, torch.int32),
    torch.float16: (torch.int16, torch.int32),  # (no 16-bit ints in NCCL's reductions)
    torch.bfloat16: (torch.int16, torch.int32),
}


def _all_reduce_extreme(local: torch.Tensor, op: str, group) -> torch.Tensor:
    """A Partial max / min of floats summed as torch's ``max`` does: a NaN on any rank
    makes the result NaN (gloo's and NCCL's MAX / MIN drop it: ``max(1, nan)`` was 1).

    Each float is sent as the integer that orders like it (its bits, with the lower bits
    of negative ones flipped: ``-inf < -1 < -0 < 0 < 1 < inf``), a NaN as the largest
    (max) or smallest (min) integer; the integer MAX / MIN is the float one, NaN
    included. One all-reduce, as many bytes (twice for 16-bit floats)."""
    if local.dtype not in _ORDERED:
        collectives.all_reduce_(local, _REDUCE_OPS[op], group)
        return local
    bits, wide = _ORDERED[local.dtype]
    info = torch.iinfo(bits)
    raw = local.contiguous().view(bits)
    key = torch.where(raw >= 0, raw, raw ^ info.max)  # ordered like the floats
    key = key.masked_fill(local.isnan(), info.max if op == "max" else info.min).to(wide)
    collectives.all_reduce_(key, _REDUCE_OPS[op], group)
    key = key.to(bits)
    return torch.where(key >= 0, key, key ^ info.max).view(local.dtype).view(local.shape)


def _same_block(src: ShardLayout, dst: ShardLayout, mesh, me) -> bool:
    """Is this rank's block of ``dst`` its block of ``src``? So when every mesh dim whose
    placement or sizes change has one rank (its one piece is the whole dim, a sum or max
    over it is its one value), as DTensor skips such mesh dims."""
    shape = mesh.shape
    for m, (p, q) in enumerate(zip(src.placements, dst.placements)):
        if (p != q or src.sizes[m] != dst.sizes[m]) and (
            shape[m] != 1 or type(p) not in _PLAIN or type(q) not in _PLAIN
        ):
            return False
    return (
        src.global_shape == dst.global_shape
        and src.is_block()
        and dst.is_block()
        and src.local_box(me) == dst.local_box(me)
    )


_PLAIN = (Shard, Replicate, Partial)  # not DTensor's own kinds (a p-norm's Partial)


def redistribute_local(
    local: torch.Tensor, src: ShardLayout, dst: ShardLayout, mesh, cause: str = "redistribute"
) -> torch.Tensor:
    """This rank's block of ``dst``, from its block of ``src``."""
    if src == dst:
        return local
    me = my_coord(mesh)
    if _same_block(src, dst, mesh, me):  # only mesh dims of one rank change: no message
        return local
    if gathers.is_gather(src, dst, cause):  # a rule is missing: said, or refused
        gathers.report(src, dst, cause, local.element_size())
    with label(cause):
        # 1. reduce Partial mesh dims that the target does not keep Partial
        for m, p in enumerate(src.placements):
            if isinstance(p, Partial) and dst.placements[m] != p:
                if type(p) is not Partial:  # DTensor's own kinds (a p-norm's): its rule
                    collectives.sending(local, mesh.get_group(m))
                    local = p._reduce_value(local, mesh, m)
                    local = local.wait() if hasattr(local, "wait") else local
                    src = _as_replicate(src, [m])
                    continue
                if p.reduce_op not in _REDUCE_OPS:
                    raise NotImplementedError(
                        f"{p} on mesh dim {m} (e.g. prod() or all() over a sharded dim) "
                        "cannot be reduced: supported are Partial sum, max and min. "
                        "Redistribute the input to Replicate() on that mesh dim first."
                    )
                q = dst.placements[m]
                if (
                    isinstance(q, Shard)
                    and dst.is_block(q.dim)
                    and len(dst.sizes[m]) == 1
                    and p.reduce_op in ("sum", "max", "min")
                    and not any(
                        isinstance(o, Shard) and o.dim == q.dim
                        for k, o in enumerate(src.placements + dst.placements)
                        if k % len(src.placements) != m
                    )
                ):  # reduce-scatter-v: each rank receives only the parts of its own block
                    local = _reduce_scatter_v(local, m, q.dim, dst.sizes[m][0], mesh, p.reduce_op)
                    places = list(src.placements)
                    places[m] = q
                    sizes = list(src.sizes)
                    sizes[m] = dst.sizes[m]
                    src = src.replace(placements=tuple(places), sizes=tuple(sizes))
                    continue
                local = wire(local).clone()
                if p.reduce_op in ("max", "min") and local.is_floating_point():
                    local = _all_reduce_extreme(local, p.reduce_op, mesh.get_group(m))
                else:
                    collectives.all_reduce_(local, _REDUCE_OPS[p.reduce_op], mesh.get_group(m))
                src = _as_replicate(src, [m])
        # 2. move boxes between Shard / Replicate placements (a kept Partial moves
        #    like a Replicate; a new Partial target is first made Replicate)
        partial = [m for m, p in enumerate(dst.placements) if isinstance(p, Partial)]
        move_src, move_dst = _as_replicate(src, partial), _as_replicate(dst, partial)
        if move_src != move_dst:
            local = move(local, move_src, move_dst, mesh)
        # 3. new Partial targets: coordinate 0 keeps the value, the others hold zeros
        for m, p in enumerate(dst.placements):
            if isinstance(p, Partial) and src.placements[m] != p:
                if p.reduce_op != "sum":
                    raise NotImplementedError(
                        f"redistribute to Partial({p.reduce_op!r}): only Partial('sum') "
                        "can be created from Shard or Replicate"
                    )
                if me[m] != 0:
                    local = torch.zeros_like(local)
    return local
