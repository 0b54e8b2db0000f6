"""Householder QR of a matrix cut along its rows: ``geqrf``, ``householder_product``,
``ormqr``, LAPACK's reflectors, no rank holding the matrix.

``A`` (..., M, n) real, its rows cut in blocks by one mesh dim (a matrix cut otherwise is
moved to its rows first: :func:`.tsqr.to_rows`, one all-to-all). LAPACK keeps
``Q = H_0 H_1 .. H_{k-1}``, ``H_j = I - tau_j v_j v_j^T``, ``v_j`` zero above row j, 1 at
row j, stored below the diagonal of the result (``R`` on and above it).

``geqrf``, for each column j < k = min(M, n) (``dgeqr2``):

1. ONE all-reduce of (the diagonal entry, from its owner; each rank's sum of squares of
   its rows below j): every rank computes ``beta = -sign(alpha) |(alpha, x)|``,
   ``tau = (beta - alpha) / beta`` and scales its rows below j by ``1 / (alpha - beta)``
   (``dlarfg``; ``tau = 0`` where nothing is below: ``H = I``);
2. ONE all-reduce of ``w = v^T A[j:, j+1:]`` (each rank its rows' part), then each rank
   ``A[i, j+1:] -= tau v_i w`` on its rows, no message.

``householder_product`` (``Q``'s first n columns) and ``ormqr`` (``op(Q) C`` or
``C op(Q)``) apply the reflectors to a matrix cut as the reflectors' rows (``Q``: each
rank its rows of the identity; a whole ``C``: sliced; a cut one: moved there), each
reflector ONE all-reduce of ``w = v^T C``: the result stays cut along its rows (``C`` on
the right: through the transposes, cut along its columns).

Messages per matrix: geqrf 2k all-reduces (2 numbers, then n - j - 1), the others one of
C's width per reflector. Backward: autograd's formulas (``householder_product``'s and
``ormqr``'s) on ShardTensors; ``geqrf`` has none in torch.
"""

from __future__ import annotations

import torch

from shardlab.comm import collectives
from shardlab.engine import _common as c
from shardlab.engine.aten import rowlu
from shardlab.engine.aten.lu import (
    _batched,
    _cut,
    _rows_of,
    _to_rows,
    _whole,
)
from shardlab.engine.aten.tsqr import transposed
from shardlab.engine.registry import register
from shardlab.trace import label

aten = torch.ops.aten
_args = c.schema_args


def _summed(t, rows, name):
    with label(name):
        collectives.all_reduce_(t, group=rows.group)
    return t


def geqrf_rows(a, rows, name):
    """Steps 1-2 on this rank's rows ``a`` (..., m_i, n): (its rows of the result, tau
    (..., k) alike on every rank)."""
    f = rowlu.flat(a).clone()  # (B, m_i, n)
    nb, n = f.shape[0], f.shape[-1]
    k = min(sum(rows.sizes), n)
    g = torch.arange(rows.lo, rows.hi)
    tau = f.new_zeros(nb, k)
    for j in range(k):
        below, own = g > j, rows.lo <= j < rows.hi
        buf = f.new_zeros(nb, 2)  # 1. (alpha, sum of squares below j)
        if own:
            buf[:, 0] = f[:, j - rows.lo, j]
        buf[:, 1] = f[:, below, j].square().sum(-1)
        alpha, xsq = _summed(buf, rows, f"{name}.norm").unbind(-1)
        beta = -torch.where(alpha >= 0, 1.0, -1.0).to(f.dtype) * torch.sqrt(alpha.square() + xsq)
        some = xsq > 0
        t = torch.where(some, (beta - alpha) / torch.where(some, beta, 1.0), 0.0)
        scale = torch.where(some, 1.0 / torch.where(some, alpha - beta, 1.0), 1.0)
        f[:, below, j] *= scale[:, None]
        if own:
            f[:, j - rows.lo, j] = torch.where(some, beta, alpha)
        tau[:, j] = t
        if j + 1 < n:  # 2. w = v^T A[j:, j+1:], then the update
            v = f.new_zeros(nb, f.shape[1])  # (B, m_i): v_j's entries on my rows
            v[:, below] = f[:, below, j]
            if own:
                v[:, j - rows.lo] = 1.0
            w = _summed((v[:, :, None] * f[:, :, j + 1 :]).sum(1), rows, f"{name}.apply")
            f[:, :, j + 1 :] -= (t[:, None, None] * v[:, :, None]) * w[:, None, :]
    return f.reshape(a.shape), tau.reshape(*a.shape[:-2], k)


