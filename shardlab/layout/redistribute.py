"""Which global boxes move between ranks when a layout changes placements or sizes.

Example: global (6,) on mesh (2,), ``[Shard(0)]`` sizes [4, 2] -> sizes [2, 4]::

    src   rank 0: [0 1 2 3]       rank 1: [4 5]
    dst   rank 0: [0 1]           rank 1: [2 3 4 5]
    plan  (0) -> (0)  [0, 2)  local     (0) -> (1)  [2, 4)     (1) -> (1)  [4, 6)  local

Replicated sources: blocks of two src ranks are either identical (they differ only along
Replicate mesh dims) or disjoint. Each piece is taken from ONE replica: the one with the
destination's own coordinate along every mesh dim where the source is Replicate, so a
destination that already holds the data copies it locally, and the replicas share the work.

Strided dims (see :mod:`._atoms`) hold a rank's indices in several intervals: a move then
carries, per tensor dim, the sorted indices both ranks hold (``Move.index``), still one
message per (sender, receiver) pair: blocks are cartesian products of per-dim index sets,
and so are their intersections.

Partial is a reduction, not a move: :func:`redistribute_plan` raises NotImplementedError for
it; reduce first (all-reduce / reduce-scatter), then plan the Shard/Replicate change.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Partial, Shard

from ._checks import placement_str
from .shards import ShardLayout

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Move:
    """Global ``box`` (per tensor dim ``[start, stop)``) goes from rank ``src`` to ``dst``.

    ``src_start`` / ``dst_start`` are the global offsets of the two ranks' blocks, so
    ``src_slices()`` indexes the sender's local tensor and ``dst_slices()`` the receiver's.
    ``local`` is True when ``src == dst``: a local copy, no communication.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    box: Box
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    local: bool
    # strided dims only: per tensor dim None, or (positions in the sender's block,
    # positions in the receiver's block) of the indices moved along that dim
    index: tuple | None = None

    @property
    def numel(self) -> int:
        """The number of elements the move carries."""
        n = 1
        for d, (start, stop) in enumerate(self.box):
            pos = self.index[d] if self.index is not None else None
            n *= len(pos[0]) if pos is not None else stop - start
        return n

    def src_slices(self) -> tuple:
        """Per dim a slice of the sender's block, or an index array (strided dims)."""
        return self._select(self.src_start, 0)

    def dst_slices(self) -> tuple:
        """Per dim a slice of the receiver's block, or an index array (strided dims)."""
        return self._select(self.dst_start, 1)

    def _select(self, starts, side: int) -> tuple:
        out = []
        for d, ((a, b), o) in enumerate(zip(self.box, starts, strict=True)):
            pos = self.index[d] if self.index is not None else None
            out.append(slice(a - o, b - o) if pos is None else pos[side])
        return tuple(out)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None if it is empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in out) else out


@functools.lru_cache(maxsize=4096)
def redistribute_plan(src: ShardLayout, dst: ShardLayout) -> list[Move]:
    """Every non-empty box moving from a src rank's block to a dst rank's block.

    Ordered by dst coordinate (row-major), then src coordinate. Together the boxes with a given
    ``dst`` tile that rank's destination block exactly once. Local copies are listed with
    ``local=True``; the bytes that must cross the network are at least
    ``moved_elements(plan) * itemsize``.
    """
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"{name} must be a ShardLayout, got {type(layout).__name__}")
        for m, p in enumerate(layout.placements):
            if isinstance(p, Partial):
                raise NotImplementedError(
                    f"{name} has {placement_str(p)} on mesh dim {m}: Partial needs a reduction "
                    "(all-reduce / reduce-scatter), not a move; reduce first, then plan"
                )
    if src.global_shape != dst.global_shape or src.mesh_shape != dst.mesh_shape:
        raise ValueError(
            "dst must describe the same tensor on the same mesh as src: src has global "
            f"{src.global_shape} on mesh {src.mesh_shape}, dst has global {dst.global_shape} "
            f"on mesh {dst.mesh_shape}"
        )
    shard_dims = [m for m, p in enumerate(src.placements) if isinstance(p, Shard)]
    src_keys = list(itertools.product(*(range(src.mesh_shape[m]) for m in shard_dims)))
    if not (src.is_block() and dst.is_block()):
        return _strided_plan(src, dst, shard_dims, src_keys)
    plan: list[Move] = []
    for d in dst.coords():
        dst_box = dst.local_box(d)
        for key in src_keys:
            s = _with(d, shard_dims, key)
            box = intersect(src.local_box(s), dst_box)
            if box is not None:
                start = tuple(a for a, _ in src.local_box(s))
                dst_start = tuple(a for a, _ in dst_box)
                plan.append(Move(s, d, box, start, dst_start, s == d))
    return plan


def _strided_plan(src, dst, shard_dims, src_keys) -> list[Move]:
    """The plan when a dim is strided: per dim, intersect the sorted index sets."""
    ndim = len(src.global_shape)
    strided = [not (src.is_block(k) and dst.is_block(k)) for k in range(ndim)]
    plan: list[Move] = []
    for d in dst.coords():
        for key in src_keys:
            s = _with(d, shard_dims, key)
            box, index, starts_s, starts_d = [], [], [], []
            for k in range(ndim):
                if not strided[k]:
                    (a0, a1), (b0, b1) = _interval(src, k, s), _interval(dst, k, d)
                    lo, hi = max(a0, b0), min(a1, b1)
                    box.append((lo, hi))
                    index.append(None)
                    starts_s.append(a0)
                    starts_d.append(b0)
                    if lo >= hi:
                        break
                    continue
                si, di = src.dim_indices(k, s), dst.dim_indices(k, d)
                common, ps, pd = np.intersect1d(si, di, assume_unique=True, return_indices=True)
                if len(common) == 0:
                    box.append((0, 0))
                    break
                box.append((int(common[0]), int(common[-1]) + 1))
                index.append((ps.astype(np.int64), pd.astype(np.int64)))
                starts_s.append(0)
                starts_d.append(0)
            else:
                move = Move(
                    s, d, tuple(box), tuple(starts_s), tuple(starts_d), s == d, tuple(index)
                )
                plan.append(move)
    return plan


def _interval(layout: ShardLayout, k: int, coord) -> tuple[int, int]:
    start, n = layout._piece(k, tuple(coord))
    return start, start + n


def moved_elements(plan: Sequence[Move]) -> int:
    """Elements that cross the network (non-local moves): the lower bound of traffic."""
    return sum(move.numel for move in plan if not move.local)


def _with(coord: tuple[int, ...], mesh_dims: list[int], values: tuple[int, ...]) -> tuple:
    out = list(coord)
    for m, v in zip(mesh_dims, values, strict=True):
        out[m] = v
    return tuple(out)
