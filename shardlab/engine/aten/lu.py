"""LU, Cholesky, determinants, inverses and solves of a matrix cut along a matrix dim: on
:mod:`.rowlu`, no rank holding the matrix.

Which cut the algorithms run on, read from global layouts only:

- ``A`` cut along its rows (dim -2) by one mesh dim: as it is;
- ``A`` cut along its columns: its transpose's rows are that cut (each block transposed,
  no message), moved to the rows by ONE all-to-all (``<op>.to_rows``);
- ``A`` whole (plain, or Replicate) and ``B`` cut along its rows: ``A``'s rows sliced
  to ``B``'s, no message; ``B`` cut only along its columns (``A`` whole): each rank solves
  its own columns, no message.

Then (``k = min(M, n)``; pivots and info Replicate, every matrix result cut along its rows
as the run's cut):

- ``linalg_lu_factor_ex`` / ``linalg_lu`` / ``lu_unpack``: :func:`.rowlu.lu`; ``P`` (M, M)
  cut along its rows, ``L`` (M, k) and ``U`` (k, n) as the LU's rows (``U``: the first k);
- ``_linalg_det`` / ``_linalg_slogdet``: the product (sum of logs) of the diagonal's pieces,
  ONE all-gather of one number (two) per rank, and the pivots' sign;
- ``linalg_lu_solve`` / ``_linalg_solve_ex`` / ``linalg_inv_ex``: ``B``'s rows permuted as
  the pivots say (plain ``B``: sliced, no message; cut ``B``: each row to its new owner),
  then two triangular solves (:func:`.rowlu.solve`); ``adjoint`` (or ``left=False``) on
  the LU's transpose moved to the rows (ONE all-to-all); ``inv`` solves the identity's rows
  (built on each rank, no message);
- ``linalg_cholesky_ex`` / ``cholesky``: :func:`.rowlu.cholesky`; ``cholesky_solve`` /
  ``cholesky_inverse``: two triangular solves with ``L`` and ``L^T``;
- ``linalg_solve_triangular`` / ``triangular_solve`` with the triangular matrix cut.

Real float32/64 only, batch dims whole. A matrix that is not positive definite
(``cholesky``'s info) or an ``_ex`` call with ``check_errors``: the fallback (torch's own
error, every rank). Backward: autograd's formulas on these rules (``lu_solve`` with
``adjoint``, triangular solves of the factors' transposes), no whole-tensor gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardlab.comm import collectives, p2p
from shardlab.engine import _common as c
from shardlab.engine.aten import batched, fallback, linalg, rowlu
from shardlab.engine.aten.tsqr import row_cut, to_rows, transposed
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout
from shardlab.trace import label

aten = torch.ops.aten
_args = c.schema_args
_REAL = (torch.float32, torch.float64)


def _rows_layout(shape, mesh, m, sizes) -> ShardLayout:
    places = [Replicate()] * mesh.ndim
    entry = [None] * mesh.ndim
    places[m], entry[m] = Shard(len(shape) - 2), list(sizes)
    return ShardLayout.build(tuple(shape), tuple(mesh.shape), places, entry)


def _whole(t) -> bool:
    return not isinstance(t, torch.Tensor) or type(t) is not c.ShardTensor or t._layout.is_whole()


def _real(*ts) -> bool:
    return all(not isinstance(t, torch.Tensor) or t.dtype in _REAL for t in ts)


def _to_rows(a, name: str):
    """``(rows, A's rows here)`` for ``A`` cut along its rows, or along its columns (moved
    to its rows: one all-to-all, :func:`.tsqr.to_rows`), else None."""
    got = to_rows(a, f"{name}.to_rows")
    if got is None:
        return None
    a, m = got
    return rowlu.Rows(a.device_mesh, m, a._layout.shard_sizes(m)), a._local_tensor


def _rows_of(b, rows: rowlu.Rows, name: str):
    """This rank's rows of ``b`` (..., M, k) under ``rows``'s cut (a whole ``b`` sliced)."""
    if _whole(b):
        return c.local(b)[..., rows.lo : rows.hi, :]
    lay = _rows_layout(b.shape, rows.mesh, rows.m, rows.sizes)
    return c.move(c.reduced(b, f"{name}.partial"), lay, f"{name}.align")._local_tensor


def _perm(piv: torch.Tensor, big_m: int) -> torch.Tensor:
    """LAPACK's row swaps ``piv`` (..., k) as the permutation (nb, M): the LU is of
    ``A[perm]``."""
    piv = piv.reshape(-1, piv.shape[-1]).long() - 1
    nb = piv.shape[0]
    perm = torch.arange(big_m).repeat(nb, 1)
    every = torch.arange(nb)
    for j in range(piv.shape[-1]):
        a, b = perm[:, j].clone(), perm[every, piv[:, j]].clone()
        perm[:, j], perm[every, piv[:, j]] = b, a
    return perm


def _permuted(b, perm, rows: rowlu.Rows, name: str) -> torch.Tensor:
    """This rank's rows of ``B[perm]`` (rows of each batch matrix), from this rank's rows
    ``b`` (nb, m_i, k): each row to its new owner, one point-to-point exchange."""
    owner = torch.bucketize(perm, torch.tensor(rows.starts[1:] + [sum(rows.sizes)]), right=True)
    out = b.new_empty(b.shape)
    mine = slice(rows.lo, rows.hi)
    ops, recvs = [], []
    for q in range(rows.p):
        lo, hi = rows.starts[q], rows.starts[q] + rows.sizes[q]
        want = owner[:, lo:hi] == rows.me  # rows q needs from me: (nb, m_q)
        if q == rows.me:
            bi, ii = want.nonzero(as_tuple=True)
            out[bi, ii] = b[bi, perm[:, mine][bi, ii] - rows.lo]
            continue
        bi, ii = want.nonzero(as_tuple=True)
        if bi.numel():
            ops.append(dist.P2POp(dist.isend, b[bi, perm[:, lo:hi][bi, ii] - rows.lo].contiguous(),
                                  rows.peer(q)))  # fmt: skip
        gi, gj = (owner[:, mine] == q).nonzero(as_tuple=True)
        if gi.numel():
            buf = b.new_empty(gi.numel(), b.shape[-1])
            ops.append(dist.P2POp(dist.irecv, buf, rows.peer(q)))
            recvs.append((gi, gj, buf))
    if ops:
        with label(f"{name}.permute"):
            p2p.run_p2p(ops)
    for gi, gj, buf in recvs:
        out[gi, gj] = buf
    return out


def _lu_solve(rows, lu, piv, b, adjoint: bool, name: str, b_whole=None) -> torch.Tensor:
    """This rank's rows of ``X`` in ``A X = B`` (``A^T X = B`` when adjoint), A = P L U
    given by this rank's rows ``lu`` (..., m_i, n) and the pivots; ``b`` this rank's rows
    of B, or ``b_whole`` all of it."""
    batch, big_m = lu.shape[:-2], sum(rows.sizes)
    perm = _perm(piv, big_m)
    k = (b if b is not None else b_whole).shape[-1]
    if not adjoint:
        if b_whole is not None:  # 1. B[perm], this rank's rows (no message)
            bw = rowlu.flat(b_whole.expand(*batch, big_m, k))
            rhs = bw[torch.arange(bw.shape[0])[:, None], perm[:, rows.lo : rows.hi]]
        else:
            rhs = _permuted(rowlu.flat(b), perm, rows, name)
        rhs = rhs.reshape(*batch, -1, k)
        y = rowlu.solve(lu, rhs, rows, upper=False, unit=True, name=name)  # 2. L y = B[perm]
        return rowlu.solve(lu, y, rows, upper=True, unit=False, name=name)  # 3. U x = y
    if b is None:
        b = b_whole.expand(*batch, big_m, k)[..., rows.lo : rows.hi, :]
    lay = _rows_layout(lu.shape[:-2] + (big_m, big_m), rows.mesh, rows.m, rows.sizes)
    lt = c.move(transposed(c.wrap(lu, rows.mesh, lay)), lay, f"{name}.transpose")._local_tensor
    z = rowlu.solve(lt, b, rows, upper=False, unit=False, name=name)  # U^T z = B
    w = rowlu.solve(lt, z, rows, upper=True, unit=True, name=name)  # L^T w = z
    inv = torch.argsort(perm, -1)  # X = w[perm^-1]
    out = _permuted(rowlu.flat(w), inv, rows, name)
    return out.reshape(w.shape)


def _factor(a, name):
    """``(rows, LU rows, pivots, info)`` of ``A`` cut along a matrix dim, else None."""
    got = _to_rows(a, name)
    if got is None:
        return None
    rows, local = got
    return (rows, *rowlu.lu(local, rows, name))


def _cut(t, rows, shape=None):
    shape = tuple(t.shape[:-2]) + (sum(rows.sizes), t.shape[-1]) if shape is None else shape
    return c.wrap(t, rows.mesh, _rows_layout(shape, rows.mesh, rows.m, rows.sizes))


def _declined(func, args, kwargs) -> bool:
    """The calls left to the fallback: ``check_errors`` (torch's error on every rank),
    LU without pivoting, half precision."""
    return batched._checks_errors(func, args, kwargs) or batched._refused(func, args, kwargs)


def _batched(func, args, kwargs):
    """Only batch dims cut: each rank its own matrices (:mod:`.batched`)."""
    return batched.batched(func, args, kwargs) if func in batched.CORES else NotImplemented


@register(aten.linalg_lu_factor_ex.default)
def lu_factor_ex(func, args, kwargs):
    if _declined(func, args, kwargs):
        return NotImplemented
    got = _batched(func, args, kwargs)
    f = None if got is not NotImplemented else _factor(args[0], "lu_factor")
    if f is None:
        return got
    rows, lu, piv, info = f
    return _cut(lu, rows), c.as_shard(piv, rows.mesh), c.as_shard(info, rows.mesh)


def _unpacked(rows, lu, piv, shape, with_p=True, with_lu=True):
    """``(P, L, U)`` of the LU's rows: P (M, M), L (M, k), U (k, n), each cut along its
    rows (U: the first k rows), each rank from its own rows and the pivots."""
    big_m, n = shape[-2:]
    k, batch, mesh = min(big_m, n), tuple(shape[:-2]), rows.mesh
    empty = lu.new_empty(0)
    if with_p:
        perm = _perm(piv, big_m).reshape(*batch, big_m)  # A = P L U: P[perm[i], i] = 1
        inv = torch.argsort(perm, -1)[..., rows.lo : rows.hi]  # (..., m_i)
        p = torch.nn.functional.one_hot(inv, big_m).to(lu.dtype)
        p = _cut(p, rows, (*batch, big_m, big_m))
    else:
        p = c.wrap(empty, mesh, c.replicate_layout((0,), mesh))
    if not with_lu:
        z = c.wrap(empty, mesh, c.replicate_layout((0,), mesh))
        return p, z, z
    g = torch.arange(rows.lo, rows.hi)[:, None]
    cols = torch.arange(k)[None, :]
    low = lu[..., :, :k]
    l_ = torch.where(g > cols, low, torch.where(g == cols, 1.0, 0.0).to(lu.dtype))
    ucut = [max(0, min(k - s, z)) for s, z in zip(rows.starts, rows.sizes)]
    u = lu[..., : ucut[rows.me], :].triu(rows.lo)
    ulay = _rows_layout((*batch, k, n), mesh, rows.m, ucut)
    return p, _cut(l_, rows, (*batch, big_m, k)), c.wrap(u, mesh, ulay)


@register(aten.linalg_lu.default)
def lu_full(func, args, kwargs):
    if _declined(func, args, kwargs):
        return NotImplemented
    got = _batched(func, args, kwargs)
    f = None if got is not NotImplemented else _factor(args[0], "lu")
    if f is None:
        return got
    rows, lu, piv, _ = f
    return _unpacked(rows, lu, piv, args[0].shape)


@register(aten.lu_unpack.default)
def lu_unpack(func, args, kwargs):
    kw = _args(func, args, kwargs)
    lu, piv = kw["LU_data"], kw["LU_pivots"]
    if not _whole(piv) or not kw["unpack_pivots"] and not kw["unpack_data"]:
        return NotImplemented
    if lu.ndim < 2 or piv.shape[-1] != min(lu.shape[-2:]):
        return NotImplemented
    got = _to_rows(lu, "lu_unpack")
    if got is None:
        return NotImplemented
    rows, local = got
    return _unpacked(rows, local, c.local(piv), lu.shape, kw["unpack_pivots"], kw["unpack_data"])


def _diag(rows, lu):
    """This rank's diagonal entries of U (nb, its count)."""
    n = lu.shape[-1]
    idx = torch.arange(rows.lo, min(rows.hi, n))
    return rowlu.flat(lu)[:, idx - rows.lo, idx]


def _gathered(t, rows, name):
    """ONE all-gather of ``t`` (nb, w) over the rows' mesh dim: (P, nb, w)."""
    got = [torch.empty_like(t) for _ in range(rows.p)]
    with label(name):
        collectives.all_gather(got, t.contiguous(), rows.group)
    return torch.stack(got)


def _perm_sign(piv) -> torch.Tensor:
    k = piv.shape[-1]
    swaps = (piv.long() != torch.arange(1, k + 1)).sum(-1)
    return 1.0 - 2.0 * (swaps % 2)


def _det_source(a):
    """The matrix whose LU torch's ``_linalg_det`` / ``_linalg_slogdet`` return (their
    backward solves with it): ``A^T`` where ``A`` is C-contiguous (its memory is
    ``A^T`` in LAPACK's column order; the same determinant), else ``A``. Read from the
    global strides, alike on every rank."""
    want = [1] * a.ndim
    for d in range(a.ndim - 2, -1, -1):
        want[d] = want[d + 1] * a.shape[d + 1]
    contiguous = all(n == 1 or s == w for n, s, w in zip(a.shape, a.stride(), want))
    return transposed(a) if contiguous else a


def _det_factors(func, args, kwargs, name):
    """The batched rule's answer, or ``(rows, LU rows, pivots, the diagonal's signs and
    log-magnitudes summed over ranks (nb, 2))``: ONE all-gather of two numbers per rank
    and matrix; or NotImplemented."""
    got = _batched(func, args, kwargs)
    a = args[0]
    if got is not NotImplemented or a.shape[-1] != a.shape[-2]:
        return got
    f = _factor(_det_source(a), name)
    if f is None:
        return NotImplemented
    rows, lu, piv, _ = f
    dg = _diag(rows, lu)
    part = torch.stack([dg.sign().prod(-1), dg.abs().log().sum(-1)], -1)  # (nb, 2)
    both = _gathered(part, rows, f"{name}.diagonal")
    sign = both[..., 0].prod(0) * _perm_sign(piv).reshape(-1).to(lu.dtype)
    return rows, lu, piv, sign, both[..., 1].sum(0)


@register(aten._linalg_det.default)
def det(func, args, kwargs):
    got = _det_factors(func, args, kwargs, "det")
    if not isinstance(got, tuple):
        return got
    rows, lu, piv, sign, logabs = got
    d = (sign * logabs.exp()).reshape(args[0].shape[:-2])
    return c.as_shard(d, rows.mesh), _cut(lu, rows), c.as_shard(piv, rows.mesh)


@register(aten._linalg_slogdet.default)
def slogdet(func, args, kwargs):
    got = _det_factors(func, args, kwargs, "slogdet")
    if not isinstance(got, tuple):
        return got
    rows, lu, piv, sign, logabs = got
    shape = args[0].shape[:-2]
    mesh = rows.mesh
    return (c.as_shard(sign.reshape(shape), mesh), c.as_shard(logabs.reshape(shape), mesh),
            _cut(lu, rows), c.as_shard(piv, mesh))  # fmt: skip


def _local_columns(mesh, b, outs):
    """B cut only along its columns and every other argument whole: each rank solves its
    own columns (a Plan: the op on the blocks, no message). ``outs``: the results'
    shapes, the first like B."""
    if type(b) is not c.ShardTensor or b.ndim < 2:
        return NotImplemented
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == b.ndim - 1)
               for p in b._layout.placements):  # fmt: skip
        return NotImplemented
    lays = (b._layout, *(c.replicate_layout(s, mesh) for s in outs[1:]))
    return Plan(mesh, lays if len(outs) > 1 else lays[0], None, "solve.local")


