"""LU, Cholesky and triangular solves of a matrix cut along its rows: no rank holds it whole.

``A`` (..., M, n) real, its rows (dim -2) cut in blocks by one mesh dim of P ranks (every
other mesh dim Replicate, the batch dims whole: :func:`.tsqr.row_cut`)::

    A (5, 5) rows cut [2, 0, 3]       rank 0: rows 0-1   rank 1: none   rank 2: rows 2-4

:func:`lu`, LAPACK's ``getrf`` (``P A = L U``, partial pivoting, LAPACK's pivots), for each
column j < k = min(M, n):

1. each rank: its largest ``|A[i, j]|`` among its rows i >= j (the first on a tie) and
   that row's global index; ONE all-gather of those (value, index) pairs: every rank picks
   the same pivot row p, the first largest (LAPACK's ``idamax``);
2. ONE all-reduce of (row p, row j), each filled by its owner (zeros elsewhere): every rank
   has the pivot row; the owner of row j writes row p there, the owner of p row j (the
   swap);
3. each rank, its rows i > j: ``l_i = A[i, j] / A[p, j]``, ``A[i, j+1:] -= l_i A[p, j+1:]``,
   no message.

:func:`cholesky`, LAPACK's ``potrf``, for each column j: the owner of row j puts its row
in ONE all-reduce (lower: ``L[j, :j]`` and ``A[j, j] - |L[j, :j]|^2``, read from A's lower
triangle; upper: row j of the updated upper triangle, right-looking); each rank computes
its own rows' entries of column j (lower) or updates its rows (upper), no message.

:func:`solve`, ``T X = B`` with T (n, n) triangular and B (n, k) cut alike: the ranks in
order (upper: reverse order); rank q solves its diagonal block for ``X_q`` with what the
earlier ranks sent, then sends ``X_q`` to each later rank that has rows (point-to-point).

Messages, per matrix of a batch: LU ``k`` all-gathers of 2 numbers and ``k`` all-reduces of
2n numbers; Cholesky n all-reduces of n numbers; a solve, each rank's rows of X to each rank
that needs them (at most X's size received per rank). The bytes are those of the whole
matrix, in rows, as for any LU on rows (each row of U is needed by every rank below it);
what no rank ever holds is the matrix: one row more than its own rows. The rules on these:
:mod:`.lu`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlab.comm import collectives, p2p
from shardlab.engine import _common as c
from shardlab.trace import label


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., r, k) as (B, r, k), B the batch's size (empty blocks too)."""
    return t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])


class Rows:
    """Where the rows of a matrix cut along mesh dim ``m`` in ``sizes`` live."""

    def __init__(self, mesh, m: int, sizes):
        self.mesh, self.m, self.sizes = mesh, m, list(sizes)
        self.p, self.coord = mesh.shape[m], c.me(mesh)
        self.me = self.coord[m]
        self.starts = [sum(self.sizes[:q]) for q in range(self.p)]
        self.lo = self.starts[self.me]
        self.hi = self.lo + self.sizes[self.me]
        self.group = mesh.get_group(m)

    def peer(self, q: int) -> int:
        return p2p.rank_at(self.mesh, tuple(q if a == self.m else b for a, b in
                                            enumerate(self.coord)))  # fmt: skip


def lu(a: torch.Tensor, rows: Rows, name: str):
    """Steps 1-3 on this rank's block ``a`` (..., m_i, n): ``(LU block, pivots (..., k)
    int32 from 1, info (...) int32)``, pivots and info alike on every rank."""
    batch, (mi, n) = a.shape[:-2], a.shape[-2:]
    big_m = sum(rows.sizes)
    k = min(big_m, n)
    f = flat(a).clone()  # (B, m_i, n)
    nb = f.shape[0]
    g = torch.arange(rows.lo, rows.hi)  # (m_i,) the global index of each row
    piv = torch.empty(nb, k, dtype=torch.int32)
    info = torch.zeros(nb, dtype=torch.int32)
    every = torch.arange(nb)
    for j in range(k):
        col = torch.where(g >= j, f[:, :, j].abs(), -1.0)  # 1. (B, m_i)
        if mi:
            val, at = col.amax(-1), col.argmax(-1)
            pair = torch.stack([val.double(), g[at].double()], -1)
        else:
            pair = torch.tensor([-1.0, 0.0], dtype=torch.float64).expand(nb, 2)
        pairs = [torch.empty(nb, 2, dtype=torch.float64) for _ in range(rows.p)]
        with label(f"{name}.pivot"):
            collectives.all_gather(pairs, pair.contiguous(), rows.group)
        both = torch.stack(pairs)  # (P, B, 2)
        p = both[both[:, :, 0].argmax(0), every, 1].long()  # (B,) the first largest
        buf = f.new_zeros(nb, 2, n)  # 2.
        mine_p = (p >= rows.lo) & (p < rows.hi)
        buf[mine_p, 0] = f[mine_p, p[mine_p] - rows.lo]
        own_j = rows.lo <= j < rows.hi
        if own_j:
            buf[:, 1] = f[:, j - rows.lo]
        with label(f"{name}.rows"):
            collectives.all_reduce_(buf, group=rows.group)
        top, old = buf[:, 0], buf[:, 1]  # (B, n): the pivot row, row j
        f[mine_p, p[mine_p] - rows.lo] = old[mine_p]
        if own_j:
            f[:, j - rows.lo] = top
        piv[:, j] = (p + 1).to(torch.int32)
        d = top[:, j]  # (B,)
        info = torch.where((d == 0) & (info == 0), j + 1, info).to(torch.int32)
        below = g > j  # 3.
        if bool(below.any()):
            lj = f[:, below, j]
            lj = torch.where(d[:, None] != 0, lj / torch.where(d == 0, 1.0, d)[:, None], lj)
            f[:, below, j] = lj
            f[:, below, j + 1 :] -= lj[..., None] * top[:, None, j + 1 :]
    return f.reshape(a.shape), piv.reshape(*batch, k), info.reshape(batch)


