"""torch's own checks and output shapes of an aten op, on shape-only (meta) copies of the
global tensors: bad arguments raise torch's error on every rank before anything is sent.
Kept per signature (:func:`meta_call`'s cache), outside any dispatch mode.
"""

from __future__ import annotations

import torch

from shardlab._tree import tree_leaves, tree_map
from shardlab.comm import traced

# the rules read these as c.<name> too (``c.as_shard``, ``c.tree_map``)
from shardlab.tensor.api import ShardTensor  # noqa: F401
from shardlab.tensor.create import as_shard, replicate_layout  # noqa: F401


def meta_of(x):
    st = ShardTensor
    if isinstance(x, st):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, traced.SYMBOLIC):  # a scalar dynamo traces (a float argument that changed
        return _hint(x)  # between calls): its value now, read without a guard
    return x


def _hint(x):
    """A symbolic scalar's value in this call (no guard added: torch's checks on the
    meta copies see a plain number of the same type)."""
    hint = x.node.hint
    if hint is None:  # unbacked: any value of its type
        hint = {torch.SymInt: 1, torch.SymFloat: 1.0, torch.SymBool: True}[type(x)]
    return hint


class _NoMeta(Exception):
    pass


_META_CACHE: dict = {}
_META_CACHE_SIZE = 4096


_ATOMS = frozenset({int, bool, str, type(None), torch.dtype})  # keyed by type and value


def _key(x):
    t = type(x)
    if t in _ATOMS:  # the common case first (sizes, dims, flags)
        return (t, x)
    if t is tuple or t is list:
        return (t, *(_key(v) for v in x))
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_key(v) for v in x))
    if isinstance(x, dict):
        return ("D", *((k, _key(v)) for k, v in sorted(x.items())))
    if isinstance(x, float) and x != x:
        return ("nan",)
    if isinstance(x, traced.SYMBOLIC):
        raise TypeError("a symbolic scalar: no cached meta result")
    hash(x)  # anything unhashable: no caching
    return (type(x).__name__, x)


def meta_call(func, args, kwargs):
    """``func`` on shape-only copies of the global tensors: torch's own argument errors,
    raised alike on every rank, and the global output shapes. None when torch has no
    meta kernel for it (or the output size depends on the data). Cached by the
    arguments' shapes, strides and dtypes (a training step repeats them)."""
    try:
        key = (func, _key(args), _key(kwargs))
        hit = _META_CACHE.get(key)
    except TypeError:  # unhashable: a symbolic size in a shape, say
        return _meta_call(func, args, kwargs)
    if hit is None:
        try:
            hit = ("ok", _meta_call(func, args, kwargs))
        except Exception as exc:  # torch's own error: the same for the same arguments
            hit = ("error", exc)
        if len(_META_CACHE) >= _META_CACHE_SIZE:
            _META_CACHE.clear()
        _META_CACHE[key] = hit
    if hit[0] == "error":
        raise hit[1]
    return hit[1]


def _meta_call(func, args, kwargs):
    with traced.outside_modes():  # meta tensors, also while torch.compile traces (kept)
        return _meta_call_here(func, args, kwargs)


def _meta_call_here(func, args, kwargs):
    margs, mkwargs = tree_map(meta_of, (args, kwargs))
    if scalars_index(func) is not None:
        margs, mkwargs = _keep_cpu_scalars(func, args, kwargs, margs, mkwargs)
    if func in _HALF_ONLY_META:
        return _as_half_on_meta(func, margs, mkwargs)
    try:
        return func(*margs, **mkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DataDependentOutputException):
        return None
    except RuntimeError as exc:
        again = _with_cpu_scalars(func, margs, mkwargs)
        if again is not None:
            return again[0]
        text = str(exc)
        if "meta" in text.lower() and ("not implemented" in text or "backend" in text.lower()):
            return None
        if any(
            w in text
            for w in (
                "data-dependent",
                "Cannot copy out of meta",
                "cannot be called on meta tensors",
                "do not have strides",
            )
        ):
            return None
        raise


def _with_cpu_scalars(func, margs, mkwargs):
    """``(result,)`` of the meta call again with each 0-d tensor a CPU one, or None. torch
    takes a 0-d tensor beside a larger one as a scalar (``g.mul_(clip_coef)``, what
    ``clip_grad_norm_`` does per gradient), but a meta kernel written as a reference checks
    shapes strictly unless that tensor is on the CPU (``allow_cpu_scalar_tensors``)."""

    changed = []

    def cpu(a):
        if isinstance(a, torch.Tensor) and a.ndim == 0 and a.device.type == "meta":
            changed.append(a)
            return torch.zeros((), dtype=a.dtype)
        return a

    cargs, ckwargs = tree_map(cpu, (margs, mkwargs))
    if not changed:
        return None
    try:
        return (func(*cargs, **ckwargs),)
    except Exception:  # noqa: BLE001 (the first error is torch's answer)
        return None


_CPU_SCALARS: dict = {}  # op -> the index of its ``Tensor scalars`` argument, or None


def scalars_index(func):
    """The foreach ops' ``Tensor scalars`` (``_foreach_addcdiv_.Tensor``, which compiled
    optimizers call): their meta kernel wants that tensor on the CPU, as it is."""
    if func not in _CPU_SCALARS:
        where = [i for i, a in enumerate(func._schema.arguments)
                 if a.name == "scalars" and str(a.type) == "Tensor"]  # fmt: skip
        _CPU_SCALARS[func] = where[0] if where else None
    return _CPU_SCALARS[func]


def _keep_cpu_scalars(func, args, kwargs, margs, mkwargs):
    i = _CPU_SCALARS[func]
    if i < len(args):
        if type(args[i]) is torch.Tensor:
            margs = [*margs[:i], args[i], *margs[i + 1 :]]
    elif type(kwargs.get("scalars")) is torch.Tensor:
        mkwargs = {**mkwargs, "scalars": kwargs["scalars"]}
    return margs, mkwargs


# meta kernels that refuse dtypes the CPU kernel takes (torch 2.11-2.13: the meta of
# ``_grouped_mm``, MoE experts in transformers, wants bfloat16; the CPU kernel also takes
# float32 and float16): their shapes are read in bfloat16 and given the inputs' dtype
_HALF_ONLY_META = {torch.ops.aten._grouped_mm.default}


def _as_half_on_meta(func, margs, mkwargs):
    floats = {a.dtype for a in tree_leaves((margs, mkwargs))
              if isinstance(a, torch.Tensor) and a.is_floating_point()}  # fmt: skip
    if floats <= {torch.bfloat16} or len(floats) != 1 or mkwargs.get("out_dtype") is not None:
        return func(*margs, **mkwargs)  # bfloat16, mixed, or an out_dtype: torch's own words
    (dtype,) = floats

    def half(a):
        return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == dtype else a

    out = func(*tree_map(half, margs), **tree_map(half, mkwargs))

    def back(r):
        if isinstance(r, torch.Tensor) and r.dtype == torch.bfloat16:
            return torch.empty_strided(r.shape, r.stride(), dtype=dtype, device="meta")
        return r

    return tree_map(back, out)
