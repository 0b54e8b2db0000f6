"""Vector norms of ShardTensors, written as the reductions shardlab computes exactly.

DTensor 2.13 computes ``linalg.vector_norm`` of a sharded tensor as a ``_NormPartial``
(each rank's norm of its block), which shardlab's sum-reduction would add up wrongly, and
whose backward divides by the *local* norm. So ``torch.norm``, ``Tensor.norm``,
``torch.linalg.norm``/``vector_norm``/``matrix_norm('fro')`` on a ShardTensor become::

    ord = p (finite, not 0):  (sum |x|^p) ^ (1/p)     one all-reduce of the sum
    ord = 2 (and 'fro'):      sqrt(sum x^2)
    ord = inf / -inf:         amax / amin of |x|      one all-reduce (max / min)
    ord = 0:                  number of non-zeros     one all-reduce

Autograd differentiates these ops, so the gradient ``x |x|^(p-2) / norm^(p-1)`` uses the
*global* norm (no messages in backward for a replicated result). Where the norm is 0 the
2-norm's gradient is nan, not torch's 0. Matrix norms other than Frobenius
(``'nuc'``, 1, 2, inf over two dims) raise ``NotImplementedError``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NORMS", "norm_of"]


def _dims(x, dim) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.ndim))
    return (dim,) if isinstance(dim, int) else tuple(dim)


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """``torch.linalg.vector_norm`` from element-wise ops and exact reductions."""
    if x.is_complex():
        raise NotImplementedError("norms of complex ShardTensors are not supported")
    if dtype is not None:
        x = x.to(dtype)
    dims = _dims(x, dim)
    a = x.abs()
    if ord == math.inf:
        return a.amax(dim=dims, keepdim=keepdim)
    if ord == -math.inf:
        return a.amin(dim=dims, keepdim=keepdim)
    if ord == 0:
        return a.sign().sum(dim=dims, keepdim=keepdim)  # 1 per non-zero; gradient 0, as torch
    if ord == 2:
        return x.square().sum(dim=dims, keepdim=keepdim).sqrt()
    if ord == 1:
        return a.sum(dim=dims, keepdim=keepdim)
    return a.pow(ord).sum(dim=dims, keepdim=keepdim).pow(1.0 / ord)


def _matrix_or_vector(x, ord, dim, keepdim, dtype, name):
    """``ord`` over ``dim``: a vector norm, or the Frobenius norm of two dims."""
    dims = _dims(x, dim)
    if ord in (None, "fro") or (len(dims) != 2 and not isinstance(ord, str)):
        return vector_norm(x, 2 if ord in (None, "fro") else ord, dim, keepdim, dtype=dtype)
    raise NotImplementedError(
        f"{name}: ord={ord!r} over dims {list(dims)} of a ShardTensor is not supported; "
        "supported: vector norms (any ord) and the Frobenius norm ('fro'). For others, "
        "call it on .full_tensor()."
    )


def linalg_norm(x, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    if out is not None:
        raise NotImplementedError("linalg.norm(..., out=) is not supported on ShardTensors")
    return _matrix_or_vector(x, ord, dim, keepdim, dtype, "torch.linalg.norm")


def matrix_norm(x, ord="fro", dim=(-2, -1), keepdim=False, *, out=None, dtype=None):
    if ord != "fro" or out is not None:
        raise NotImplementedError(
            f"torch.linalg.matrix_norm: ord={ord!r} of a ShardTensor is not supported; "
            "supported: 'fro'. For others, call it on .full_tensor()."
        )
    return vector_norm(x, 2, dim, keepdim, dtype=dtype)


def torch_norm(x, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm`` / ``Tensor.norm``: 'fro' or a number p, over ``dim`` (default all)."""
    if out is not None:
        raise NotImplementedError("torch.norm(..., out=) is not supported on ShardTensors")
    if p == "nuc":
        raise NotImplementedError(
            "torch.norm: p='nuc' of a ShardTensor is not supported; supported: 'fro' and "
            "numbers. Call it on .full_tensor()."
        )
    return vector_norm(x, 2 if p == "fro" else p, dim, keepdim, dtype=dtype)


NORMS = {
    torch.linalg.vector_norm: vector_norm,
    torch.linalg.norm: linalg_norm,
    torch.linalg.matrix_norm: matrix_norm,
    torch.norm: torch_norm,
    torch.Tensor.norm: torch_norm,
}


def norm_of(func, args, kwargs):
    """``func(*args, **kwargs)`` for a ShardTensor input. The arguments are first checked by
    torch itself on a shape-only (meta) copy, so bad ones raise torch's own error."""
    x = args[0] if args else next(iter(kwargs.values()))
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    rest = (meta, *args[1:]) if args else ()
    meta_kwargs = kwargs if args else {k: meta if v is x else v for k, v in kwargs.items()}
    try:
        with torch._C.DisableTorchFunctionSubclass():
            func(*rest, **meta_kwargs)
    except NotImplementedError:  # no meta kernel (e.g. 'nuc'): decided below
        pass
    return NORMS[func](*args, **kwargs)