def cholesky(a: torch.Tensor, rows: Rows, upper: bool, name: str):
    """This rank's rows of ``L`` (lower, from A's lower triangle) or ``U`` (upper, from its
    upper triangle), and info (...) int32 (the first column whose pivot is not positive,
    from 1; 0: positive definite), alike on every rank."""
    batch, n = a.shape[:-2], a.shape[-1]
    f = flat(a)
    nb = f.shape[0]
    out = torch.zeros_like(f)  # (B, m_i, n)
    s = f.clone() if upper else None  # (upper: the updated trailing rows)
    g = torch.arange(rows.lo, rows.hi)
    info = torch.zeros(nb, dtype=torch.int32)
    for j in range(n):
        own = rows.lo <= j < rows.hi
        buf = f.new_zeros(nb, n)
        if own:
            r = j - rows.lo
            if upper:
                buf[:, j:] = s[:, r, j:]
            else:
                buf[:, :j] = out[:, r, :j]
                buf[:, j] = f[:, r, j] - out[:, r, :j].square().sum(-1)
        with label(f"{name}.rows"):
            collectives.all_reduce_(buf, group=rows.group)
        piv = buf[:, j]
        bad = ~(piv > 0)
        info = torch.where(bad & (info == 0), j + 1, info).to(torch.int32)
        d = piv.clamp_min(0).sqrt()
        safe = torch.where(d == 0, 1.0, d)
        if upper:
            u = buf[:, j:] / safe[:, None]  # (B, n - j): U[j, j:]
            if own:
                out[:, j - rows.lo, j:] = u
            below = g > j  # U[j, i] for each of my rows i > j
            if bool(below.any()):
                uji = u[:, g[below] - j]  # (B, r)
                s[:, below, j + 1 :] -= uji[..., None] * u[:, None, 1:]
        else:
            if own:
                out[:, j - rows.lo, j] = d
            below = g > j
            if bool(below.any()):
                dot = (out[:, below, :j] * buf[:, None, :j]).sum(-1)
                out[:, below, j] = (f[:, below, j] - dot) / safe[:, None]
    return out.reshape(a.shape), info.reshape(batch)


def solve(t: torch.Tensor, b: torch.Tensor, rows: Rows, upper: bool, unit: bool, name: str):
    """This rank's rows of ``X`` in ``T X = B``: ``t`` (..., m_i, n) this rank's rows of the
    triangular T, ``b`` (..., m_i, k) its rows of B; batch dims alike."""
    order = range(rows.p - 1, -1, -1) if upper else range(rows.p)
    known = []  # (start, X block) from the ranks solved before, that this rank needs
    x = None
    for q in order:
        if not rows.sizes[q]:
            continue
        if q == rows.me:
            rhs = b
            for start, xq in known:  # (..., m_i, k) minus T's block of q's columns @ X_q
                rhs = rhs - t[..., :, start : start + xq.shape[-2]] @ xq
            diag = t[..., :, rows.lo : rows.hi]
            x = torch.linalg.solve_triangular(diag, rhs, upper=upper, unitriangular=unit)
        later = [r for r in order if rows.sizes[r] and (r < q if upper else r > q)]
        ops = []
        if q == rows.me:
            ops = [dist.P2POp(dist.isend, x.contiguous(), rows.peer(r)) for r in later]
        elif rows.me in later:
            xq = b.new_empty(*b.shape[:-2], rows.sizes[q], b.shape[-1])
            known.append((rows.starts[q], xq))
            ops = [dist.P2POp(dist.irecv, xq, rows.peer(q))]
        if ops:
            with label(f"{name}.solve"):
                p2p.run_p2p(ops)
    return b.new_empty(b.shape) if x is None else x