@register(aten.linalg_lu_solve.default)
def lu_solve(func, args, kwargs):
    got = _batched(func, args, kwargs)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    lu, piv, b, left, adjoint = kw["LU"], kw["pivots"], kw["B"], kw["left"], kw["adjoint"]
    if (
        not _whole(piv)
        or not _real(lu, b)
        or b.ndim < 2
        or tuple(b.shape[:-2]) != tuple(lu.shape[:-2])
    ):
        return NotImplemented
    if not left:  # X A = B: A^T X^T = B^T
        return torch.linalg.lu_solve(lu, piv, b.mT, left=True, adjoint=not adjoint).mT
    return _solve_lu(lu, c.local(piv), b, adjoint, "lu_solve")


def _solve_lu(lu, piv, b, adjoint, name):
    if _whole(lu):
        if type(b) is not c.ShardTensor:
            return NotImplemented
        if row_cut(b) is None:
            return _local_columns(b.device_mesh, b, [b.shape])
        m = row_cut(b)
        rows = rowlu.Rows(b.device_mesh, m, b._layout.shard_sizes(m))
        mine = c.local(lu)[..., rows.lo : rows.hi, :]
    else:
        got = _to_rows(lu, name)
        if got is None:
            return NotImplemented
        rows, mine = got
    if _whole(b):
        x = _lu_solve(rows, mine, piv, None, adjoint, name, b_whole=c.local(b))
    else:
        x = _lu_solve(rows, mine, piv, _rows_of(b, rows, name), adjoint, name)
    return _cut(x, rows)


