"""Layouts of ``mm`` and ``bmm``: which cut survives, which becomes a Partial sum.

``a (M, K) @ b (K, N)``, per mesh dim (what the two operands must be -> the result)::

    M   a cut on M, b whole          ->  Shard(0)        rows stay where they are
    N   a whole, b cut on N          ->  Shard(1)
    K   a cut on K, b cut alike on K ->  Partial(sum)    every rank adds its slice of K
    P   one operand Partial(sum), the other whole  ->  Partial(sum)
    R   both whole                   ->  Replicate

``bmm`` adds B (both cut alike on the batch dim -> Shard(0)). The candidates are the
strategies the operands' own cuts suggest; :func:`mm_strategies` lists every combination
as (a layout, b layout, output layout) and the caller takes the cheapest to move to.
"""

from __future__ import annotations

import itertools

from torch.distributed.tensor import Partial, Replicate, Shard

from ._build import chunk_sizes
from ._checks import cached
from .shards import ShardLayout

__all__ = ["mm_strategies"]


def _cut_desc(layout: ShardLayout, m: int, dim: int):
    """(sizes entry, atoms of dim, cut index) of mesh dim m cutting dim, else None."""
    p = layout.placements[m]
    if isinstance(p, Shard) and p.dim == dim:
        return layout.sizes[m], layout.dim_atoms(dim), layout.cut_of(m)
    return None


def _build(shape, mesh_shape, wants):
    """wants[m]: ("S", dim, desc) | ("P",) | ("R",). Atoms of a dim from its first cutter."""
    places, sizes, cuts = [], [], []
    atoms: list = [None] * len(shape)
    for w in wants:
        if w[0] == "S":
            _, dim, (entry, ats, cut) = w
            if atoms[dim] is not None and atoms[dim] != ats:
                return None
            atoms[dim] = ats
            places.append(Shard(dim))
            sizes.append(entry)
            cuts.append(cut)
        elif w[0] == "P":
            places.append(Partial())
            sizes.append(None)
            cuts.append(None)
        else:
            places.append(Replicate())
            sizes.append(None)
            cuts.append(None)
    try:
        if all(a is None or len(a) == 1 for a in atoms):
            return ShardLayout(tuple(shape), mesh_shape, tuple(places), tuple(sizes))
        return ShardLayout(
            tuple(shape),
            mesh_shape,
            tuple(places),
            tuple(sizes),
            tuple(None if a is None or len(a) == 1 else a for a in atoms),
            tuple(cuts),
        )
    except ValueError:
        return None


@cached
def mm_strategies(a: ShardLayout, b: ShardLayout, batched: bool):
    """Every (a target, b target, output layout) the operands' cuts suggest."""
    off = 1 if batched else 0
    dm, dk_a, dk_b, dn = off, off + 1, off, off + 1
    mesh = a.mesh_shape
    per_dim = []
    for m in range(len(mesh)):
        pa, pb = a.placements[m], b.placements[m]
        opts = []
        if _cut_desc(a, m, dm):
            opts.append("M")
        if _cut_desc(b, m, dn):
            opts.append("N")
        if _cut_desc(a, m, dk_a) or _cut_desc(b, m, dk_b):
            opts.append("K")
        if batched and (_cut_desc(a, m, 0) or _cut_desc(b, m, 0)):
            opts.append("B")
        if pa == Partial() and not isinstance(pb, Partial):
            opts.append("Pa")
        if pb == Partial() and not isinstance(pa, Partial):
            opts.append("Pb")
        per_dim.append(opts + ["R"])  # on a tie, a strategy that keeps a cut wins
    out_shape = ((a.global_shape[0],) if batched else ()) + (a.global_shape[dm], b.global_shape[dn])
    result = []
    for choice in itertools.product(*per_dim):
        wa, wb, wo = [], [], []
        for m, s in enumerate(choice):
            chunk = lambda n, m=m: ((chunk_sizes(n, mesh[m]),), (n,), 0)  # noqa: E731
            if s == "M":
                d = _cut_desc(a, m, dm)
                wa.append(("S", dm, d))
                wb.append(("R",))
                wo.append(("S", off, d))
            elif s == "N":
                d = _cut_desc(b, m, dn)
                wa.append(("R",))
                wb.append(("S", dn, d))
                wo.append(("S", off + 1, d))
            elif s == "K":
                d = _cut_desc(a, m, dk_a) or _cut_desc(b, m, dk_b) or chunk(a.global_shape[dk_a])
                wa.append(("S", dk_a, d))
                wb.append(("S", dk_b, d))
                wo.append(("P",))
            elif s == "B":
                d = _cut_desc(a, m, 0) or _cut_desc(b, m, 0)
                wa.append(("S", 0, d))
                wb.append(("S", 0, d))
                wo.append(("S", 0, d))
            elif s == "Pa":
                wa.append(("P",))
                wb.append(("R",))
                wo.append(("P",))
            elif s == "Pb":
                wa.append(("R",))
                wb.append(("P",))
                wo.append(("P",))
            else:
                wa.append(("R",))
                wb.append(("R",))
                wo.append(("R",))
        ta = _build(a.global_shape, mesh, wa)
        tb = _build(b.global_shape, mesh, wb)
        to = _build(out_shape, mesh, wo)
        if ta is not None and tb is not None and to is not None:
            result.append((ta, tb, to))
    return result
