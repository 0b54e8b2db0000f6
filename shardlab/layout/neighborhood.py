"""Neighborhood attention geometry: which keys each query sees, and which rows a rank needs.

Along one spatial dim of length L, kernel size k (odd), dilation d (NATTEN's semantics).
Positions fall into d groups (i mod d); inside its group a query at group index i' sees k
consecutive group members, centred on it and shifted inward at the borders, so every
query sees exactly k keys::

    L = 7, k = 3, d = 1       query 0 -> keys 0 1 2     (shifted: no key -1)
                              query 3 -> keys 2 3 4
                              query 6 -> keys 4 5 6     (shifted: no key 7)
    L = 7, k = 3, d = 2       query 3 (group 1: 1 3 5) -> keys 1 3 5

Causal along a dim: query i' sees group members i'-k+1 .. i' (fewer than k near the start).
Several dims: the neighborhood is the product of the per-dim ones.

On a sharded dim a rank needs the key rows its queries see: :func:`needed_rows` (exact,
with gaps for dilation larger than the shard), turned into messages by
:class:`NeighborhoodPlan` (the interface of the halo exchange, ``shardlab.comm.halo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ._windows import Rows, blocks_of
from .shards import offsets

__all__ = ["NeighborhoodPlan", "check_dim", "neighbors", "needed_rows", "neighborhood_plan"]


def check_dim(length: int, kernel_size: int, dilation: int, name: str = "dim") -> None:
    """torch-style argument errors (the same on every rank: global sizes only)."""
    if kernel_size < 2 or kernel_size % 2 == 0:
        raise ValueError(
            f"neighborhood attention: kernel_size must be an odd integer > 1, got {kernel_size}"
        )
    if dilation < 1:
        raise ValueError(f"neighborhood attention: dilation must be >= 1, got {dilation}")
    if kernel_size * dilation > length:
        raise ValueError(
            f"neighborhood attention: kernel_size * dilation = {kernel_size} * {dilation} "
            f"= {kernel_size * dilation} is larger than the {name} extent {length}"
        )


@lru_cache(maxsize=256)
def neighbors(length: int, k: int, d: int, causal: bool) -> tuple[tuple[int, ...], ...]:
    """For every query 0..L-1, its k key positions in slot order (-1: no key, causal)."""
    out = []
    for i in range(length):
        g, ig = i % d, i // d
        members = (length - g + d - 1) // d  # positions of group g
        if causal:
            first = ig - k + 1
            slots = [first + t for t in range(k)]
            out.append(tuple(g + d * j if j >= 0 else -1 for j in slots))
        else:
            start = min(max(ig - k // 2, 0), members - k)
            out.append(tuple(g + d * (start + t) for t in range(k)))
    return tuple(out)


def needed_rows(length: int, k: int, d: int, causal: bool, a: int, b: int) -> tuple[int, ...]:
    """Sorted key rows the queries a..b-1 see."""
    nb = neighbors(length, k, d, causal)
    return tuple(sorted({j for i in range(a, b) for j in nb[i] if j >= 0}))


@dataclass(frozen=True)
class NeighborhoodPlan:
    """Who sends which key rows to whom along one sharded dim (sizes of every rank)."""

    sizes: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]  # per rank: the key rows its queries see
    _blocks: tuple[tuple[Rows, ...], ...]

    def blocks(self, r: int) -> tuple[Rows, ...]:
        return self._blocks[r]

    def recvs(self, r: int) -> tuple[Rows, ...]:
        return tuple(b for b in self._blocks[r] if b.rank != r)

    def sends(self, r: int) -> tuple[Rows, ...]:
        return tuple(
            Rows(dst, b.start, b.stop)
            for dst in range(len(self.sizes))
            for b in self.recvs(dst)
            if b.rank == r
        )

    def local_index(self, r: int) -> tuple[int, ...]:
        return tuple(range(len(self.rows[r])))  # the window is the needed rows, in order

    def rows_received(self, r: int) -> int:
        return sum(b.stop - b.start for b in self.recvs(r))


@lru_cache(maxsize=256)
def neighborhood_plan(sizes: tuple[int, ...], k: int, d: int, causal: bool) -> NeighborhoodPlan:
    """The exact halo of neighborhood attention along a dim cut in ``sizes``."""
    length = sum(sizes)
    starts = offsets(sizes)
    rows = tuple(
        needed_rows(length, k, d, causal, a, a + n) if n else () for a, n in zip(starts, sizes)
    )
    blocks = tuple(blocks_of(r, rows[r], sizes) for r in range(len(sizes)))
    return NeighborhoodPlan(tuple(sizes), rows, blocks)
