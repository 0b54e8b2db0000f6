"""Uneven shard sizes on 1-D and 2-D device meshes: pure arithmetic, no process group.

A *global* tensor of shape ``global_shape`` lives on a device *mesh* of shape ``mesh_shape``.
Each mesh dim has one placement (torch's own objects):

* ``Shard(d)``    the ranks along this mesh dim cut tensor dim ``d`` into consecutive pieces;
* ``Replicate()`` every rank along this mesh dim holds the same data;
* ``Partial(op)`` every rank holds a full-shaped partial value (the true value is op-reduced).

DTensor chooses piece sizes itself (``torch.chunk``: ``ceil(n / parts)`` each, the tail short
or empty). ``ShardLayout`` allows any sizes. Global (18, 3), mesh (4,), ``[Shard(0)]``::

    sizes [5, 5, 4, 4]   rank 0: rows  0..4   local (5, 3)  offset (0, 0)
                         rank 1: rows  5..9   local (5, 3)  offset (5, 0)
                         rank 2: rows 10..13  local (4, 3)  offset (10, 0)
                         rank 3: rows 14..17  local (4, 3)  offset (14, 0)

Canonical ``ShardLayout.sizes``: one entry per mesh dim, ``None`` for Replicate/Partial, else a
tuple of size-tuples, one per piece of the *outer* mesh dim cutting the same tensor dim (only
``(Shard(d), Shard(d))`` nests), else exactly one::

    1-D   mesh (4,)   [Shard(0)]            global (18, 3)  sizes (((5, 5, 4, 4),),)
    2-D   mesh (2, 3) [Shard(0), Shard(1)]  global (7, 5)   sizes (((4, 3),), ((2, 2, 1),))
    twice mesh (2, 2) [Shard(0), Shard(0)]  global (5,)     sizes (((3, 2),), ((2, 1), (1, 1)))

    same dim twice: mesh dim 0 cuts first  [ 0 1 2 | 3 4 ]       -> (3, 2)
                    mesh dim 1 cuts pieces [ 0 1 | 2 ] [ 3 | 4 ] -> (2, 1) inside, (1, 1) inside
                    rank (0,0): rows 0-1, (0,1): row 2, (1,0): row 3, (1,1): row 4
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from ._checks import (
    as_int,
    check_mesh_shape,
    check_part,
    format_sizes,
    int_tuple,
    mesh_dims_sharding,
    nested_outer,
    normalise_placements,
    per_mesh_dim,
    placement_str,
)

__all__ = ["ShardLayout", "chunk_sizes", "format_sizes", "offsets", "owner_of"]

SizesEntry = tuple[tuple[int, ...], ...] | None


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """DTensor's default split: pieces of ``ceil(length / parts)``, the tail short or empty.

    ``chunk_sizes(5, 4) == (2, 2, 1, 0)``; ``chunk_sizes(0, 3) == (0, 0, 0)``.
    """
    length = as_int("length", length, 0)
    parts = as_int("parts", parts, 1)
    chunk = -(-length // parts)
    return tuple(max(0, min(chunk, length - i * chunk)) for i in range(parts))


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Exclusive prefix sums: where each piece starts. ``offsets([5, 0, 4]) == (0, 5, 5)``."""
    return tuple(itertools.accumulate(sizes, initial=0))[:-1]


def owner_of(index: int, sizes: Sequence[int]) -> int:
    """The part holding global ``index`` (never an empty part: it contains nothing)."""
    total = sum(sizes)
    if not 0 <= index < total:
        raise IndexError(f"index {index} is outside [0, {total}) for sizes {list(sizes)}")
    # the last part starting at or before `index` is non-empty (an empty one is followed by
    # a part with the same start), so it is the one containing `index`.
    return bisect.bisect_right(offsets(sizes), index) - 1


