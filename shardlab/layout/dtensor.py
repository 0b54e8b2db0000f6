"""The layout of a plain DTensor: torch's ``torch.chunk`` sizes as a :class:`ShardLayout`."""

from __future__ import annotations

from torch.distributed.tensor import Shard

from shardlab import _compat
from shardlab.layout._build import chunk_sizes
from shardlab.layout.shards import ShardLayout

__all__ = ["layout_of_dtensor"]


def layout_of_dtensor(dt) -> ShardLayout:
    """The layout of a plain DTensor: chunk sizes (``_StridedShard`` as atoms)."""
    mesh, shape = dt.device_mesh, tuple(dt.shape)
    places, sizes, atoms, cuts = [], [], [None] * len(shape), []
    for m, p in enumerate(dt.placements):
        strided = _compat.strided_shard_parts(p)
        if strided is not None:
            d, sf = strided
            d %= len(shape)
            if shape[d] % sf or any(
                (isinstance(q, Shard) or _compat.strided_shard_parts(q))
                and k != m
                and (q.dim if isinstance(q, Shard) else _compat.strided_shard_parts(q)[0])
                % len(shape)
                == d
                for k, q in enumerate(dt.placements)
            ):
                raise NotImplementedError(
                    f"a DTensor with {p} on mesh dim {m} (shape {list(shape)}) has no exact "
                    "shardlab layout; redistribute it first"
                )
            places.append(Shard(d))
            sizes.append((chunk_sizes(shape[d] // sf, mesh.shape[m]),))
            atoms[d] = (sf, shape[d] // sf)
            cuts.append(1)
        else:
            places.append(p)
            sizes.append(None)
            cuts.append(None)
    if all(a is None for a in atoms):
        return ShardLayout.build(shape, tuple(mesh.shape), places)
    for m, p in enumerate(places):
        if isinstance(p, Shard) and sizes[m] is None:
            sizes[m] = (chunk_sizes(shape[p.dim], mesh.shape[m]),)
    return ShardLayout(
        shape, tuple(mesh.shape), tuple(places), tuple(sizes), tuple(atoms), tuple(cuts)
    )
