"""Infer shard sizes from the local shapes every rank reports (e.g. after an all-gather).

Who must agree with whom, for tensor dim ``d``::

    d not sharded (Replicate/Partial/other dims): every rank has the same size along d
    d cut by mesh dim m only:  ranks with the same coord[m] hold the same piece -> same size;
                               the piece sizes along m, in coord[m] order, are that mesh
                               dim's sizes
    d cut by mesh dims 0 and 1 (Shard(d), Shard(d)): rank (i, j) holds inner piece j of
                               outer piece i; outer size i = sum over j

Used by :meth:`ShardLayout.from_local_shapes`; returns arguments for :meth:`ShardLayout.build`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from torch.distributed.tensor.placement_types import Placement

from ._checks import (
    check_mesh_shape,
    int_tuple,
    mesh_dims_sharding,
    normalise_placements,
    placement_str,
)


def infer_sizes(
    global_shape: Sequence[int] | None,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    local_shapes: Mapping[tuple[int, ...], Sequence[int]],
) -> tuple[tuple[int, ...], tuple[Placement, ...], list]:
    """``(global_shape, placements, sizes)`` consistent with ``local_shapes``, or ValueError."""
    mshape = check_mesh_shape(mesh_shape)
    if not isinstance(local_shapes, Mapping):
        raise TypeError(
            "local_shapes must map every mesh coordinate (a tuple) to that rank's local shape, "
            f"got {type(local_shapes).__name__}"
        )
    expected = list(itertools.product(*(range(n) for n in mshape)))
    keys = {}
    for key in local_shapes:
        coord = int_tuple("local_shapes key", key if isinstance(key, Sequence) else (key,))
        keys[coord] = key
    missing = [c for c in expected if c not in keys]
    extra = [c for c in keys if c not in set(expected)]
    if missing or extra:
        raise ValueError(
            f"local_shapes must have exactly one entry per coordinate of mesh {mshape}; "
            f"missing {missing}, unexpected {extra}"
        )
    shapes = {c: int_tuple(f"local_shapes[{c}]", local_shapes[keys[c]]) for c in expected}
    first = expected[0]
    ndim = len(shapes[first])
    for c, s in shapes.items():
        if len(s) != ndim:
            raise ValueError(
                f"local_shapes: rank {c} has shape {s} ({len(s)} dims) but rank {first} has "
                f"{shapes[first]} ({ndim} dims); every rank must have the same number of dims"
            )
    gshape = None if global_shape is None else int_tuple("global_shape", global_shape)
    if gshape is not None and len(gshape) != ndim:
        raise ValueError(
            f"global_shape {gshape} has {len(gshape)} dims but local_shapes have {ndim}"
        )
    places = normalise_placements(placements, len(mshape), ndim)

    sizes: list = [None] * len(mshape)
    inferred = []
    for d in range(ndim):
        mesh_dims = mesh_dims_sharding(places, d)
        if len(mesh_dims) == 2:  # rank (i, j) holds inner piece j of outer piece i
            inner = [[shapes[(i, j)][d] for j in range(mshape[1])] for i in range(mshape[0])]
            sizes[0] = [sum(row) for row in inner]
            sizes[1] = inner
            total = sum(sizes[0])
        elif len(mesh_dims) == 1:
            m = mesh_dims[0]
            sizes[m] = [
                _agreed(shapes, d, places, lambda c, k=k, m=m: c[m] == k) for k in range(mshape[m])
            ]
            total = sum(sizes[m])
        else:
            total = _agreed(shapes, d, places, lambda c: True)
        if gshape is not None and gshape[d] != total:
            raise ValueError(
                f"local_shapes add up to {total} along tensor dim {d} but global_shape[{d}] "
                f"is {gshape[d]} (placements {[placement_str(p) for p in places]})"
            )
        inferred.append(total)
    return (gshape if gshape is not None else tuple(inferred)), places, sizes


def _agreed(shapes: dict, d: int, places: Sequence[Placement], same_piece) -> int:
    """The size along ``d`` shared by every rank selected by ``same_piece`` (else ValueError)."""
    group = [(c, s[d]) for c, s in shapes.items() if same_piece(c)]
    (c0, n0), *rest = group
    for c, n in rest:
        if n != n0:
            raise ValueError(
                f"local_shapes: ranks {c0} and {c} hold the same piece of tensor dim {d} under "
                f"placements {[placement_str(p) for p in places]}, but have sizes {n0} and {n} "
                f"along it (shapes {shapes[c0]} and {shapes[c]})"
            )
    return n0
