"""Dense linear algebra on a matrix cut along its rows: TSQR, one all-gather of small factors.

``A`` (..., M, n) real, its row dim (-2) cut in blocks by one mesh dim (every other mesh dim
Replicate; the batch dims whole). TSQR (:func:`tsqr`)::

    A (9, 3) rows cut [4, 3, 2] over 3 ranks, k = min(M, n) = 3
      rank 0: A_0 (4, 3) = Q_0 (4, 3) R_0 (3, 3)      k_0 = min(4, 3) = 3
      rank 1: A_1 (3, 3) = Q_1 (3, 3) R_1 (3, 3)      k_1 = 3
      rank 2: A_2 (2, 3) = Q_2 (2, 2) R_2 (2, 3)      k_2 = 2   (an empty block: 0 rows)

1. each rank: ``Q_i, R_i = qr(A_i)`` (reduced), ``k_i = min(m_i, n)``, no message;
2. ONE all-gather over the cutting mesh dim of each rank's ``R_i`` (k_i x n), with, in the
   same buffer, the rows of ``Q_i`` among the first ``k`` global rows (for the signs, 4.)
   and what a rule adds (``lstsq``: ``Q_i^T B_i``, k_i x nrhs); each padded to the longest
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
   sign, this takes the other.)

Rules on it, each taken only when ``A`` is cut so (else ``NotImplemented``: the batched
rule when only batch dims are cut, or the whole-tensor fallback): ``linalg_qr`` (modes
reduced and r; complete when M <= n), ``Q`` cut like ``A``, ``R`` Replicate;
``_linalg_svd`` (not ``full_matrices`` when M > n): ``U_s, S, Vh = svd(R)``, ``U`` =
``Q @ U_s`` cut like ``A``, ``S`` and ``Vh`` Replicate (svdvals, matrix_rank, cond,
matrix_norm 'nuc' / 2 reach it); ``linalg_pinv`` (not hermitian): ``Vh^H diag(1/S) U^H``
with torch's cutoff on S, cut along its columns as ``A`` along its rows; ``linalg_lstsq``
(CPU, driver gelsy, torch's default there) with ``B`` cut like ``A``'s rows: the solution of
``lstsq(R_s, stack of Q_i^T B_i)``, the same least-squares problem (``blockdiag(Q_i)`` has
orthonormal columns), Replicate. And ``linalg_solve_triangular`` with the triangular
matrix whole and ``B`` cut along the dim it does not solve along: each rank its block, no
message (the backward of QR solves so). Every decision reads global shapes and layouts.

Messages: the one all-gather of step 2 per call (``<op>.tsqr``): per rank
``k_i n + t_i k_i (+ k_i nrhs)`` numbers, padded to the largest, times the batch.
Backward: autograd's formula for each op, on ShardTensors (products contracting the cut
dim sum by one all-reduce).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.aten import batched
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten

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
    (k_i x k), ``r`` (k x n), ``r_s`` (K x n) and ``extra``: the stacks of the added
    pieces (K x cols each), all local tensors."""

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
        mine = [r_i, q_i[..., : ts[me], :], *(q_i.mT @ e for e in extra)]
        lens = [kq * n + ts[q] * kq + kq * sum(cols) for q, kq in enumerate(ks)]
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
            shapes = [(kq, n), (ts[q], kq), *((kq, w) for w in cols)]
            at, out = 0, []
            for r, w in shapes:
                out.append(got[q][..., at : at + r * w].reshape(*batch, r, w))
                at += r * w
            parts.append(out)
        self.r_s = torch.cat([pt[0] for pt in parts], -2)
        self.extra = [torch.cat([pt[2 + j] for pt in parts], -2) for j in range(len(extra))]
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


def _layout(a, shape, cut_dim=None, m=None) -> ShardLayout:
    """Replicate, or cut along ``cut_dim`` by mesh dim ``m`` as ``a``'s rows."""
    places = [Replicate()] * len(a._layout.mesh_shape)
    sizes = [None] * len(places)
    if cut_dim is not None:
        places[m], sizes[m] = Shard(cut_dim), a._layout.sizes_arg(m)
    return ShardLayout.build(tuple(shape), a._layout.mesh_shape, places, sizes)


def _args(func, args, kwargs):
    """Every argument by its schema name, defaults filled."""
    out = {}
    for i, spec in enumerate(func._schema.arguments):
        if i < len(args):
            out[spec.name] = args[i]
        elif spec.name in kwargs:
            out[spec.name] = kwargs[spec.name]
        else:
            out[spec.name] = spec.default_value if spec.has_default_value() else None
    return out


@register(aten.linalg_qr.default)
def qr(func, args, kwargs):
    got = batched.batched(func, args, kwargs)  # only batch dims cut: each rank its own
    if got is not NotImplemented:
        return got
    a, mode = args[0], _args(func, args, kwargs)["mode"]
    m = row_cut(a)
    if m is None or mode not in ("reduced", "r", "complete"):
        return NotImplemented
    big_m, n = a.shape[-2], a.shape[-1]
    if mode == "complete" and big_m > n:
        return NotImplemented  # Q would be M x M: the fallback
    t = TSQR(a, m, "qr")
    mesh, shape_q, shape_r = a.device_mesh, meta_call(func, args, kwargs)[0].shape, t.r.shape
    r = c.wrap(t.r, mesh, _layout(a, shape_r))
    if mode == "r":
        return c.wrap(t.r.new_empty(0), mesh, _layout(a, shape_q)), r
    return c.wrap(t.q(), mesh, _layout(a, shape_q, a.ndim - 2, m)), r