def _vector(a, b) -> bool:
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))


@register(aten._linalg_solve_ex.default)
def solve_ex(func, args, kwargs):
    if _declined(func, args, kwargs):
        return NotImplemented
    got = _batched(func, args, kwargs)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    a, b, left = kw["A"], kw["B"], kw["left"]
    if not isinstance(b, torch.Tensor) or not _real(a, b) or _whole(a):
        return NotImplemented  # (A whole, B cut: the fallback)
    vec = _vector(a, b)
    bm = b.unsqueeze(-1) if vec else b
    if tuple(bm.shape[:-2]) != tuple(a.shape[:-2]) or a.shape[-1] != a.shape[-2]:
        return NotImplemented
    f = _factor(a, "solve")
    if f is None:
        return NotImplemented
    rows, lu, piv, info = f
    rhs = bm if left else bm.mT  # X A = B: A^T X^T = B^T
    if _whole(rhs):
        x = _lu_solve(rows, lu, piv, None, not left, "solve", b_whole=c.local(rhs))
    else:
        x = _lu_solve(rows, lu, piv, _rows_of(rhs, rows, "solve"), not left, "solve")
    x = _cut(x, rows)
    x = x if left else x.mT
    x = x.squeeze(-1) if vec else x
    return x, _cut(lu, rows), c.as_shard(piv, rows.mesh), c.as_shard(info, rows.mesh)


