"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) of ShardTensors, exact.

DCP stores a tensor as *chunks*: boxes of the global tensor, each a (global offsets, sizes)
pair written by one rank. Loading intersects the boxes a rank needs with the boxes stored,
so any layout (other sizes, world size, a DTensor, a plain tensor) reads any checkpoint, as
long as every box is exact. DCP asks the tensor for its boxes through three hooks
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``); DTensor's
derive them from ``torch.chunk`` sizes, so a ShardTensor answers them here from its layout.

Who owns which box. Global (9, 2), mesh (2, 2), ``[Shard(0), Replicate()]``, sizes [4, 5]::

    box 0: rows 0-3, offsets (0, 0) sizes (4, 2)   held by (0, 0) and (0, 1)
    box 1: rows 4-8, offsets (4, 0) sizes (5, 2)   held by (1, 0) and (1, 1)

* Every coordinate *reads* (loads) every non-empty box it holds.
* Exactly one coordinate *writes* each non-empty box: among the replicas of a box (the
  coordinates that differ only on Replicate mesh dims, ``R`` of them), the one with replica
  number ``(box number + crc32(fqn)) % R``. Box numbers and replica numbers are row-major
  over the Shard and the Replicate mesh dims. So the writes of replicated tensors spread
  over the replicas, every rank computes the same owners, and DCP's deduplication (which
  keeps one of the items with equal ``(fqn, offsets)``) has nothing to choose.