@register(aten._linalg_svd.default)
def svd(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    m = row_cut(a)
    if m is None or kw["driver"] is not None:
        return NotImplemented
    big_m, n = a.shape[-2], a.shape[-1]
    full, uv = kw["full_matrices"], kw["compute_uv"]
    if uv and full and big_m > n:
        return NotImplemented  # U would be M x M: the fallback
    t = TSQR(a, m, "svd", signs=uv)  # (the signs: torch's U where it takes the QR path)
    metas = meta_call(func, args, kwargs)
    mesh = a.device_mesh
    if not uv:
        s = torch.linalg.svdvals(t.r)
        return tuple(c.wrap(v, mesh, _layout(a, o.shape)) for v, o in
                     zip((s.new_empty(0), s, s.new_empty(0)), metas))  # fmt: skip
    u_s, s, vh = torch.linalg.svd(t.r, full_matrices=full)
    return (
        c.wrap(t.q(u_s), mesh, _layout(a, metas[0].shape, a.ndim - 2, m)),
        c.wrap(s, mesh, _layout(a, metas[1].shape)),
        c.wrap(vh, mesh, _layout(a, metas[2].shape)),
    )


def _whole(t):
    """A tolerance argument's value on this rank (None; a number; a whole tensor), or
    NotImplemented for a ShardTensor cut somewhere."""
    if type(t) is c.ShardTensor:
        return t._local_tensor if t._layout.is_whole() else NotImplemented
    return t


@register(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def pinv(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    m = row_cut(a)
    atol, rtol = _whole(kw["atol"]), _whole(kw["rtol"])
    if m is None or kw["hermitian"] or NotImplemented in (atol, rtol):
        return NotImplemented
    t = TSQR(a, m, "pinv", signs=False)
    u_s, s, vh = torch.linalg.svd(t.r, full_matrices=False)
    dbl = dict(dtype=torch.float64, device=s.device)
    eps = torch.finfo(a.dtype).eps * max(a.shape[-2], a.shape[-1])  # torch's get_atol_rtol
    if rtol is None:
        rtol = torch.tensor(eps, **dbl)
        if atol is not None:
            rtol = torch.where(torch.as_tensor(atol, **dbl) > 0, 0.0, rtol)
    atol = torch.zeros((), **dbl) if atol is None else torch.as_tensor(atol, **dbl)
    rtol = torch.as_tensor(rtol, **dbl)
    tol = torch.maximum(atol.unsqueeze(-1), rtol.unsqueeze(-1) * s[..., :1])
    inv = torch.where(s > tol, s.reciprocal(), torch.zeros((), dtype=s.dtype)).to(a.dtype)
    block = (vh.mH * inv.unsqueeze(-2)) @ t.q(u_s).mH  # (n, m_i)
    shape = meta_call(func, args, kwargs).shape
    return c.wrap(block, a.device_mesh, _layout(a, shape, a.ndim - 1, m))


@register(aten.linalg_lstsq.default)
def lstsq(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    b = kw["b"]
    m = row_cut(a)
    if m is None or kw["driver"] not in (None, "gelsy") or a.device.type != "cpu":
        return NotImplemented
    if type(b) is not c.ShardTensor or b.dtype != a.dtype or b.device_mesh != a.device_mesh:
        return NotImplemented
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    if not vector and tuple(b.shape[:-2]) != tuple(a.shape[:-2]):
        return NotImplemented  # (broadcast batch dims: the fallback)
    rows = b.ndim - 1 if vector else b.ndim - 2
    if any(isinstance(p, Shard) and p.dim != rows for p in b._layout.placements):
        return NotImplemented
    want = _layout(a, b.shape, rows, m)  # B's rows cut as A's
    b = c.move(c.reduced(b, "lstsq.partial"), want, "lstsq.align")
    rhs = b._local_tensor.unsqueeze(-1) if vector else b._local_tensor
    t = TSQR(a, m, "lstsq", extra=(rhs,), signs=False)
    out = torch.linalg.lstsq(t.r_s, t.extra[0], rcond=kw["rcond"], driver=kw["driver"])
    sol = out.solution.squeeze(-1) if vector else out.solution
    outs = (sol, out.residuals, out.rank, out.singular_values)  # alike on every rank
    return tuple(c.wrap(v, a.device_mesh, _layout(a, v.shape)) for v in outs)


@register(aten.linalg_solve_triangular.default)
def solve_triangular(func, args, kwargs):
    """The triangular matrix whole on every rank, ``B`` cut only along the dim the solve
    does not run along (its columns when ``left``, else its rows): each rank its block."""
    got = batched.batched(func, args, kwargs)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    a, b = kw["self"], kw["B"]
    if type(b) is not c.ShardTensor or b.ndim < 2 or a.ndim < 2 or len(args) != 2:
        return NotImplemented
    if type(a) is c.ShardTensor and (
        a.device_mesh != b.device_mesh
        or not all(isinstance(p, Replicate) for p in a._layout.placements)
    ):
        return NotImplemented  # the triangular matrix cut (or Partial): the fallback
    if a.ndim > 2 and tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return NotImplemented
    free = b.ndim - 1 if kw["left"] else b.ndim - 2
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == free)
               for p in b._layout.placements):  # fmt: skip
        return NotImplemented
    return Plan(b.device_mesh, b._layout, None, "solve_triangular.local")
