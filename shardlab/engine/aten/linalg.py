"""Dense linear algebra on a matrix cut along its rows (or its columns): on :mod:`.tsqr`.

Each rule is taken only when ``A`` is cut so (else ``NotImplemented``: the batched rule when
only batch dims are cut, or the whole-tensor fallback, which gathers and says so):

- ``linalg_qr`` (modes reduced and r; complete when M <= n): ``Q`` cut like ``A``, ``R``
  Replicate, torch's signs (:mod:`.tsqr`, step 4);
- ``_linalg_svd`` (not ``full_matrices`` when M > n): ``U_s, S, Vh = svd(R)``, ``U = Q U_s``
  cut like ``A``, ``S`` and ``Vh`` Replicate (svdvals, matrix_rank, cond, matrix_norm 'nuc'
  and 2 reach it). The singular values are those of ``R``; the singular vectors are unique
  up to the sign of each pair, and torch says they differ across devices. With R's signs
  LAPACK's, they were torch's wherever its gesdd first QRs the matrix (every M > n tried, at
  torch 2.13 on CPU); a square matrix's may differ by those signs (no test relies on it);
- ``linalg_pinv`` (not hermitian): ``Vh^H diag(1/S) U^H``, torch's cutoff on S, cut along
  its columns as ``A`` along its rows;
- ``linalg_lstsq`` (CPU, each driver), ``B`` moved to ``A``'s rows if cut otherwise (a
  plain ``B``: each rank its rows, no message):
  ``lstsq(R_s, stack of Q_i^T B_i)`` with the same driver and rcond, the same least-squares
  problem (``blockdiag(Q_i)`` has orthonormal columns: the same minimum-norm solution and
  rank), Replicate. Residuals where torch gives them (M > n, not gelsy, full rank):
  ``|R_s x - C_s|^2`` plus the part of ``B`` outside ``Q``'s columns, summed in the same
  all-gather;
- ``A`` cut along its columns, for svd and pinv: ``A^T`` is cut along its rows (each block
  transposed, no message), ``svd(A) = svd(A^T)^T``: ``U`` Replicate, ``Vh`` cut along its
  columns; ``pinv(A) = pinv(A^T)^T`` cut along its rows;
- ``linalg_solve_triangular`` with the triangular matrix whole and ``B`` cut along the dim
  it does not solve along (its columns when ``left``, else its rows): each rank its block,
  no message (the backward of ``qr`` solves so).

Every decision reads global shapes and layouts. Messages: the one all-gather of TSQR per
call (``lstsq``: and ``B``'s move, when cut otherwise). Backward: autograd's formula for each
op, on ShardTensors (products contracting the cut dim sum by one all-reduce), no whole-tensor
gather. Not communication-avoiding there: torch's ``pinv_backward`` (pinv's, and lstsq's
for ``A``) forms M x M products, whose ``mm`` moves factors as large as ``A``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.aten import batched
from shardlab.engine.aten.tsqr import TSQR, row_cut, to_rows, transposed
from shardlab.engine.aten.tsqr import layout_like as _layout
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan

aten = torch.ops.aten


_args = c.schema_args


@register(aten.linalg_qr.default)
def qr(func, args, kwargs):
    got = batched.batched(func, args, kwargs)  # only batch dims cut: each rank its own
    if got is not NotImplemented:
        return got
    a, mode = args[0], _args(func, args, kwargs)["mode"]
    if mode not in ("reduced", "r", "complete") or a.ndim < 2:
        return NotImplemented
    if mode == "complete" and a.shape[-2] > a.shape[-1]:
        return NotImplemented  # Q would be M x M: the fallback
    got = to_rows(a, "qr.to_rows")  # (cut along its columns: moved to its rows)
    if got is None:
        return NotImplemented
    a, m = got
    t = TSQR(a, m, "qr")
    mesh, shape_q, shape_r = a.device_mesh, meta_call(func, args, kwargs)[0].shape, t.r.shape
    r = c.wrap(t.r, mesh, _layout(a, shape_r))
    if mode == "r":
        return c.wrap(t.r.new_empty(0), mesh, _layout(a, shape_q)), r
    return c.wrap(t.q(), mesh, _layout(a, shape_q, a.ndim - 2, m)), r


def _oriented(a):
    """``(A, its mesh dim, False)`` for ``A`` cut along its rows; ``(A^T, mesh dim, True)``
    for ``A`` cut along its columns (each block transposed, no message); else None."""
    m = row_cut(a)
    if m is not None:
        return a, m, False
    if type(a) is not c.ShardTensor or a.ndim < 2 or not a._layout.is_block():
        return None
    at = transposed(a)
    m = row_cut(at)
    return None if m is None else (at, m, True)


@register(aten._linalg_svd.default)
def svd(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    got = _oriented(a)
    if got is None or kw["driver"] is not None:
        return NotImplemented
    rows, m, flip = got
    full, uv = kw["full_matrices"], kw["compute_uv"]
    if uv and full and rows.shape[-2] > rows.shape[-1]:
        return NotImplemented  # U (or Vh) would be M x M: the fallback
    t = TSQR(rows, m, "svd", signs=uv)  # (the signs: torch's U where it takes the QR path)
    metas = meta_call(func, args, kwargs)
    mesh = a.device_mesh
    if not uv:
        s = torch.linalg.svdvals(t.r)
        return tuple(c.wrap(v, mesh, _layout(a, o.shape)) for v, o in
                     zip((s.new_empty(0), s, s.new_empty(0)), metas))  # fmt: skip
    u_s, s, vh = torch.linalg.svd(t.r, full_matrices=full)
    if flip:  # A^T = U' S Vh': A = Vh'^T S U'^T
        u = c.wrap(vh.mT, mesh, _layout(a, metas[0].shape))
        vh = c.wrap(t.q(u_s).mT, mesh, _layout(a, metas[2].shape, a.ndim - 1, m))
    else:
        u = c.wrap(t.q(u_s), mesh, _layout(a, metas[0].shape, a.ndim - 2, m))
        vh = c.wrap(vh, mesh, _layout(a, metas[2].shape))
    return u, c.wrap(s, mesh, _layout(a, metas[1].shape)), vh


def _whole(t):
    """A tolerance argument's value on this rank (None; a number; a whole tensor), or
    NotImplemented for a ShardTensor cut somewhere."""
    if type(t) is c.ShardTensor:
        return t._local_tensor if t._layout.is_whole() else NotImplemented
    return t


@register(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def pinv(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    got = _oriented(a)
    atol, rtol = _whole(kw["atol"]), _whole(kw["rtol"])
    if got is None or kw["hermitian"] or NotImplemented in (atol, rtol):
        return NotImplemented
    rows, m, flip = got
    t = TSQR(rows, m, "pinv", signs=False)
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
    block = (vh.mH * inv.unsqueeze(-2)) @ t.q(u_s).mH  # (n, m_i) of pinv(rows)
    shape = meta_call(func, args, kwargs).shape
    if flip:  # pinv(A) = pinv(A^T)^T, cut along its rows as A along its columns
        return c.wrap(block.mT, a.device_mesh, _layout(a, shape, a.ndim - 2, m))
    return c.wrap(block, a.device_mesh, _layout(a, shape, a.ndim - 1, m))


_DRIVERS = (None, "gelsy", "gels", "gelsd", "gelss")  # torch's CPU drivers


@register(aten.linalg_lstsq.default)
def lstsq(func, args, kwargs):
    a, kw = args[0], _args(func, args, kwargs)
    b = kw["b"]
    if kw["driver"] not in _DRIVERS or a.device.type != "cpu":
        return NotImplemented
    if type(a) is not c.ShardTensor or not isinstance(b, torch.Tensor) or b.dtype != a.dtype:
        return NotImplemented
    plain = type(b) is not c.ShardTensor  # (a plain B, whole on every rank: its rows sliced)
    if not plain and b.device_mesh != a.device_mesh:
        return NotImplemented
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    if not vector and tuple(b.shape[:-2]) != tuple(a.shape[:-2]):
        return NotImplemented  # (broadcast batch dims: the fallback)
    rows = b.ndim - 1 if vector else b.ndim - 2
    if not plain and any(isinstance(p, Shard) and p.dim != rows for p in b._layout.placements):
        return NotImplemented
    got = to_rows(a, "lstsq.to_rows")  # (cut along its columns: moved to its rows)
    if got is None:
        return NotImplemented
    a, m = got
    want = _layout(a, b.shape, rows, m)  # B's rows cut as A's
    block = c.block_in(b, a.device_mesh, want, "lstsq.align", partial="lstsq.partial")
    rhs = block.unsqueeze(-1) if vector else block
    t = TSQR(a, m, "lstsq", extra=(rhs,), signs=False)
    out = torch.linalg.lstsq(t.r_s, t.extra[0], rcond=kw["rcond"], driver=kw["driver"])
    sol, res = out.solution, out.residuals
    big_m, n = a.shape[-2], a.shape[-1]
    if big_m > n and kw["driver"] not in (None, "gelsy"):  # torch's residuals: when full rank
        if kw["driver"] == "gels" or bool((out.rank == n).all()):  # (alike on every rank)
            res = (t.r_s @ sol - t.extra[0]).square().sum(-2) + t.rest[0]
        else:
            res = res.new_empty(0)
    if vector:
        sol = sol.squeeze(-1)  # (the residuals keep their one column, as torch's)
    outs = (sol, res, out.rank, out.singular_values)  # alike on every rank
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
