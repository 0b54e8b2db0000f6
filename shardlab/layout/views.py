"""What layout a view of a sharded tensor has: pure functions of (layout, shapes).

A view never moves data on one device, and it need not on a mesh either: every rank
views its own block. The output layout follows from the atoms (see :mod:`._atoms`)::

    merge   (B, S, C) -> (B, S*C)   S cut [5, 3]:  atom S*C cut [15, 9]       (block)
            (B, S)    -> (B*S,)     S cut [5, 3]:  atoms (B, S), S cut        (strided)
    split   (S*C,)    -> (S, C)     cut [15, 9]:   S cut [5, 3]   (sizes divisible by C)
            (H,)      -> (H/4, 4)   cut [5, 3]:    no layout: 5 is no multiple of 4

When no layout can describe the result, the rule says which mesh dims are in the way
(:class:`Blocked`); the caller moves them (to sizes that fit, or to ``Replicate``) and
asks again. Every function reads the global layout only, so every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Shard

from ._checks import cached
from .shards import ShardLayout

__all__ = [
    "Blocked",
    "expand_layout",
    "permute_layout",
    "select_dims_layout",
    "slice_layout",
    "slice_sizes",
    "view_layout",
]


class Blocked(Exception):
    """No layout describes the result while ``mesh_dims`` shard as they do.

    ``factor``: the result would exist if those mesh dims' pieces were multiples of it
    (0: only by not sharding that way at all). ``reason`` is for error messages.
    """

    def __init__(self, mesh_dims: tuple[int, ...], factor: int, reason: str):
        super().__init__(reason)
        self.mesh_dims, self.factor, self.reason = tuple(mesh_dims), factor, reason


@dataclass
class _Atom:
    extent: int
    cut: list  # [(mesh dim, sizes entry)], outer mesh dim first


def _flat_atoms(layout: ShardLayout) -> list[_Atom]:
    atoms = []
    for d in range(len(layout.global_shape)):
        for i, e in enumerate(layout.dim_atoms(d)):
            cut = [
                (m, layout.sizes[m])
                for m, p in enumerate(layout.placements)
                if isinstance(p, Shard) and p.dim == d and layout.cut_of(m) == i
            ]
            atoms.append(_Atom(e, cut))
    return atoms


def _build(layout: ShardLayout, shape, groups: list[list[_Atom]]) -> ShardLayout:
    """The layout whose dim ``j`` is made of the atoms ``groups[j]``."""
    places = list(layout.placements)
    sizes = list(layout.sizes)
    cuts: list[int | None] = [None] * len(places)
    atoms = []
    for j, group in enumerate(groups):
        if not group:
            group = [_Atom(shape[j], [])]
        atoms.append(tuple(a.extent for a in group))
        for i, a in enumerate(group):
            for m, entry in a.cut:
                places[m], sizes[m], cuts[m] = Shard(j), entry, i
    return ShardLayout(
        tuple(shape), layout.mesh_shape, tuple(places), tuple(sizes), tuple(atoms), tuple(cuts)
    )


def _divisible(entry, factor: int) -> bool:
    return all(v % factor == 0 for part in entry for v in part)


@cached
def view_layout(layout: ShardLayout, shape: Sequence[int]) -> ShardLayout:
    """The layout of ``x.view(shape)`` (``shape`` without -1), or raise :class:`Blocked`."""
    shape = tuple(int(n) for n in shape)
    numel = 1
    for n in shape:
        numel *= n
    total = 1
    for n in layout.global_shape:
        total *= n
    if numel != total:
        raise ValueError(f"shape {list(shape)} is invalid for input of size {total}")
    sharded = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard)]
    if not sharded or shape == layout.global_shape:
        if not sharded:
            return layout.replace(global_shape=shape, atoms=None, cuts=None)
        return layout
    if total == 0:  # nothing to hold: any layout moves 0 bytes
        raise Blocked(tuple(sharded), 0, "an empty tensor is viewed across a sharded dim")

    atoms = _flat_atoms(layout)
    # cut atoms of extent 1 (one rank holds the row) ride on a size-1 output dim at their
    # place, if there is one; the other atoms of extent 1 are nothing
    queue: list[_Atom] = []
    pending: list[tuple[int, _Atom]] = []  # (number of atoms > 1 before it, atom)
    for a in atoms:
        if a.extent == 1:
            if a.cut:
                pending.append((len(queue), a))
            continue
        if (
            queue
            and not a.cut
            and not queue[-1].cut
            and (not pending or pending[-1][0] < len(queue))
        ):  # two whole atoms in a row (of neighbouring dims) are one
            queue[-1] = _Atom(queue[-1].extent * a.extent, [])
            continue
        queue.append(a)

    groups: list[list[_Atom]] = [[] for _ in shape]
    pos = 0  # atoms of extent > 1 consumed so far
    at_pos: dict[int, list[int]] = {}  # position -> size-1 output dims there
    for j, n in enumerate(shape):
        if n == 1:
            at_pos.setdefault(pos, []).append(j)
            continue
        need = n
        while need > 1:
            a = queue[0]
            if need % a.extent == 0:
                groups[j].append(queue.pop(0))
                need //= a.extent
                pos += 1
            elif a.extent % need == 0:
                inner = a.extent // need
                if a.cut and not all(_divisible(e, inner) for _, e in a.cut):
                    ms = tuple(m for m, _ in a.cut)
                    raise Blocked(ms, inner, _split_reason(layout, ms, a.extent, need, inner))
                outer = _Atom(need, [(m, _divide(e, inner)) for m, e in a.cut])
                groups[j].append(outer)
                queue[0] = _Atom(inner, [])
                need = 1
            else:  # the view regroups a cut atom with its neighbours: no product layout
                ms = (
                    tuple(m for m, _ in a.cut)
                    or _next_cut(queue)
                    or tuple(m for _, b in pending for m, _ in b.cut)
                )
                raise Blocked(ms, 0, _merge_reason(layout, ms, shape))
    for p, a in pending:
        spots = at_pos.get(p)
        if not spots:
            ms = tuple(m for m, _ in a.cut)
            raise Blocked(
                ms,
                0,
                f"a size-1 dim held by one rank (mesh dims {list(ms)}) "
                f"has no size-1 dim to go to in shape {list(shape)}",
            )
        groups[spots.pop(0)].append(a)
    return _build(layout, shape, groups)


def _divide(entry, factor: int):
    return tuple(tuple(v // factor for v in part) for part in entry)


def _next_cut(queue: list[_Atom]) -> tuple[int, ...]:
    for a in queue:
        if a.cut:
            return tuple(m for m, _ in a.cut)
    return ()


def _split_reason(layout, ms, extent, outer, inner) -> str:
    return (
        f"splitting a sharded extent {extent} into ({outer}, {inner}) needs every piece "
        f"on mesh dims {list(ms)} to be a multiple of {inner}; {layout} is not"
    )


def _merge_reason(layout, ms, shape) -> str:
    return (
        f"viewing {layout} as {list(shape)} mixes the pieces of mesh dims {list(ms)} with "
        "their neighbours: no block or strided layout describes it"
    )


@cached
def permute_layout(layout: ShardLayout, perm: Sequence[int]) -> ShardLayout:
    """Layout of ``x.permute(perm)``: dims (with their atoms) travel, nothing moves."""
    ndim = len(layout.global_shape)
    perm = [p % ndim if ndim else p for p in perm]
    where = {d: j for j, d in enumerate(perm)}
    places = tuple(Shard(where[p.dim]) if isinstance(p, Shard) else p for p in layout.placements)
    atoms = None if layout.atoms is None else tuple(layout.atoms[d] for d in perm)
    return ShardLayout(
        tuple(layout.global_shape[d] for d in perm),
        layout.mesh_shape,
        places,
        layout.sizes,
        atoms,
        layout.cuts,
    )


@cached
def expand_layout(layout: ShardLayout, shape: Sequence[int]) -> ShardLayout:
    """Layout of ``x.expand(shape)`` (``-1`` kept as is): new leading dims and grown size-1
    dims are whole on every rank; a grown size-1 dim held by one rank is blocked."""
    shape = list(shape)
    lead = len(shape) - len(layout.global_shape)
    out = [n if n != -1 else layout.global_shape[j - lead] for j, n in enumerate(shape)]
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and out[p.dim + lead] != layout.global_shape[p.dim]:
            raise Blocked((m,), 0, f"expanding a size-1 dim held by one rank (mesh dim {m})")
    places = tuple(Shard(p.dim + lead) if isinstance(p, Shard) else p for p in layout.placements)
    atoms = None
    if layout.atoms is not None:
        atoms = (None,) * lead + tuple(
            layout.atoms[d] if out[d + lead] == n else None
            for d, n in enumerate(layout.global_shape)
        )
    return ShardLayout(tuple(out), layout.mesh_shape, places, layout.sizes, atoms, layout.cuts)


@cached
def select_dims_layout(layout: ShardLayout, keep: Sequence[int]) -> ShardLayout:
    """Layout after dropping every dim not in ``keep`` (none of them sharded)."""
    where = {d: j for j, d in enumerate(keep)}
    places = tuple(Shard(where[p.dim]) if isinstance(p, Shard) else p for p in layout.placements)
    atoms = None if layout.atoms is None else tuple(layout.atoms[d] for d in keep)
    return ShardLayout(
        tuple(layout.global_shape[d] for d in keep),
        layout.mesh_shape,
        places,
        layout.sizes,
        atoms,
        layout.cuts,
    )


def slice_sizes(parts: Sequence[int], base: int, start: int, stop: int, step: int) -> tuple:
    """How many of ``start, start + step, ... < stop`` each consecutive piece holds."""
    out, at = [], base
    for n in parts:
        out.append(_count(at, at + n, start, stop, step))
        at += n
    return tuple(out)


def _count(a: int, b: int, start: int, stop: int, step: int) -> int:
    lo, hi = max(a, start), min(b, stop)
    if lo >= hi:
        return 0
    first = start + -(-(lo - start) // step) * step
    return 0 if first >= hi else (hi - 1 - first) // step + 1


@cached
def slice_layout(layout: ShardLayout, dim: int, start: int, stop: int, step: int):
    """Layout of ``x[..., start:stop:step, ...]`` along ``dim`` (bounds already clamped)."""
    n = max(0, (stop - start + step - 1) // step) if stop > start else 0
    shape = list(layout.global_shape)
    shape[dim] = n
    cutters = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]
    if not cutters:
        atoms = (
            None
            if layout.atoms is None
            else tuple(None if d == dim else a for d, a in enumerate(layout.atoms))
        )
        return layout.replace(global_shape=tuple(shape), atoms=atoms)
    if not layout.is_block(dim):
        raise Blocked(tuple(cutters), 0, f"slicing strided dim {dim} of {layout}")
    sizes = list(layout.sizes)
    for m in cutters:
        outer = layout.nested_outer(m)
        if outer is None:
            sizes[m] = (slice_sizes(layout.sizes[m][0], 0, start, stop, step),)
        else:
            bases = [0]
            for v in layout.sizes[outer][0]:
                bases.append(bases[-1] + v)
            sizes[m] = tuple(
                slice_sizes(part, bases[o], start, stop, step)
                for o, part in enumerate(layout.sizes[m])
            )
    return layout.replace(global_shape=tuple(shape), sizes=tuple(sizes))


def clamp_index(v: int, n: int) -> int:
    """A slice bound ``v`` of a dim of size ``n`` as torch clamps it (negative from the end)."""
    v = v + n if v < 0 else v
    return min(max(v, 0), n)
