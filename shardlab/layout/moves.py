"""Where a tensor goes when the layout it has cannot serve an op, and what that costs.

A rule that cannot describe its result raises :class:`~shardlab.layout.views.Blocked`
naming the mesh dims in the way. The candidates for those mesh dims are

* *resized*: the same cut with piece boundaries rounded to a multiple of the factor the
  view needs (a few rows travel to a neighbour; a Swin window partition of uneven rows);
* *replicated*: that mesh dim made ``Replicate`` (an all-gather along it);

and :func:`cheapest` picks the one whose :func:`~shardlab.layout.redistribute_plan`
moves the fewest elements. Pure functions: every rank picks the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from ._build import chunk_sizes
from ._checks import cached
from .redistribute import moved_elements, redistribute_plan
from .shards import ShardLayout, offsets
from .views import Blocked

__all__ = ["cheapest", "move_cost", "replicated", "resized", "unblock"]


def replicated(layout: ShardLayout, mesh_dims: Sequence[int]) -> ShardLayout:
    """``layout`` with ``mesh_dims`` made Replicate (Partial dims stay Partial)."""
    places, sizes = list(layout.placements), list(layout.sizes)
    for m in mesh_dims:
        if isinstance(places[m], Shard):
            places[m], sizes[m] = Replicate(), None
    for m, p in enumerate(places):  # an inner nest whose outer went cuts the whole atom
        if isinstance(p, Shard) and len(sizes[m]) > 1:
            still = [
                k
                for k in range(m)
                if isinstance(places[k], Shard)
                and places[k].dim == p.dim
                and layout.cut_of(k) == layout.cut_of(m)
            ]
            if not still:
                sizes[m] = (tuple(map(sum, zip(*sizes[m]))),)
    return layout.replace(placements=tuple(places), sizes=tuple(sizes))


def resized(layout: ShardLayout, mesh_dims: Sequence[int], factor: int) -> ShardLayout | None:
    """Piece boundaries of ``mesh_dims`` rounded to multiples of ``factor`` (None if nested)."""
    sizes = list(layout.sizes)
    for m in mesh_dims:
        entry = layout.sizes[m]
        if entry is None or len(entry) != 1 or layout.nested_outer(m) is not None:
            return None
        if any(layout.nested_outer(k) == m for k in range(len(sizes))):
            return None
        parts = entry[0]
        total = sum(parts)
        if total % factor:
            return None
        bounds = [min(total, factor * round(o / factor)) for o in offsets(parts)] + [total]
        bounds = [max(bounds[: i + 1]) for i in range(len(bounds))]
        sizes[m] = (tuple(b - a for a, b in zip(bounds, bounds[1:])),)
    return layout.replace(sizes=tuple(sizes))


@cached
def move_cost(src: ShardLayout, dst: ShardLayout) -> int:
    """Elements received over the network, all ranks together (Partial: all-reduce ~2x)."""
    if src == dst:
        return 0
    cost = 0
    a, b = src, dst
    for m, (p, q) in enumerate(zip(src.placements, dst.placements)):
        if isinstance(p, Partial) and p != q:
            cost += 2 * (src.mesh_shape[m] - 1) * max(src.numel(c) for c in src.coords())
            a = a.replace(placements=_swap(a.placements, m, Replicate()))
        if isinstance(q, Partial) and p != q:
            b = b.replace(placements=_swap(b.placements, m, Replicate()))
        if isinstance(p, Partial) and p == q:
            a = a.replace(placements=_swap(a.placements, m, Replicate()))
            b = b.replace(placements=_swap(b.placements, m, Replicate()))
    if a != b:
        cost += moved_elements(redistribute_plan(a, b))
    return cost


def _swap(places, m, p):
    out = list(places)
    out[m] = p
    return tuple(out)


def cheapest(src: ShardLayout, candidates: Sequence[ShardLayout | None]) -> ShardLayout:
    """The candidate reached from ``src`` with the fewest moved elements (first on ties)."""
    best, best_cost = None, None
    for c in candidates:
        if c is None:
            continue
        cost = move_cost(src, c)
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


def unblock(layout: ShardLayout, blocked: Blocked) -> list[ShardLayout]:
    """Layouts that lift ``blocked`` (cheapest first is the caller's choice)."""
    out = []
    if blocked.factor:
        r = resized(layout, blocked.mesh_dims, blocked.factor)
        if r is not None and r != layout:
            out.append(r)
    out.append(replicated(layout, blocked.mesh_dims))
    return out


def as_block(layout: ShardLayout, tensor_dim: int) -> ShardLayout:
    """``layout`` with ``tensor_dim`` cut into consecutive chunks by the same mesh dims."""
    cutters = [
        m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == tensor_dim
    ]
    sizes = list(layout.sizes)
    whole = (layout.global_shape[tensor_dim],)
    for m in cutters:  # outer first: an inner cutter splits each outer piece
        sizes[m] = tuple(chunk_sizes(w, layout.mesh_shape[m]) for w in whole)
        whole = sizes[m][0] if len(sizes[m]) == 1 else whole
    if layout.atoms is None:
        return layout.replace(sizes=tuple(sizes))
    atoms = tuple(None if d == tensor_dim else a for d, a in enumerate(layout.atoms))
    cuts = tuple(0 if m in cutters else layout.cut_of(m) for m in range(len(sizes)))
    return layout.replace(sizes=tuple(sizes), atoms=atoms, cuts=cuts)