* Empty boxes are never written nor read: DCP deduplicates by ``(fqn, offsets)`` and an
  empty shard starts where its neighbour does, so torch's own empty chunks could make it
  drop a real one (pytorch#150862). A tensor with no elements at all is written once, by
  coordinate (0, ..), as one empty chunk of the global shape, so its key is in the checkpoint.
* Strided dims (views merged a sharded dim with an outer one: ``layout.is_block(d)`` False)
  hold several intervals per rank, in increasing order: every combination of one interval
  per dim is one box, and its local position is where those intervals sit in the block::

      (B, S) = (2, 6) flattened, S cut [4, 2]: rank 0 holds 0-3 and 6-9 -> boxes at 0 and 6

* Partial mesh dims are refused (a checkpoint stores values, not parts of a sum): reduce
  first, ``x.redistribute(placements=[Replicate() or Shard(d) ...])``. The refusal reads the
  placements only, so every rank raises the same error before anything is written.

The pure functions (``held_boxes``, ``written_boxes``, ``check_checkpointable``) map a
layout and a coordinate to boxes; the hooks below wrap them in DCP's objects.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from typing import NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm import p2p
from shardlab.layout import ShardLayout

__all__ = [
    "Box",
    "CheckpointLayoutError",
    "check_checkpointable",
    "create_chunk_list",
    "create_write_items",
    "get_tensor_shard",
    "held_boxes",
    "written_boxes",
]


class CheckpointLayoutError(RuntimeError):
    """A ShardTensor whose layout a checkpoint cannot hold. Not a ValueError: DCP turns
    a ValueError from ``__create_chunk_list__`` into "Invalid checkpoint metadata"."""


class Box(NamedTuple):
    """A box of the global tensor held by one coordinate: global ``offsets`` and ``sizes``,
    and ``local``: per tensor dim the ``[start, stop)`` of the box in the local block."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[tuple[int, int], ...]


def check_checkpointable(layout: ShardLayout, name: str = "the tensor") -> None:
    """Raise CheckpointLayoutError if ``layout`` cannot be stored as values (a Partial
    mesh dim). Reads the placements only: every rank of the mesh raises alike."""
    partial = [m for m, p in enumerate(layout.placements) if isinstance(p, Partial)]
    if partial:
        fix = [Replicate() if isinstance(p, Partial) else p for p in layout.placements]
        raise CheckpointLayoutError(
            f"cannot checkpoint {name}, a ShardTensor {layout}: mesh dim(s) {partial} are "
            "Partial (each rank holds a part of a sum) and a checkpoint stores values. "
            f"Reduce it first, e.g. .redistribute(placements={fix}). Supported: Shard and "
            "Replicate mesh dims of 1-D and 2-D meshes, any sizes (empty shards, strided dims)"
        )


@functools.lru_cache(maxsize=4096)
def held_boxes(layout: ShardLayout, coord: tuple[int, ...]) -> tuple[Box, ...]:
    """The non-empty boxes the rank at ``coord`` holds (one for a block layout, none if its
    block is empty, several along strided dims), in row-major order of their intervals."""
    per_dim = []
    for d in range(len(layout.global_shape)):
        pieces, at = [], 0  # intervals: one for a block dim, none if empty
        for a, b in layout.dim_intervals(d, coord):  # increasing: local positions follow
            pieces.append((a, b - a, (at, at + b - a)))
            at += b - a
        per_dim.append(pieces)
    return tuple(
        Box(tuple(p[0] for p in combo), tuple(p[1] for p in combo), tuple(p[2] for p in combo))
        for combo in itertools.product(*per_dim)
    )


def _row_major(coord, mesh_shape, dims) -> tuple[int, int]:
    """(index of ``coord`` restricted to mesh ``dims``, row-major; how many there are)."""
    index, count = 0, 1
    for m in dims:
        index, count = index * mesh_shape[m] + coord[m], count * mesh_shape[m]
    return index, count


def is_writer(layout: ShardLayout, coord: tuple[int, ...], salt: int = 0) -> bool:
    """True if ``coord`` is the one replica that writes its boxes (see the module doc)."""
    shard = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard)]
    rest = [m for m in range(len(layout.mesh_shape)) if m not in shard]
    box, _ = _row_major(coord, layout.mesh_shape, shard)
    replica, replicas = _row_major(coord, layout.mesh_shape, rest)
    return replica == (box + salt) % replicas


def written_boxes(layout: ShardLayout, coord: tuple[int, ...], salt: int = 0) -> tuple[Box, ...]:
    """The boxes the rank at ``coord`` writes: over all coordinates, every element of the
    global tensor exactly once (a tensor without elements: one empty box, by coord 0)."""
    check_checkpointable(layout)
    if 0 in layout.global_shape:
        if any(coord):
            return ()
        shape = layout.global_shape
        return (Box((0,) * len(shape), shape, tuple((0, n) for n in shape)),)
    return held_boxes(layout, coord) if is_writer(layout, coord, salt) else ()


def fqn_salt(fqn: str) -> int:
    """A number from the key, the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(fqn.encode())


# -- DCP's hooks --------------------------------------------------------------------------
def _name(st) -> str:
    return f"the tensor of global shape {tuple(st._layout.global_shape)}"


def create_write_items(st, fqn: str) -> list:
    """``__create_write_items__``: one SHARD write item per box this rank writes."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    check_checkpointable(st._layout, f"key {fqn!r}")
    props = TensorProperties.create_from_tensor(st._local_tensor)
    size = torch.Size(st._layout.global_shape)
    items = []
    for box in written_boxes(st._layout, p2p.my_coord(st.device_mesh), fqn_salt(fqn)):
        offsets = torch.Size(box.offsets)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes))
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
            )
        )
    return items


def create_chunk_list(st) -> list:
    """``__create_chunk_list__``: the boxes this rank holds (what it loads)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    check_checkpointable(st._layout, _name(st))
    return [
        ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
        for b in held_boxes(st._layout, p2p.my_coord(st.device_mesh))
    ]


def get_tensor_shard(st, index) -> torch.Tensor:
    """``__get_tensor_shard__``: the box at ``index.offset`` as a view of the local block
    (DCP writes it when saving and copies into it when loading)."""
    layout = st._layout
    check_checkpointable(layout, _name(st))
    local = st._local_tensor
    want = tuple(index.offset) if index.offset is not None else None
    if 0 in layout.global_shape and want == (0,) * len(layout.global_shape):
        return local.new_empty(layout.global_shape)
    for box in held_boxes(layout, p2p.my_coord(st.device_mesh)):
        if box.offsets == want:
            return local[tuple(slice(a, b) for a, b in box.local)]
    raise RuntimeError(
        f"{_name(st)} ({layout}) holds no box at offsets {want} on mesh coordinate "
        f"{p2p.my_coord(st.device_mesh)} (key {index.fqn!r})"
    )