@register(aten.linalg_inv_ex.default)
def inv_ex(func, args, kwargs):
    if _declined(func, args, kwargs):
        return NotImplemented
    got = _batched(func, args, kwargs)
    a = args[0]
    if got is not NotImplemented or a.shape[-1] != a.shape[-2]:
        return got
    f = _factor(a, "inv")
    if f is None:
        return NotImplemented
    rows, lu, piv, info = f
    eye = torch.eye(a.shape[-1], dtype=lu.dtype, device=lu.device)  # B = I, on each rank
    x = _lu_solve(rows, lu, piv, None, False, "inv", b_whole=eye.expand(*a.shape))
    return _cut(x, rows), c.as_shard(info, rows.mesh)


def _tri_solve(a, b, upper: bool, unit: bool, name: str):
    """``A X = B`` (A triangular) as a ShardTensor cut along its rows: A cut along a matrix
    dim, or whole with B cut along its rows; else NotImplemented."""
    if not _real(a, b) or b.ndim < 2 or a.ndim < 2 or tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return NotImplemented
    if _whole(a):
        m = row_cut(b)
        if m is None:
            return NotImplemented
        rows = rowlu.Rows(b.device_mesh, m, b._layout.shard_sizes(m))
        t = c.local(a)[..., rows.lo : rows.hi, :]
    else:
        got = _to_rows(a, name)
        if got is None:
            return NotImplemented
        rows, t = got
    bl = c.local(b)[..., rows.lo : rows.hi, :] if _whole(b) else _rows_of(b, rows, name)
    return _cut(rowlu.solve(t, bl, rows, upper, unit, name), rows)


