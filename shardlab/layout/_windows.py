"""Window geometry behind :func:`.conv.conv_plan` (one rank at a time).

A window is described by ``(window, index_map, crop)``: the window's range, the global input
index feeding each window position (or PAD / OVERHANG) and the slice of the local op's output
to keep. :func:`blocks_of` turns an index map into the rows to concatenate.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from .shards import offsets

PAD = -1  # fill with the pad value: zero padding, pooling's padding, or a row nobody reads
OVERHANG = -2  # past the padded input end (ceil_mode's last window): torch ignores it


class Rows(NamedTuple):
    """Global input rows ``[start, stop)`` exchanged with ``rank`` (source or destination)."""

    rank: int
    start: int
    stop: int


Geometry = tuple[tuple[int, int], tuple[int, ...], tuple[int, int]]


def forward_window(
    lo: int, hi: int, length: int, k: int, st: int, dl: int, pad: tuple[int, int], mode: str
) -> Geometry:
    """Padded positions [lo*st, (hi-1)*st + dl*(k-1) + 1) and where each one comes from."""
    n = hi - lo
    if n == 0:
        return (0, 0), (), (0, 0)
    first, count = lo * st, (n - 1) * st + dl * (k - 1) + 1
    used = bytearray(count)
    for t in range(k):  # tap t of output lo + m reads window position t*dl + m*st
        used[t * dl : t * dl + (n - 1) * st + 1 : st] = b"\x01" * n
    padded_end = length + pad[0] + pad[1]
    index_map = []
    for w in range(count):
        i = first + w - pad[0]  # input index of this padded position
        if not used[w]:
            index_map.append(PAD)
        elif 0 <= i < length:
            index_map.append(i)
        elif first + w >= padded_end:
            index_map.append(OVERHANG)
        elif mode == "zeros":
            index_map.append(PAD)
        elif mode == "reflect":
            index_map.append(-i if i < 0 else 2 * (length - 1) - i)
        elif mode == "replicate":
            index_map.append(min(max(i, 0), length - 1))
        else:  # circular
            index_map.append(i % length)
    return (first, first + count), tuple(index_map), (0, n)


def transposed_window(
    lo: int, hi: int, length: int, k: int, st: int, dl: int, pad: tuple[int, int], mode: str
) -> Geometry:
    """Input indices [a, b) whose scattered taps cover full-output positions [q0, q1)."""
    if hi == lo:
        return (0, 0), (), (0, 0)
    span = dl * (k - 1)
    q0, q1 = lo + pad[0], hi + pad[0]  # positions in the uncropped output
    # input i writes full-output positions i*st + t*dl, t = 0..k-1
    a = min(-(-(q0 - span) // st), q0 // st)  # a*st <= q0: the local output starts early enough
    b = max((q1 - 1) // st + 1, -(-(q1 - 1 - span) // st) + 1)  # and ends late enough
    used = bytearray(b - a)
    for t in range(k):  # inputs whose tap t lands in [q0, q1)
        first, stop = -(-(q0 - t * dl) // st), -(-(q1 - t * dl) // st)
        first, stop = max(first, 0, a), min(stop, length, b)
        if stop > first:
            used[first - a : stop - a] = b"\x01" * (stop - first)
    index_map = tuple(a + w if used[w] else PAD for w in range(b - a))
    return (a, b), index_map, (q0 - a * st, q1 - a * st)


def blocks_of(r: int, index_map: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Rows, ...]:
    """The needed rows as maximal runs that are contiguous and inside one shard, by start.

    Own runs too are exact (not a hull): on a 2-D mesh a row range of the own shard along H is
    also fetched from W-neighbours, so it must hold only needed rows.
    """
    starts = offsets(sizes)
    blocks: list[Rows] = []
    run: list[int] = []
    for g in sorted({g for g in index_map if g >= 0}):
        if run and (g != run[-1] + 1 or g in starts):  # gap, or a new shard starts at g
            blocks.append(Rows(bisect.bisect_right(starts, run[0]) - 1, run[0], run[-1] + 1))
            run = []
        run.append(g)
    if run:
        blocks.append(Rows(bisect.bisect_right(starts, run[0]) - 1, run[0], run[-1] + 1))
    return tuple(blocks)
