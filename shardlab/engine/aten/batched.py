"""Batched matrix ops (``torch.linalg``): every leading dim is a batch of independent problems.

``torch.linalg.solve(A, B)`` with A ``(..., n, n)`` and B ``(..., n, k)`` solves each batch
element alone, so with only batch dims cut each rank solves its own::

    A (6, n, n) Shard(0) sizes [4, 2]      rank 0: A[0:4], B[0:4] -> X[0:4]     no message
    B (6, n, k) Shard(0) sizes [4, 2]      rank 1: A[4:6], B[4:6] -> X[4:6]

Taken when every ShardTensor argument is cut (``Shard``) only along batch dims, each such
batch dim by one mesh dim, all alike (the same positions in the broadcast batch shape,
right-aligned as torch broadcasts, and the same sizes), and every other tensor argument
has size 1 (or no dim) there. The results' batch dims are cut as the arguments'; their
matrix dims are whole. Else ``NotImplemented``: the whole-tensor fallback.

Only ops that never raise on the values (a raise on the one rank holding a bad matrix
would leave the others waiting): the ``_ex`` forms with ``check_errors=False`` (torch's
``linalg.inv`` / ``solve`` / ``cholesky`` then call ``_linalg_check_errors``, which keeps
the fallback: its error names the batch element, on every rank), determinants, QR, LU,
triangular solves, the matrix exponential. Not the SVD or eigen-decompositions: they
raise on non-finite values.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.engine import _common as c
from shardlab.engine.meta import meta_call
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.layout import ShardLayout

aten = torch.ops.aten


def _solve_cores(args):
    if len(args) < 2:
        return ()  # (A or B by name: the fallback)
    a, b = args[0], args[1]  # B is a batch of vectors as torch reads it (linalg.solve)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    return (2, 1 if vector else 2)


# op -> the matrix (core) dims of each tensor argument, in order (the rest are batch dims)
CORES = {
    aten._linalg_det.default: (2,),
    aten._linalg_slogdet.default: (2,),
    aten.linalg_inv_ex.default: (2,),
    aten._linalg_solve_ex.default: _solve_cores,
    aten.linalg_cholesky_ex.default: (2,),
    aten.linalg_lu_factor_ex.default: (2,),
    aten.linalg_lu.default: (2,),
    aten.linalg_ldl_factor_ex.default: (2,),
    aten.linalg_qr.default: (2,),
    aten.linalg_matrix_exp.default: (2,),
    aten.linalg_solve_triangular.default: (2, 2),
    aten.cholesky_solve.default: (2, 2),
    aten.linalg_lu_solve.default: (2, 1, 2),
    aten.linalg_householder_product.default: (2, 1),
}


@register(*CORES)
def batched(func, args, kwargs):
    if _checks_errors(func, args, kwargs) or _refused(func, args, kwargs):
        return NotImplemented  # the kernel raises on the values: the fallback, every rank
    st = c.ShardTensor
    values = (*args, *kwargs.values())
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return NotImplemented  # (tensors by name: their order is not the schema's)
    cores = CORES[func]
    cores = cores(args) if callable(cores) else cores
    if len(tensors) != len(cores) or not any(type(t) is st for t in tensors):
        return NotImplemented
    batch = torch.broadcast_shapes(*[tuple(t.shape[: t.ndim - k]) for t, k in zip(tensors, cores)])
    nb = len(batch)
    cuts: dict = {}  # mesh dim -> (batch position, sizes)
    mesh = next(t for t in tensors if type(t) is st).device_mesh
    for t, k in zip(tensors, cores):
        if type(t) is not st:
            continue
        if t.device_mesh != mesh:
            return NotImplemented
        lay, lead = t._layout, nb - (t.ndim - k)
        for m, p in enumerate(lay.placements):
            if isinstance(p, Shard):
                twice = sum(isinstance(q, Shard) and q.dim == p.dim for q in lay.placements) > 1
                if p.dim >= t.ndim - k or twice or not lay.is_block(p.dim):
                    return NotImplemented  # a matrix dim cut, or a batch dim cut twice
                if t.shape[p.dim] != batch[p.dim + lead]:
                    return NotImplemented  # (a size-1 dim that broadcasts, cut)
                cut = (p.dim + lead, lay.sizes[m])
                if 0 in cut[1][0]:
                    return NotImplemented  # an empty piece (see _refused): the fallback
                if cuts.setdefault(m, cut) != cut:
                    return NotImplemented  # cut otherwise than another argument
                if any(q[0] == cut[0] for n, q in cuts.items() if n != m):
                    return NotImplemented  # one batch dim cut by two mesh dims
            elif not isinstance(p, Replicate):
                return NotImplemented  # Partial
    if not cuts:
        return NotImplemented  # nothing cut along a batch dim (the whole-blocks path)
    moves, i = [], 0  # per argument: None (its block as it is), or the layout it takes
    for a in values:
        if not isinstance(a, torch.Tensor):
            moves.append(None)
            continue
        target = _arg_layout(a, cores[i], nb, mesh, cuts)
        i += 1
        if type(a) is st:  # its cut batch dims agree (above): the rest is a slice of it
            moves.append(None if a._layout == target else target)
        else:  # a plain tensor, whole: sliced where the others are cut
            cut = any(isinstance(p, Shard) for p in target.placements)
            moves.append(target if cut else None)
    meta = meta_call(func, args, kwargs)
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    if not metas or not all(
        isinstance(o, torch.Tensor) and tuple(o.shape[:nb]) == tuple(batch) for o in metas
    ):
        return NotImplemented  # a result without the batch dims (lstsq's empty ones)
    layouts = tuple(_out_layout(tuple(o.shape), mesh, cuts) for o in metas)
    many = isinstance(meta, (tuple, list))
    return Plan(mesh, layouts if many else layouts[0], moves, _CAUSE)  # the kernel per block


_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _refused(func, args, kwargs) -> bool:
    """Calls the kernels refuse only where there is data (they return early on an empty
    batch, after the meta check accepted them): a rank with an empty piece would go on
    while the others raise. Half precision, LU without pivoting; and, for what else may
    hide there, an empty piece of a cut batch dim declines the rule (in ``batched``)."""
    for a in args:
        if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
            if a.dtype not in _DTYPES:
                return True
    for i, spec in enumerate(func._schema.arguments):
        if spec.name == "pivot":
            return not (args[i] if i < len(args) else kwargs.get("pivot", True))
    return False


def _checks_errors(func, args, kwargs) -> bool:
    """The call's ``check_errors`` (the ``_ex`` ops' flag), False where there is none."""
    for i, spec in enumerate(func._schema.arguments):
        if spec.name == "check_errors":
            return bool(args[i] if i < len(args) else kwargs.get(spec.name, False))
    return False


_CAUSE = "batched matrix op"


def _arg_layout(t, k, nb, mesh, cuts) -> ShardLayout:
    """The layout argument ``t`` (``k`` matrix dims) takes: its batch dims cut as ``cuts``
    where it has them (size > 1), whole elsewhere."""
    lead = nb - (t.ndim - k)
    places, sizes = [], []
    for m in range(mesh.ndim):
        pos, entry = cuts.get(m, (None, None))
        d = None if pos is None else pos - lead
        if d is not None and 0 <= d < t.ndim - k and t.shape[d] != 1:
            places.append(Shard(d))
            sizes.append(list(entry[0]))
        else:
            places.append(Replicate())
            sizes.append(None)
    return ShardLayout.build(tuple(t.shape), tuple(mesh.shape), places, sizes)


def _out_layout(shape, mesh, cuts) -> ShardLayout:
    places, sizes = [], []
    for m in range(mesh.ndim):
        if m in cuts:
            pos, entry = cuts[m]
            places.append(Shard(pos))
            sizes.append(list(entry[0]))
        else:
            places.append(Replicate())
            sizes.append(None)
    return ShardLayout.build(shape, tuple(mesh.shape), places, sizes)
