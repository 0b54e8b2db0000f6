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

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from . import _build, _local
from ._atoms import canonical, dim_indices, dim_intervals, offsets
from ._build import check_atoms
from ._checks import (
    as_int,
    check_mesh_shape,
    check_part,
    format_sizes,
    int_tuple,
    mesh_dims_sharding,
    nested_outer,
    normalise_placements,
)
from .local_shapes import infer_sizes

__all__ = ["ShardLayout", "format_sizes", "offsets", "owner_of"]

SizesEntry = tuple[tuple[int, ...], ...] | None
AtomsEntry = tuple[tuple[int, ...] | None, ...] | None


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

    ``atoms``/``cuts`` describe dims that views merged or split (see
    ``shardlab.layout._atoms``): None for the usual block layout. A *strided* dim (several
    atoms) has no single box per rank; :meth:`local_box` refuses it, :meth:`dim_indices` /
    :meth:`dim_intervals` describe it.
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    sizes: tuple[SizesEntry, ...]
    atoms: AtomsEntry = None  # per tensor dim: None (a block dim) or its atom extents
    cuts: tuple[int | None, ...] | None = None  # per mesh dim: the atom its Shard cuts

    def __post_init__(self) -> None:
        gshape = int_tuple("global_shape", self.global_shape)
        mshape = check_mesh_shape(self.mesh_shape)
        places = normalise_placements(self.placements, len(mshape), len(gshape))
        if tuple(self.placements) != places:
            raise ValueError(f"placements must be normalised (non-negative dims), got {places}")
        if not isinstance(self.sizes, tuple) or len(self.sizes) != len(mshape):
            raise ValueError(f"sizes must be a tuple with one entry per mesh dim ({len(mshape)})")
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "mesh_shape", mshape)
        object.__setattr__(self, "placements", places)
        if self.atoms is not None:
            check_atoms(gshape, self.atoms)
            self._check_sizes(raw=True)
            sizes, atoms, cuts = canonical(gshape, places, self.sizes, self.atoms, self.cuts)
            object.__setattr__(self, "sizes", sizes)
            object.__setattr__(self, "atoms", atoms)
            object.__setattr__(self, "cuts", cuts)
        else:
            object.__setattr__(self, "cuts", None)
        self._check_sizes()

    def __hash__(self) -> int:
        """Computed once: layouts are keys of every cached decision (placements hash slowly)."""
        h = self.__dict__.get("_hash")
        if h is None:
            fields = (self.global_shape, self.mesh_shape, self.placements, self.sizes)
            h = hash((*fields, self.atoms, self.cuts))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # the cached hash stays in its process
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_whole", "_places")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _check_sizes(self, raw: bool = False) -> None:
        for m, (p, entry) in enumerate(zip(self.placements, self.sizes, strict=True)):
            if not isinstance(p, Shard):
                if entry is not None:
                    raise ValueError(f"sizes[{m}] must be None for {format_sizes(p, None, m)}")
                continue
            outer = self.nested_outer(m)
            atom = self.cut_of(m)
            ats = self.dim_atoms(p.dim)
            if raw and self.cuts is not None and not 0 <= atom < len(ats):
                raise ValueError(f"cuts[{m}] = {atom} is not an atom of tensor dim {p.dim}")
            wholes = self.sizes[outer][0] if outer is not None else (ats[atom],)
            where = f"pieces of mesh dim {outer}" if outer is not None else "entry"
            if not isinstance(entry, tuple) or len(entry) != len(wholes):
                raise ValueError(
                    f"sizes[{m}] must hold {len(wholes)} size tuple(s), one per {where}"
                )
            for o, (part, whole) in enumerate(zip(entry, wholes, strict=True)):
                check_part(m, o if outer is not None else None, p, part, whole, self.mesh_shape[m])

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
        return _build.build(cls, global_shape, mesh_shape, placements, sizes)

    @classmethod
    def from_local_shapes(
        cls,
        global_shape: Sequence[int] | None,
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        local_shapes: Mapping[tuple[int, ...], Sequence[int]],
    ) -> ShardLayout:
        """Infer sizes (and ``global_shape`` if None) from every rank's local shape."""
        gshape, places, sizes = infer_sizes(global_shape, mesh_shape, placements, local_shapes)
        return cls.build(gshape, mesh_shape, places, sizes)

    def sizes_arg(self, mesh_dim: int):
        """Mesh dim ``mesh_dim``'s sizes as :meth:`build` takes them: None, a list, or a
        list per outer piece (nested)."""
        entry = self.sizes[mesh_dim]
        if entry is None:
            return None
        return list(entry[0]) if len(entry) == 1 else [list(e) for e in entry]

    def with_sizes(self, sizes: Sequence | None) -> ShardLayout:
        """Same tensor, mesh and placements; new sizes (same input forms as :meth:`build`)."""
        return ShardLayout.build(self.global_shape, self.mesh_shape, self.placements, sizes)

    def with_placements(
        self, placements: Sequence[Placement], sizes: Sequence | None = None
    ) -> ShardLayout:
        """Same tensor and mesh; new placements and sizes (default: chunk)."""
        return ShardLayout.build(self.global_shape, self.mesh_shape, placements, sizes)

    def replace(self, **changes) -> ShardLayout:
        """A copy with some fields changed (atoms and cuts kept unless given); kept per
        layout and (typed) changes, as :meth:`build`."""
        return _build.replace(self, changes)

    # ------------------------------------------------------------------ atoms
    def dim_atoms(self, tensor_dim: int) -> tuple[int, ...]:
        """Atom extents of ``tensor_dim`` (one atom, the whole dim, for block dims)."""
        if self.atoms is None or self.atoms[tensor_dim] is None:
            return (self.global_shape[tensor_dim],)
        return self.atoms[tensor_dim]

    def cut_of(self, mesh_dim: int) -> int:
        """Which atom of its Shard dim ``mesh_dim`` cuts (0 for block dims)."""
        cuts = self.cuts
        if cuts is None or cuts[mesh_dim] is None:
            return 0
        return cuts[mesh_dim]

    def nested_outer(self, mesh_dim: int) -> int | None:
        """The outer mesh dim cutting the same atom before ``mesh_dim``, if any."""
        outer = nested_outer(self.placements, mesh_dim)
        if outer is not None and self.cut_of(outer) != self.cut_of(mesh_dim):
            return None
        return outer

    def cut_by(self, tensor_dim: int) -> list[int]:
        """Mesh dims of more than one rank that cut ``tensor_dim``. A mesh dim of one rank
        holds the whole dim: nothing is exchanged over it (no halo, no ring, no sum)."""
        return [
            m
            for m, p in enumerate(self.placements)
            if isinstance(p, Shard) and p.dim == tensor_dim and self.mesh_shape[m] > 1
        ]

    def is_whole(self) -> bool:
        """True if every rank holds all of the tensor, in its order: no mesh dim of more
        than one rank cuts it and nothing is Partial (a 1-rank mesh; Shard only on mesh
        dims of one rank, Replicate on the others). Torch's own op on such blocks is the
        single-device op. Computed once per layout (every patched call asks)."""
        hit = self.__dict__.get("_whole")
        if hit is None:
            hit = all(
                isinstance(p, Replicate) or (isinstance(p, Shard) and n == 1)
                for p, n in zip(self.placements, self.mesh_shape)
            )
            object.__setattr__(self, "_whole", hit)
        return hit

    def is_block(self, tensor_dim: int | None = None) -> bool:
        """True if ``tensor_dim`` (default: every dim) is cut into consecutive pieces."""
        if self.atoms is None:
            return True
        if tensor_dim is None:
            return all(a is None for a in self.atoms)
        return self.atoms[tensor_dim] is None

    def strided_dims(self) -> list[int]:
        """The tensor dims whose pieces are strided (not one contiguous block per rank)."""
        return [d for d in range(len(self.global_shape)) if not self.is_block(d)]

    def dim_indices(self, tensor_dim: int, coord: Sequence[int]):
        """Sorted global indices along ``tensor_dim`` held at ``coord`` (numpy int64)."""
        return dim_indices(self, tensor_dim, self._coord(coord))

    def dim_intervals(self, tensor_dim: int, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The same indices as ``[start, stop)`` intervals."""
        return dim_intervals(self, tensor_dim, self._coord(coord))

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
                f"{self.nested_outer(mesh_dim)} and its sizes differ per piece"
            )
        return entry[self._coord(coord)[self.nested_outer(mesh_dim)]]

    def sizes_along(self, tensor_dim: int) -> tuple[int, ...]:
        """All pieces along ``tensor_dim`` in order (row-major mesh order if cut twice)."""
        ndim = len(self.global_shape)
        if not -ndim <= as_int("tensor_dim", tensor_dim) < ndim:
            raise ValueError(f"tensor_dim {tensor_dim} is out of range for {ndim} dims")
        self._require_block(tensor_dim % ndim, "sizes_along")
        dims = mesh_dims_sharding(self.placements, tensor_dim % ndim)
        if not dims:
            return (self.global_shape[tensor_dim],)
        return tuple(itertools.chain.from_iterable(self.sizes[dims[-1]]))

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Shape of the block held by the rank at ``coord``."""
        return _local.local_shape(self, _local.int_coord(coord))

    def local_offset(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Global index where that block starts along every tensor dim (0 if unsharded).

        An empty piece starts where it sits in :meth:`sizes_along` (for empty nested pieces
        torch's ``compute_local_shape_and_global_offset`` reports the dim size instead).
        """
        return tuple(start for start, _ in _local.local_box(self, _local.int_coord(coord)))

    def local_box(self, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The block as global ``[start, stop)`` ranges, one per tensor dim."""
        return _local.local_box(self, _local.int_coord(coord))

    def numel(self, coord: Sequence[int]) -> int:
        """Number of elements held by the rank at ``coord``."""
        total = 1
        for n in self.local_shape(coord):
            total *= n
        return total

    def is_even(self) -> bool:
        """True iff every size equals the chunk default, i.e. DTensor's own layout."""
        return self.is_block() and self.sizes == self.with_sizes(None).sizes

    # ------------------------------------------------------------------ internals
    def _coord(self, coord: Sequence[int]) -> tuple[int, ...]:
        c = int_tuple("coord", coord)
        if len(c) != len(self.mesh_shape) or any(
            i >= n for i, n in zip(c, self.mesh_shape, strict=True)
        ):
            raise ValueError(f"coord {c} is not a coordinate of mesh {self.mesh_shape}")
        return c

    def _require_block(self, tensor_dim: int, what: str) -> None:
        if not self.is_block(tensor_dim):
            raise ValueError(
                f"{what}: tensor dim {tensor_dim} is strided ({self.describe_dim(tensor_dim)}): "
                "its pieces are not consecutive; use dim_indices / dim_intervals"
            )

    def describe_dim(self, tensor_dim: int) -> str:
        """``atoms (4, 6), atom 1 cut by mesh dim 0`` (how a learner reads a strided dim)."""
        cut = [
            f"atom {self.cut_of(m)} cut by mesh dim {m}"
            for m, p in enumerate(self.placements)
            if isinstance(p, Shard) and p.dim == tensor_dim
        ]
        ats = " x ".join(map(str, self.dim_atoms(tensor_dim)))
        return f"atoms ({ats})" + (", " + ", ".join(cut) if cut else "")

    def _piece(self, tensor_dim: int, coord: tuple[int, ...]) -> tuple[int, int]:
        """(global start, size) of ``coord``'s piece along ``tensor_dim``."""
        return _local.piece(self, tensor_dim, coord)

    def __str__(self) -> str:
        parts = []
        for m, (p, entry) in enumerate(zip(self.placements, self.sizes, strict=True)):
            shown = None if entry is None else (entry[0] if len(entry) == 1 else entry)
            text = format_sizes(p, shown, m)
            if isinstance(p, Shard) and not self.is_block(p.dim):
                text += f" (strided: {self.describe_dim(p.dim)})"
            parts.append(text)
        return (
            f"ShardLayout(global {self.global_shape}, mesh {self.mesh_shape}, [{', '.join(parts)}])"
        )

    __repr__ = __str__
