"""What one rank holds: the per-coordinate queries of a :class:`~shardlab.layout.ShardLayout`.

Along a block dim, the rank at ``coord`` holds one piece ``(start, size)``: each mesh dim that
cuts the dim moves ``start`` to the rank's part and narrows ``size`` to it (a nested mesh dim
picks its sizes by the outer coordinate). Global (18, 3), mesh (4,), sizes [5, 5, 4, 4]::

    coord (2,):  dim 0 piece (10, 4)   dim 1 piece (0, 3)   (dim 1 is not cut)
                 local_shape (4, 3)    local_box ((10, 14), (0, 3))

A strided dim (several atoms, see :mod:`shardlab.layout._atoms`) has no single piece: its
local size is the product of the rank's piece of every atom.

Shapes and boxes are kept per (layout, coordinate): a layout computes its hash once.
"""

from __future__ import annotations

import functools

from ._atoms import atom_ranges, offsets
from ._checks import int_tuple, mesh_dims_sharding


def int_coord(coord) -> tuple:
    """``coord`` as a tuple, refused (as :meth:`ShardLayout._coord` does) unless it holds
    ints only: the caches keyed by it must not take ``(True,)`` or ``(1.0,)`` for ``(1,)``."""
    c = tuple(coord)
    if any(type(i) is not int for i in c):
        int_tuple("coord", coord)  # raises TypeError naming the entry
    return c


@functools.lru_cache(maxsize=16384)
def local_shape(layout, coord: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the block held at ``coord`` (a tuple of ints: :func:`int_coord`)."""
    c = layout._coord(coord)
    if layout.atoms is None:
        return tuple(piece(layout, d, c)[1] for d in range(len(layout.global_shape)))
    out = []
    for d in range(len(layout.global_shape)):
        n = 1
        for _, size in atom_ranges(layout, d, c):
            n *= size
        out.append(n)
    return tuple(out)


@functools.lru_cache(maxsize=16384)
def local_box(layout, coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The block held at ``coord`` as global ``[start, stop)`` ranges, one per tensor dim."""
    c = layout._coord(coord)
    pieces = (piece(layout, d, c) for d in range(len(layout.global_shape)))
    return tuple((start, start + n) for start, n in pieces)


def piece(layout, tensor_dim: int, coord: tuple[int, ...]) -> tuple[int, int]:
    """(global start, size) of ``coord``'s piece along ``tensor_dim``."""
    layout._require_block(tensor_dim, "local_box")
    start, size = 0, layout.global_shape[tensor_dim]
    for m in mesh_dims_sharding(layout.placements, tensor_dim):
        outer = layout.nested_outer(m)
        parts = layout.sizes[m][coord[outer] if outer is not None else 0]
        start += offsets(parts)[coord[m]]
        size = parts[coord[m]]
    return start, size