def apply_rows(v, tau, cm, rows, transpose: bool, name):
    """``Q C`` (or ``Q^T C``) on this rank's rows: ``v`` (..., m_i, n) the reflectors'
    rows, ``tau`` (..., k) whole, ``cm`` (..., m_i, w) C's rows."""
    vf, cf = rowlu.flat(v), rowlu.flat(cm).clone()
    tf = tau.reshape(vf.shape[0], -1)
    k = tf.shape[-1]
    g = torch.arange(rows.lo, rows.hi)
    order = range(k) if transpose else range(k - 1, -1, -1)  # Q^T: H_0 first
    for j in order:
        vj = torch.where(g > j, vf[:, :, j], (g == j).to(vf.dtype))  # (B, m_i)
        w = _summed((vj[:, :, None] * cf).sum(1), rows, f"{name}.apply")  # (B, w)
        cf -= (tf[:, j, None, None] * vj[:, :, None]) * w[:, None, :]
    return cf.reshape(cm.shape)


@register(aten.geqrf.default)
def geqrf(func, args, kwargs):
    got = _to_rows(args[0], "geqrf")
    if got is None:
        return NotImplemented
    rows, local = got
    a, tau = geqrf_rows(local, rows, "geqrf")
    return _cut(a, rows), c.as_shard(tau, rows.mesh)


@register(aten.linalg_householder_product.default)
def householder_product(func, args, kwargs):
    got = _batched(func, args, kwargs)  # (only batch dims cut: each rank its own)
    if got is not NotImplemented:
        return got
    kw = _args(func, args, kwargs)
    v, tau = kw["input"], kw["tau"]
    if not _whole(tau) or tau.ndim != v.ndim - 1:
        return NotImplemented
    got = _to_rows(v, "householder_product")
    if got is None:
        return NotImplemented
    rows, local = got
    n = v.shape[-1]
    eye = torch.eye(sum(rows.sizes), n, dtype=v.dtype, device=local.device)[rows.lo : rows.hi]
    eye = eye.expand(*v.shape[:-2], -1, -1)
    q = apply_rows(local, c.local(tau), eye, rows, False, "householder_product")
    return _cut(q, rows)


@register(aten.ormqr.default)
def ormqr(func, args, kwargs):
    kw = _args(func, args, kwargs)
    v, tau, cm = kw["self"], kw["input2"], kw["input3"]
    left, transpose = kw["left"], kw["transpose"]
    if not _whole(tau) or not isinstance(cm, torch.Tensor) or cm.ndim != v.ndim:
        return NotImplemented
    if tuple(cm.shape[:-2]) != tuple(v.shape[:-2]):
        return NotImplemented
    if _whole(v):
        return NotImplemented  # (C cut, the reflectors whole: the fallback)
    got = _to_rows(v, "ormqr")
    if got is None:
        return NotImplemented
    rows, local = got
    if left:  # op(Q) C
        x = apply_rows(local, c.local(tau), _rows_of(cm, rows, "ormqr"), rows, transpose, "ormqr")
        return _cut(x, rows)
    # C op(Q) = (op(Q)^T C^T)^T
    ct = transposed(cm) if type(cm) is c.ShardTensor else cm.mT
    x = apply_rows(local, c.local(tau), _rows_of(ct, rows, "ormqr"), rows, not transpose, "ormqr")
    return _cut(x, rows).mT
