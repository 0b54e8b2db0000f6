"""Building a :class:`~shardlab.layout.ShardLayout` from what a user types.

:meth:`ShardLayout.build` takes sizes in several forms; this module turns them into the
canonical ``sizes`` (one entry per mesh dim, see :mod:`shardlab.layout.shards`)::

    global (7, 5), mesh (2, 3), [Shard(0), Shard(1)], sizes [None, [2, 2, 1]]
        mesh dim 0: None       -> chunk_sizes(7, 2)     -> ((4, 3),)
        mesh dim 1: [2, 2, 1]  -> one tuple             -> ((2, 2, 1),)

    global (5,), mesh (2, 2), [Shard(0), Shard(0)], sizes [[3, 2], [[2, 1], [1, 1]]]
        mesh dim 1 nests in mesh dim 0: one tuple per outer piece -> ((2, 1), (1, 1))

Layouts are kept per (typed) arguments and per (typed) changes: a layout is immutable, and
building one validates everything, while the engine asks for the same few again and again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from ._checks import (
    as_int,
    check_mesh_shape,
    format_sizes,
    int_tuple,
    nested_outer,
    normalise_placements,
    per_mesh_dim,
    placement_str,
)

_BUILT: dict = {}  # ShardLayout.build's arguments (typed) -> the layout (immutable)
_REPLACED: dict = {}  # (layout, its typed changes) -> ShardLayout.replace's layout


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """DTensor's default split: pieces of ``ceil(length / parts)``, the tail short or empty.

    ``chunk_sizes(5, 4) == (2, 2, 1, 0)``; ``chunk_sizes(0, 3) == (0, 0, 0)``.
    """
    length = as_int("length", length, 0)
    parts = as_int("parts", parts, 1)
    chunk = -(-length // parts)
    return tuple(max(0, min(chunk, length - i * chunk)) for i in range(parts))


def typed(value):
    """A hashable stand-in for an argument (of :meth:`ShardLayout.build`, ``replace``,
    :func:`~shardlab.layout.conv_plan`) that tells apart every type, down the nesting:
    a list from a tuple, a bool or a float from an int; TypeError if unhashable."""
    t = type(value)
    if t is list or t is tuple or t is torch.Size:
        return (t, tuple(typed(v) for v in value))
    hash(value)
    return (t, value)


def build(cls, global_shape, mesh_shape, placements, sizes):
    """:meth:`ShardLayout.build`: the layout ``cls`` of these arguments, kept per arguments
    (with their types: 2.0 is refused where 2 is not)."""
    try:
        key = (cls, typed(global_shape), typed(mesh_shape), typed(placements), typed(sizes))
        hit = _BUILT.get(key)
    except TypeError:  # something unhashable: validated every time
        return cls(*canonical_fields(global_shape, mesh_shape, placements, sizes))
    if hit is None:
        hit = cls(*canonical_fields(global_shape, mesh_shape, placements, sizes))
        if len(_BUILT) > 8192:
            _BUILT.clear()
        _BUILT[key] = hit
    return hit


def canonical_fields(global_shape, mesh_shape, placements, sizes) -> tuple:
    """Validated ``(global_shape, mesh_shape, placements, sizes)``, sizes in canonical form."""
    gshape = int_tuple("global_shape", global_shape)
    mshape = check_mesh_shape(mesh_shape)
    places = normalise_placements(placements, len(mshape), len(gshape))
    entries, flat_1d = per_mesh_dim(sizes, len(mshape))
    canonical: list = []
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
                tuple(int_tuple(f"sizes[{m}][{o}]", e, minimum=None) for o, e in enumerate(entry))
            )
    return gshape, mshape, places, tuple(canonical)


def replace(layout, changes: dict):
    """:meth:`ShardLayout.replace`: ``dataclasses.replace``, kept per layout and (typed)
    changes."""
    try:
        key = (layout, *((k, typed(v)) for k, v in sorted(changes.items())))
        hit = _REPLACED.get(key)
    except TypeError:  # something unhashable: validated every time
        return dataclasses.replace(layout, **changes)
    if hit is None:
        hit = dataclasses.replace(layout, **changes)
        if len(_REPLACED) > 8192:
            _REPLACED.clear()
        _REPLACED[key] = hit
    return hit


def check_atoms(global_shape: tuple[int, ...], atoms) -> None:
    """``atoms`` has one entry per tensor dim: None, or extents multiplying to that dim."""
    if not isinstance(atoms, tuple) or len(atoms) != len(global_shape):
        raise ValueError(
            f"atoms must be a tuple with one entry per tensor dim ({len(global_shape)})"
        )
    for d, (n, ats) in enumerate(zip(global_shape, atoms, strict=True)):
        if ats is None:
            continue
        ats = int_tuple(f"atoms[{d}]", ats)
        prod = 1
        for e in ats:
            prod *= e
        if prod != n or not ats:
            raise ValueError(f"atoms[{d}] = {ats} multiply to {prod}, but tensor dim {d} is {n}")