def _t(a):
    """``A^T``: a ShardTensor's blocks transposed (no message), a whole tensor's."""
    return transposed(a) if type(a) is c.ShardTensor else a.mT


def _tri_left(a, b, upper, unit, left, name):
    """``A X = B`` (left) or ``X A = B`` (``A^T X^T = B^T``)."""
    if left:
        return _tri_solve(a, b, upper, unit, name)
    x = _tri_solve(_t(a), b.mT, not upper, unit, name)
    return x if x is NotImplemented else x.mT


@register(aten.linalg_solve_triangular.default)
def solve_triangular(func, args, kwargs):
    got = linalg.solve_triangular(func, args, kwargs)  # (A whole, B cut along a free dim)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    a, b = kw["self"], kw["B"]
    return _tri_left(a, b, kw["upper"], kw["unitriangular"], kw["left"], "solve_triangular")


@register(aten.triangular_solve.default)
def triangular_solve(func, args, kwargs):
    kw = _args(func, args, kwargs)
    b, a = kw["self"], kw["A"]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return NotImplemented
    unit, upper = kw["unitriangular"], kw["upper"]
    if _whole(a) and type(b) is c.ShardTensor and row_cut(b) is None:
        return _local_columns(b.device_mesh, b, [b.shape, a.shape])
    if kw["transpose"]:  # A^T X = B
        x = _tri_solve(_t(a), b, not upper, unit, "triangular_solve")
    else:
        x = _tri_solve(a, b, upper, unit, "triangular_solve")
    if x is NotImplemented:
        return x
    clone = a.clone() if type(a) is c.ShardTensor else c.as_shard(a.clone(), x.device_mesh)
    return x, clone


