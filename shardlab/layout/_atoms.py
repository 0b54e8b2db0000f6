"""Atoms: how a tensor dim that views have merged or split is cut by the mesh.

A block layout cuts each tensor dim into consecutive pieces. After a view merges a
sharded dim with an outer one (``(B, S) -> (B*S)``, S sharded) the pieces are no longer
consecutive. An *atom* factorisation describes both: tensor dim ``d`` of extent
``N = e_0 * e_1 * ... * e_k`` (row-major, atom 0 outermost); each mesh dim that shards
``d`` cuts exactly one atom into consecutive pieces (two mesh dims cutting the same atom
nest, as ``(Shard(d), Shard(d))`` always did). A rank holds, along ``d``, every index
whose atom digits all lie in its pieces, in increasing order::

    (B, S) = (2, 6), S cut [4, 2]  ->  flatten  ->  atoms (2, 6), atom 1 cut [4, 2]
        rank 0: indices 0-3 and 6-9 (local 8)     rank 1: 4-5 and 10-11 (local 4)

Canonical form (so that equal ownership compares equal): atoms nobody cuts merge into the
atom before them (an uncut inner atom of extent R multiplies the cut atom's sizes by R),
uncut atoms of extent 1 vanish, and a dim left with one atom is a plain block dim
(``None``). Pure functions on tuples; :class:`~shardlab.layout.ShardLayout` calls them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from torch.distributed.tensor import Shard

Atoms = tuple[int, ...]


def scale_entry(entry, factor: int):
    """A sizes entry (tuple of size tuples) with every size times ``factor``."""
    return tuple(tuple(v * factor for v in part) for part in entry)


def canonical(global_shape, placements, sizes, atoms, cuts):
    """Canonical ``(sizes, atoms, cuts)``; ``atoms``/``cuts`` are None for block layouts.

    ``atoms``: per tensor dim None or extents; ``cuts``: per mesh dim the atom index its
    Shard cuts (None or a missing entry: atom 0). Non-Shard mesh dims' cuts are ignored.
    """
    if atoms is None:
        return sizes, None, None
    sizes = list(sizes)
    new_atoms: list[Atoms | None] = []
    new_cuts: list[int | None] = [None] * len(placements)
    for d, n in enumerate(global_shape):
        ats = tuple(atoms[d]) if atoms[d] is not None else (n,)
        cutters = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        at = {m: (cuts[m] if cuts is not None and cuts[m] is not None else 0) for m in cutters}
        out: list[list] = []  # [extent, mesh dims cutting it]
        for i, e in enumerate(ats):
            ms = [m for m in cutters if at[m] == i]
            if ms:
                out.append([e, ms])
            elif out:  # uncut: joins the atom before it
                out[-1][0] *= e
                for m in out[-1][1]:
                    sizes[m] = scale_entry(sizes[m], e)
            elif e != 1:
                out.append([e, []])
        if not out:
            out = [[n, []]]
        for i, (_, ms) in enumerate(out):
            for m in ms:
                new_cuts[m] = i
        new_atoms.append(None if len(out) == 1 else tuple(e for e, _ in out))
    if all(a is None for a in new_atoms):
        return tuple(sizes), None, None
    return tuple(sizes), tuple(new_atoms), tuple(0 if c is None else c for c in new_cuts)


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Exclusive prefix sums: where each piece starts. ``offsets([5, 0, 4]) == (0, 5, 5)``."""
    return tuple(itertools.accumulate(sizes, initial=0))[:-1]


def atom_ranges(layout, d: int, coord: Sequence[int]) -> list[tuple[int, int]]:
    """Per atom of dim ``d``: ``(start, size)`` of ``coord``'s piece (uncut: the whole)."""
    ats = layout.dim_atoms(d)
    ranges = [(0, e) for e in ats]
    for m, p in enumerate(layout.placements):
        if not (isinstance(p, Shard) and p.dim == d):
            continue
        i = layout.cut_of(m)
        outer = layout.nested_outer(m)
        parts = layout.sizes[m][coord[outer] if outer is not None else 0]
        start, _ = ranges[i]
        ranges[i] = (start + offsets(parts)[coord[m]], parts[coord[m]])
    return ranges


def dim_indices(layout, d: int, coord: Sequence[int]) -> np.ndarray:
    """Sorted global indices along ``d`` held by ``coord`` (int64 array)."""
    ats = layout.dim_atoms(d)
    idx = np.zeros(1, dtype=np.int64)
    for e, (start, size) in zip(ats, atom_ranges(layout, d, coord), strict=True):
        idx = (idx[:, None] * e + np.arange(start, start + size, dtype=np.int64)[None, :]).ravel()
    return idx


def dim_intervals(layout, d: int, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The same set as ``[start, stop)`` intervals (adjacent ones merged)."""
    ats = layout.dim_atoms(d)
    ranges = atom_ranges(layout, d, coord)
    if any(size == 0 for _, size in ranges):
        return ()
    inner = 1
    for e in ats[1:]:
        inner *= e
    # the last atom's piece is contiguous; every combination of the outer digits repeats it
    *outer, (last_start, last_size) = ranges
    stride_outer = [1] * len(outer)
    acc = ats[-1]
    for i in range(len(outer) - 1, -1, -1):
        stride_outer[i] = acc
        acc *= ats[i]
    out: list[list[int]] = []
    for digits in itertools.product(*(range(s, s + n) for s, n in outer)):
        base = sum(dg * st for dg, st in zip(digits, stride_outer, strict=True))
        a, b = base + last_start, base + last_start + last_size
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)