@dataclass(frozen=True, repr=False)
class ShardLayout:
    """A global tensor of ``global_shape`` on a mesh of ``mesh_shape``, with exact shard sizes.

    Build it with :meth:`build` or :meth:`from_local_shapes`; fields are canonical (see the
    module docstring). Coordinates (``coord``) are mesh coordinates, e.g. ``(1,)`` or ``(0, 2)``.
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    sizes: tuple[SizesEntry, ...]

    def __post_init__(self) -> None:
        gshape = int_tuple("global_shape", self.global_shape)
        mshape = check_mesh_shape(self.mesh_shape)
        places = normalise_placements(self.placements, len(mshape), len(gshape))
        if tuple(self.placements) != places:
            raise ValueError(f"placements must be normalised (non-negative dims), got {places}")
        if not isinstance(self.sizes, tuple) or len(self.sizes) != len(mshape):
            raise ValueError(f"sizes must be a tuple with one entry per mesh dim ({len(mshape)})")
        for m, (p, entry) in enumerate(zip(places, self.sizes, strict=True)):
            if not isinstance(p, Shard):
                if entry is not None:
                    raise ValueError(f"sizes[{m}] must be None for {format_sizes(p, None, m)}")
                continue
            outer = nested_outer(places, m)
            wholes = self.sizes[outer][0] if outer is not None else (gshape[p.dim],)
            where = f"pieces of mesh dim {outer}" if outer is not None else "entry"
            if not isinstance(entry, tuple) or len(entry) != len(wholes):
                raise ValueError(
                    f"sizes[{m}] must hold {len(wholes)} size tuple(s), one per {where}"
                )
            for o, (part, whole) in enumerate(zip(entry, wholes, strict=True)):
                check_part(m, o if outer is not None else None, p, part, whole, mshape[m])
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "mesh_shape", mshape)
        object.__setattr__(self, "placements", places)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def build(
        cls,
        global_shape: Sequence[int],
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        sizes: Sequence | None = None,
    ) -> ShardLayout:
        """Validate user input and return the canonical layout.

        ``sizes``: ``None`` (chunk default everywhere), a flat list of ints on a 1-D mesh, or one
        entry per mesh dim: ``None`` (chunk default), a list of ints (that mesh dim's parts), or,
        for mesh dim 1 nesting in mesh dim 0 on the same tensor dim, a list of lists (one per
        mesh-dim-0 piece; a flat list applies to every piece). Replicate/Partial entries: None.
        """
        gshape = int_tuple("global_shape", global_shape)
        mshape = check_mesh_shape(mesh_shape)
        places = normalise_placements(placements, len(mshape), len(gshape))
        entries, flat_1d = per_mesh_dim(sizes, len(mshape))
        canonical: list[SizesEntry] = []
        for m, (p, entry) in enumerate(zip(places, entries, strict=True)):
            if not isinstance(p, Shard):
                if entry is not None:
                    raise ValueError(
                        f"sizes[{m}] must be None for {format_sizes(p, None, m)}: only Shard "
                        "mesh dims have sizes"
                    )
                canonical.append(None)
                continue
            outer = nested_outer(places, m)
            wholes = canonical[outer][0] if outer is not None else (gshape[p.dim],)
            if entry is None:
                canonical.append(tuple(chunk_sizes(w, mshape[m]) for w in wholes))
            elif all(not isinstance(v, Sequence) for v in entry):
                name = "sizes" if flat_1d else f"sizes[{m}]"
                flat = int_tuple(name, entry, minimum=None)
                canonical.append(tuple(flat for _ in wholes))
            elif outer is None:
                raise TypeError(f"sizes[{m}] must be a list of ints for {placement_str(p)}")
            elif len(entry) != len(wholes):
                raise ValueError(
                    f"sizes[{m}] has {len(entry)} lists but mesh dim {outer} has {len(wholes)} "
                    f"pieces; give one list per piece (or one flat list for all)"
                )
            else:
                canonical.append(
                    tuple(
                        int_tuple(f"sizes[{m}][{o}]", e, minimum=None) for o, e in enumerate(entry)
                    )
                )
        return cls(gshape, mshape, places, tuple(canonical))

    @classmethod
    def from_local_shapes(
        cls,
        global_shape: Sequence[int] | None,
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        local_shapes: Mapping[tuple[int, ...], Sequence[int]],
    ) -> ShardLayout:
        """Infer sizes (and ``global_shape`` if None) from every rank's local shape."""
        from .local_shapes import infer_sizes

        gshape, places, sizes = infer_sizes(global_shape, mesh_shape, placements, local_shapes)
        return cls.build(gshape, mesh_shape, places, sizes)

    def with_sizes(self, sizes: Sequence | None) -> ShardLayout:
        """Same tensor, mesh and placements; new sizes (same input forms as :meth:`build`)."""
        return ShardLayout.build(self.global_shape, self.mesh_shape, self.placements, sizes)

    def with_placements(
        self, placements: Sequence[Placement], sizes: Sequence | None = None
    ) -> ShardLayout:
        """Same tensor and mesh; new placements and sizes (default: chunk)."""
        return ShardLayout.build(self.global_shape, self.mesh_shape, placements, sizes)

    # ------------------------------------------------------------------ queries
    def coords(self) -> list[tuple[int, ...]]:
        """Every mesh coordinate, row-major: (0, 0), (0, 1), ..., (1, 0), ..."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def shard_sizes(
        self, mesh_dim: int, coord: Sequence[int] | None = None
    ) -> tuple[int, ...] | None:
        """Part sizes along ``mesh_dim`` (None if not Shard); nested dims need ``coord``."""
        if not 0 <= as_int("mesh_dim", mesh_dim) < len(self.mesh_shape):
            raise ValueError(f"mesh_dim {mesh_dim} is not a dim of mesh {self.mesh_shape}")
        entry = self.sizes[mesh_dim]
        if entry is None:
            return None
        if len(entry) == 1:
            return entry[0]
        if coord is None:
            raise ValueError(
                f"coord is required: mesh dim {mesh_dim} nests inside mesh dim "
                f"{nested_outer(self.placements, mesh_dim)} and its sizes differ per piece"
            )
        return entry[self._coord(coord)[nested_outer(self.placements, mesh_dim)]]

    def sizes_along(self, tensor_dim: int) -> tuple[int, ...]:
        """All pieces along ``tensor_dim`` in order (row-major mesh order if cut twice)."""
        ndim = len(self.global_shape)
        if not -ndim <= as_int("tensor_dim", tensor_dim) < ndim:
            raise ValueError(f"tensor_dim {tensor_dim} is out of range for {ndim} dims")
        dims = mesh_dims_sharding(self.placements, tensor_dim % ndim)
        if not dims:
            return (self.global_shape[tensor_dim],)
        return tuple(itertools.chain.from_iterable(self.sizes[dims[-1]]))

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Shape of the block held by the rank at ``coord``."""
        c = self._coord(coord)
        return tuple(self._piece(d, c)[1] for d in range(len(self.global_shape)))

    def local_offset(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Global index where that block starts along every tensor dim (0 if unsharded).

        An empty piece starts where it sits in :meth:`sizes_along` (for empty nested pieces
        torch's ``compute_local_shape_and_global_offset`` reports the dim size instead).
        """
        c = self._coord(coord)
        return tuple(self._piece(d, c)[0] for d in range(len(self.global_shape)))

    def local_box(self, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The block as global ``[start, stop)`` ranges, one per tensor dim."""
        c = self._coord(coord)
        pieces = (self._piece(d, c) for d in range(len(self.global_shape)))
        return tuple((start, start + n) for start, n in pieces)

    def numel(self, coord: Sequence[int]) -> int:
        """Number of elements held by the rank at ``coord``."""
        total = 1
        for n in self.local_shape(coord):
            total *= n
        return total

    def is_even(self) -> bool:
        """True iff every size equals the chunk default, i.e. DTensor's own layout."""
        return self.sizes == self.with_sizes(None).sizes

    # ------------------------------------------------------------------ internals
    def _coord(self, coord: Sequence[int]) -> tuple[int, ...]:
        c = int_tuple("coord", coord)
        if len(c) != len(self.mesh_shape) or any(
            i >= n for i, n in zip(c, self.mesh_shape, strict=True)
        ):
            raise ValueError(f"coord {c} is not a coordinate of mesh {self.mesh_shape}")
        return c

    def _piece(self, tensor_dim: int, coord: tuple[int, ...]) -> tuple[int, int]:
        """(global start, size) of ``coord``'s piece along ``tensor_dim``."""
        start, size = 0, self.global_shape[tensor_dim]
        for m in mesh_dims_sharding(self.placements, tensor_dim):
            outer = nested_outer(self.placements, m)
            parts = self.sizes[m][coord[outer] if outer is not None else 0]
            start += offsets(parts)[coord[m]]
            size = parts[coord[m]]
        return start, size

    def __str__(self) -> str:
        parts = []
        for m, (p, entry) in enumerate(zip(self.placements, self.sizes, strict=True)):
            shown = None if entry is None else (entry[0] if len(entry) == 1 else entry)
            parts.append(format_sizes(p, shown, m))
        return (
            f"ShardLayout(global {self.global_shape}, mesh {self.mesh_shape}, [{', '.join(parts)}])"
        )

    __repr__ = __str__