def _chol(a, upper, name):
    """``(rows, the factor's rows, info)`` or None."""
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        return None
    got = _to_rows(a, name)
    if got is None:
        return None
    rows, local = got
    return (rows, *rowlu.cholesky(local, rows, upper, name))


_OLD_CHOLESKY = getattr(getattr(aten, "cholesky", None), "default", None)  # (gone in torch 2.15)


@register(aten.linalg_cholesky_ex.default, *([_OLD_CHOLESKY] if _OLD_CHOLESKY else []))
def cholesky(func, args, kwargs):
    if _declined(func, args, kwargs):
        return NotImplemented
    got = _batched(func, args, kwargs)
    if got is not NotImplemented:
        return got
    f = _chol(args[0], _args(func, args, kwargs)["upper"], "cholesky")
    if f is None:
        return NotImplemented
    rows, factor, info = f
    if bool((info != 0).any()):  # not positive definite: torch's own answer (or error)
        return fallback.replicate_and_run(func, args, kwargs)
    if func is _OLD_CHOLESKY:
        return _cut(factor, rows)
    return _cut(factor, rows), c.as_shard(info, rows.mesh)


def _chol_solve(b, f, upper, name):
    """``A X = B``, A = L L^T (or U^T U), from the factor ``f``: two triangular solves."""
    if upper:  # U^T y = B, U x = y
        y = _tri_solve(_t(f), b, False, False, name)
        return y if y is NotImplemented else _tri_solve(f, y, True, False, name)
    y = _tri_solve(f, b, False, False, name)  # L y = B, L^T x = y
    return y if y is NotImplemented else _tri_solve(_t(f), y, True, False, name)


@register(aten.cholesky_solve.default)
def cholesky_solve(func, args, kwargs):
    got = _batched(func, args, kwargs)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    b, f = kw["self"], kw["input2"]
    if not isinstance(b, torch.Tensor) or not isinstance(f, torch.Tensor):
        return NotImplemented
    if _whole(f) and type(b) is c.ShardTensor and row_cut(b) is None:
        return _local_columns(b.device_mesh, b, [b.shape])
    return _chol_solve(b, f, kw["upper"], "cholesky_solve")


@register(aten.cholesky_inverse.default)
def cholesky_inverse(func, args, kwargs):
    kw = _args(func, args, kwargs)
    f = kw["self"]
    if _whole(f) or f.ndim < 2 or f.shape[-1] != f.shape[-2]:
        return NotImplemented
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand(f.shape)
    return _chol_solve(eye, f, kw["upper"], "cholesky_inverse")
