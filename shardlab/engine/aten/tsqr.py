"""TSQR: the QR of a matrix cut along its rows, with one all-gather of small factors.

``A`` (..., M, n) real, its row dim (-2) cut in blocks by one mesh dim (every other mesh dim
Replicate; the batch dims whole: :func:`row_cut`). :class:`TSQR`::

    A (9, 3) rows cut [4, 3, 2] over 3 ranks, k = min(M, n) = 3
      rank 0: A_0 (4, 3) = Q_0 (4, 3) R_0 (3, 3)      k_0 = min(4, 3) = 3
      rank 1: A_1 (3, 3) = Q_1 (3, 3) R_1 (3, 3)      k_1 = 3
      rank 2: A_2 (2, 3) = Q_2 (2, 2) R_2 (2, 3)      k_2 = 2   (an empty block: 0 rows)

1. each rank: ``Q_i, R_i = qr(A_i)`` (reduced), ``k_i = min(m_i, n)``, no message;
2. ONE all-gather over the cutting mesh dim of each rank's ``R_i`` (k_i x n), with, in the
   same buffer, the ``t_i`` rows of ``Q_i`` among the first ``k`` global rows (for the
   signs, 4.) and what a rule adds (``lstsq``: ``Q_i^T B_i``, k_i x nrhs, and the squared
   norms of ``B_i - Q_i Q_i^T B_i`` by column, 1 x nrhs); each padded to the longest
   rank's, the sizes being known from the layout;
3. every rank alike: ``Q_s, R = qr(R_s)``, ``R_s`` the stack of the ``R_i`` (K x n,
   K = sum k_i); this rank's block of ``Q`` is ``Q_i @ Q_s[its k_i rows]`` (m_i x k);
4. the signs. Householder QR is unique up to the signs of R's diagonal; LAPACK's choice
   depends on the whole matrix. Householder QR of ``A U`` (U upper triangular) takes the
   same reflectors as that of ``A``, so LAPACK's ``Q`` is that of ``Q_tsqr``, whose
   Householder QR is ``Q_tsqr = Q_lapack S``, S diagonal +-1; S follows from the top
   k x k block of ``Q_tsqr`` alone, by an LU in which each pivot takes the sign LAPACK's
   reflector would (:func:`_signs`; Ballard et al.'s Householder reconstruction). Then
   ``Q = Q_tsqr S``, ``R = S R_tsqr``: torch's own factors, to rounding. (Not when a
   Householder step meets an exactly zero column below its diagonal besides the last
   step of a matrix with M <= n, as an already triangular block: LAPACK then keeps the
   sign, this takes the other; nor where a pivot is zero to rounding.)

Messages: the one all-gather of step 2 (``<op>.tsqr``): per rank
``k_i n + t_i k_i (+ (k_i + 1) nrhs)`` numbers, padded to the largest, times the batch.
The rules on it: :mod:`.linalg`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.layout import ShardLayout
from shardlab.trace import label

_REAL = (torch.float32, torch.float64)


def row_cut(a) -> int | None:
    """The one mesh dim (of more than one rank) cutting ``a``'s row dim in blocks, every
    other mesh dim Replicate; else None."""
    if type(a) is not c.ShardTensor or a.ndim < 2 or a.dtype not in _REAL:
        return None
    if 0 in (a.shape[-2], a.shape[-1]):
        return None
    lay, found = a._layout, None
    for m, p in enumerate(lay.placements):
        if isinstance(p, Shard) and p.dim == a.ndim - 2 and found is None:
            found = m
        elif not isinstance(p, Replicate):
            return None
    if found is None or lay.mesh_shape[found] == 1 or not lay.is_block(a.ndim - 2):
        return None
    return found


def to_rows(a, cause: str):
    """``a`` cut along its rows (as it is: :func:`row_cut`); or, its batch dims whole and a
    matrix dim cut otherwise (its columns, both, in strided pieces, a Partial sum too), moved
    to its rows by the first mesh dim that cut a matrix dim, every other mesh dim Replicate
    (``cause``: an all-to-all for a cut moved from the columns; a square matrix cut along
    its columns keeps its sizes): ``(A cut along its rows, the mesh dim)``; else None."""
    m = row_cut(a)
    if m is not None:
        return a, m
    if type(a) is not c.ShardTensor or a.ndim < 2 or a.dtype not in _REAL:
        return None
    if 0 in (a.shape[-2], a.shape[-1]):
        return None
    lay, nd = a._layout, a.ndim
    cuts = [k for k, p in enumerate(lay.placements) if isinstance(p, Shard)]
    if any(lay.placements[k].dim < nd - 2 for k in cuts):
        return None  # a batch dim cut: the batched rule's, or the fallback
    cuts = [k for k in cuts if lay.mesh_shape[k] > 1]
    if not cuts:
        return None
    m, big_m, p = cuts[0], a.shape[-2], lay.mesh_shape[cuts[0]]
    held = lay.placements[m].dim
    square_cols = held == nd - 1 and big_m == a.shape[-1] and lay.is_block(held)
    if (held == nd - 2 and lay.is_block(held)) or square_cols:
        sizes = list(lay.shard_sizes(m))
    else:
        sizes = [big_m // p + (q < big_m % p) for q in range(p)]
    places = [Replicate()] * len(lay.placements)
    entry = [None] * len(places)
    places[m], entry[m] = Shard(nd - 2), sizes
    want = ShardLayout.build(tuple(a.shape), lay.mesh_shape, places, entry)
    return c.move(c.reduced(a, cause), want, cause), m


def transposed(a):
    """``a.mT`` as a ShardTensor: each block transposed, the cuts of the two matrix dims
    swapped, no message."""
    lay, nd = a._layout, a.ndim
    swap = {nd - 1: nd - 2, nd - 2: nd - 1}
    places = [Shard(swap.get(p.dim, p.dim)) if isinstance(p, Shard) else p for p in lay.placements]
    shape = (*a.shape[:-2], a.shape[-1], a.shape[-2])
    sizes = [lay.sizes_arg(j) for j in range(len(places))]
    return c.wrap(
        a._local_tensor.mT, a.device_mesh, ShardLayout.build(shape, lay.mesh_shape, places, sizes)
    )


def _signs(top, last_kept):
    """LAPACK's diagonal signs S of the Householder QR of an orthonormal ``Q`` from its top
    k x k block ``top`` (..., k, k): the LU of ``top - S``, each S_j = -sign(pivot) as
    ``dlarfg`` takes it (+ for the last step of a matrix with M <= n: nothing below)."""
    a = top.clone()
    k = a.shape[-1]
    s = a.new_empty(a.shape[:-1])
    for j in range(k):
        piv = a[..., j, j]
        sj = torch.where(piv >= 0, -1.0, 1.0).to(a.dtype)
        s[..., j] = -sj if last_kept and j == k - 1 else sj
        a[..., j, j] = piv - s[..., j]
        if j + 1 < k:
            lower = a[..., j + 1 :, j] / a[..., j, j].unsqueeze(-1)
            a[..., j + 1 :, j + 1 :] -= lower.unsqueeze(-1) * a[..., j, j + 1 :].unsqueeze(-2)
    return s


class TSQR:
    """Steps 1-4 on this rank. ``q_i`` (m_i x k_i), ``q_s`` this rank's rows of Q_s
    (k_i x k), ``r`` (k x n), ``r_s`` (K x n), ``extra``: the stacks of the added
    pieces' projections ``Q_i^T e_i`` (K x cols each), and ``rest``: the squared norms of
    what the projections leave, ``|e_i - Q_i Q_i^T e_i|^2`` by column, summed over the
    ranks (cols each), all local tensors."""

    def __init__(self, a, m, name, extra=(), signs=True):
        mesh = a.device_mesh
        p, me = mesh.shape[m], c.me(mesh)[m]
        sizes = a._layout.shard_sizes(m)
        big_m, n = a.shape[-2], a.shape[-1]
        batch = tuple(a.shape[:-2])
        k = min(big_m, n)
        ks = [min(s, n) for s in sizes]
        starts = [sum(sizes[:q]) for q in range(p)]
        ts = [max(0, min(k - starts[q], sizes[q])) if signs else 0 for q in range(p)]
        cols = [e.shape[-1] for e in extra]
        q_i, r_i = torch.linalg.qr(a._local_tensor)  # 1.
        proj = [q_i.mT @ e for e in extra]  # and what is left of e: its squares, by column
        rest = [(e - q_i @ pe).square().sum(-2, keepdim=True) for e, pe in zip(extra, proj)]
        mine = [r_i, q_i[..., : ts[me], :], *proj, *rest]
        lens = [kq * n + ts[q] * kq + (kq + 1) * sum(cols) for q, kq in enumerate(ks)]
        flat = torch.cat([t.reshape(*batch, -1) for t in mine], -1)
        flat = torch.nn.functional.pad(flat, (0, max(lens) - flat.shape[-1])).contiguous()
        if p > 1:  # 2. the one all-gather
            got = [torch.empty_like(flat) for _ in range(p)]
            with label(f"{name}.tsqr"):
                collectives.all_gather(got, flat, mesh.get_group(m))
        else:
            got = [flat]
        parts = []
        for q, kq in enumerate(ks):
            shapes = [(kq, n), (ts[q], kq), *((kq, w) for w in cols), *((1, w) for w in cols)]
            at, out = 0, []
            for r, w in shapes:
                out.append(got[q][..., at : at + r * w].reshape(*batch, r, w))
                at += r * w
            parts.append(out)
        self.r_s = torch.cat([pt[0] for pt in parts], -2)
        self.extra = [torch.cat([pt[2 + j] for pt in parts], -2) for j in range(len(extra))]
        self.rest = [sum(pt[2 + len(extra) + j] for pt in parts).squeeze(-2)
                     for j in range(len(extra))]  # fmt: skip
        q_s, r = torch.linalg.qr(self.r_s)  # 3.
        offs = [sum(ks[:q]) for q in range(p)]
        if signs:  # 4.
            top = torch.cat([pt[1] @ q_s[..., o : o + kq, :] for pt, o, kq in
                             zip(parts, offs, ks)], -2)  # fmt: skip
            s = _signs(top, big_m <= n)
            q_s, r = q_s * s.unsqueeze(-2), r * s.unsqueeze(-1)
        self.q_i, self.q_s, self.r = q_i, q_s[..., offs[me] : offs[me] + ks[me], :], r

    def q(self, right=None):
        """This rank's block of ``Q`` (m_i x k), or of ``Q @ right``."""
        return self.q_i @ (self.q_s if right is None else self.q_s @ right)


def layout_like(a, shape, cut_dim=None, m=None) -> ShardLayout:
    """Replicate, or cut along ``cut_dim`` by mesh dim ``m`` as ``a``'s rows."""
    places = [Replicate()] * len(a._layout.mesh_shape)
    sizes = [None] * len(places)
    if cut_dim is not None:
        places[m], sizes[m] = Shard(cut_dim), a._layout.sizes_arg(m)
    return ShardLayout.build(tuple(shape), a._layout.mesh_shape, places, sizes)
