"""Layouts of element-wise ops (with broadcasting) and of reductions: pure functions.

Element-wise: every input is moved to one target layout of the output shape, restricted
to its own shape (right-aligned, as broadcasting aligns dims)::

    out (B, S, C), target Shard(1) sizes [5, 3]
      x    (B, S, C)  -> Shard(1) sizes [5, 3]     (its own layout: nothing moves)
      bias (C,)       -> Replicate                  (broadcast: every rank uses all of it)
      mask (B, 1, C)  -> Replicate on that mesh dim (a size-1 dim grows everywhere)

Reductions: a reduced dim that a mesh dim cuts leaves every rank with a part of the
result: that mesh dim becomes ``Partial(sum|max|min)``; the other dims keep their cuts.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from ._checks import cached
from .shards import ShardLayout

__all__ = ["reduce_layout", "restrict", "target_from"]


@cached
def target_from(
    layout: ShardLayout, out_shape: Sequence[int], keep_partial: Sequence[bool]
) -> ShardLayout:
    """The output layout that keeps ``layout``'s cuts (an input of the op) where they
    survive broadcasting; its Partial mesh dims stay Partial where ``keep_partial[m]``."""
    out_shape = tuple(out_shape)
    lead = len(out_shape) - len(layout.global_shape)
    places, sizes, cuts = [], [], []
    atoms: list = [None] * len(out_shape)
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and layout.global_shape[p.dim] == out_shape[p.dim + lead]:
            places.append(Shard(p.dim + lead))
            sizes.append(layout.sizes[m])
            cuts.append(layout.cut_of(m))
            atoms[p.dim + lead] = layout.dim_atoms(p.dim)
        elif isinstance(p, Partial) and keep_partial[m]:
            places.append(p)
            sizes.append(None)
            cuts.append(None)
        else:
            places.append(Replicate())
            sizes.append(None)
            cuts.append(None)
    return _make(out_shape, layout.mesh_shape, places, sizes, atoms, cuts)


@cached
def restrict(target: ShardLayout, shape: Sequence[int], partial: Sequence[bool]) -> ShardLayout:
    """What an input of ``shape`` must look like to be used with output layout ``target``.

    ``partial[m]``: this input is itself Partial on mesh dim m (only then may it stay so).
    """
    shape = tuple(shape)
    lead = len(target.global_shape) - len(shape)
    places, sizes, cuts = [], [], []
    atoms: list = [None] * len(shape)
    for m, p in enumerate(target.placements):
        d = p.dim - lead if isinstance(p, Shard) else -1
        if isinstance(p, Shard) and d >= 0 and shape[d] == target.global_shape[p.dim]:
            places.append(Shard(d))
            sizes.append(target.sizes[m])
            cuts.append(target.cut_of(m))
            atoms[d] = target.dim_atoms(p.dim)
        elif isinstance(p, Partial) and partial[m]:
            places.append(p)
            sizes.append(None)
            cuts.append(None)
        else:
            places.append(Replicate())
            sizes.append(None)
            cuts.append(None)
    return _make(shape, target.mesh_shape, places, sizes, atoms, cuts)


@cached
def reduce_layout(
    layout: ShardLayout, dims: Sequence[int], keepdim: bool, kind: str = "sum"
) -> ShardLayout:
    """Layout after reducing ``dims`` (normalised) with ``kind``: cut reduced dims become
    ``Partial(kind)``; Partial inputs stay Partial (the caller checks they may)."""
    dims = set(dims)
    ndim = len(layout.global_shape)
    kept = [d for d in range(ndim) if d not in dims]
    where = {d: (d if keepdim else kept.index(d)) for d in kept}
    shape = (
        tuple((1 if d in dims else n) for d, n in enumerate(layout.global_shape))
        if keepdim
        else tuple(layout.global_shape[d] for d in kept)
    )
    places, sizes, cuts = [], [], []
    atoms: list = [None] * len(shape)
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and p.dim in dims:
            places.append(Partial(kind))
            sizes.append(None)
            cuts.append(None)
        elif isinstance(p, Shard):
            places.append(Shard(where[p.dim]))
            sizes.append(layout.sizes[m])
            cuts.append(layout.cut_of(m))
            atoms[where[p.dim]] = layout.dim_atoms(p.dim)
        else:
            places.append(p)
            sizes.append(None)
            cuts.append(None)
    return _make(shape, layout.mesh_shape, places, sizes, atoms, cuts)


def _make(shape, mesh_shape, places, sizes, atoms, cuts) -> ShardLayout:
    if all(a is None or len(a) == 1 for a in atoms):
        return ShardLayout(tuple(shape), mesh_shape, tuple(places), tuple(sizes))
    return ShardLayout(
        tuple(shape),
        mesh_shape,
        tuple(places),
        tuple(sizes),
        tuple(None if a is None or len(a) == 1 else tuple(a) for a in atoms),
        tuple(cuts),
    )
