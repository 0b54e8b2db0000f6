"""torch's own checks and output shapes of an aten op, on shape-only (meta) copies of the
global tensors: bad arguments raise torch's error on every rank before anything is sent.
Kept per signature (:func:`meta_call`'s cache), outside any dispatch mode. And what the
dispatcher reads from it: the global strides of the results (:func:`with_strides`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes as _no_modes

from shardlab._tree import tree_leaves, tree_map
from shardlab.comm import traced
from shardlab.engine._common import rebuild, shards_in
from shardlab.tensor.api import ShardTensor

aten = torch.ops.aten


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
    arguments' shapes, strides and dtypes and torch's default dtype (a training step
    repeats them)."""
    try:
        key = (func, _key(args), _key(kwargs), torch.get_default_dtype())  # (int * 0.5)
    except TypeError:  # unhashable: a symbolic size in a shape, say
        return _meta_call(func, args, kwargs)
    return cached(key, _meta_call, func, args, kwargs)


def cached(key, run, *args):
    """``run(*args)`` once per ``key`` in the one meta cache (aten ops' and the F-level
    families' meta runs, the meta tensors they read): its result, or torch's error,
    raised again, the same for the same arguments. Bounded: the oldest entry goes first."""
    try:
        hit = _META_CACHE.get(key)
    except TypeError:  # an unhashable argument: no caching
        return run(*args)
    if hit is None:
        try:
            hit = ("ok", run(*args))
        except Exception as exc:  # torch's own error: the same for the same arguments
            hit = ("error", exc)
        if len(_META_CACHE) >= _META_CACHE_SIZE:
            del _META_CACHE[next(iter(_META_CACHE))]
        _META_CACHE[key] = hit
    if hit[0] == "error":
        raise hit[1].with_traceback(None)
    return hit[1]


def _meta_call(func, args, kwargs):
    with _no_modes():  # meta tensors, also while torch.compile traces (traced.outside_modes)
        return _meta_call_here(func, args, kwargs)


def _metas(x):
    """``meta_of`` over an op's arguments (tensors, scalars, lists and tuples of them)."""
    t = type(x)
    if t is list or t is tuple:
        return t([_metas(v) for v in x])
    if t is dict:
        return {k: _metas(v) for k, v in x.items()}
    return meta_of(x)


_FFTS = (torch.ops.aten._fft_r2c.default, torch.ops.aten._fft_c2r.default,
         torch.ops.aten._fft_c2c.default)  # fmt: skip


def _fft_meta(func, margs):
    """A transform's result on meta, from its arguments (torch 2.11's meta kernel sets
    strides out of bounds when the last transformed dim is not the tensor's last)."""
    x, dims, last = margs[0], margs[1], margs[3]
    shape = list(x.shape)
    d = dims[-1] % max(x.ndim, 1)
    if func is torch.ops.aten._fft_r2c.default:
        shape[d] = shape[d] // 2 + 1 if last else shape[d]
        dtype = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    elif func is torch.ops.aten._fft_c2r.default:
        shape[d] = last
        dtype = torch.float64 if x.dtype == torch.complex128 else torch.float32
    else:
        dtype = x.dtype
    return torch.empty(shape, dtype=dtype, device="meta")


def _meta_call_here(func, args, kwargs):
    margs, mkwargs = _metas(args), _metas(kwargs)
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
        if "setStorage" in text and func in _FFTS:  # torch 2.11's meta of a transform
            return _fft_meta(func, margs)  # whose last dim is not the tensor's: its shape
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


# -- what the dispatcher reads from a meta run -----------------------------------------
NO_META = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
}  # ops whose meta run is pointless (no shape argument to check) or unsupported


def agrees(out, meta) -> bool:
    """Same structure, shapes and dtypes as the meta run (True when there is none)."""
    if meta is None:
        return True
    if isinstance(meta, torch.Tensor):
        return (
            isinstance(out, torch.Tensor)
            and tuple(out.shape) == tuple(meta.shape)
            and out.dtype == meta.dtype
        )
    if isinstance(meta, (list, tuple)):
        return (
            isinstance(out, (list, tuple))
            and len(out) == len(meta)
            and all(agrees(o, m) for o, m in zip(out, meta))
        )
    return True


def copy_meta(func, args, kwargs):
    """The strides torch gives an alias or a copy of a ShardTensor (``detach`` and
    ``alias`` keep its strides, ``clone`` and ``_to_copy`` follow ``memory_format``), from
    a meta tensor (no meta run of the op itself: a device argument has none)."""
    x = args[0] if args else None
    if func not in _COPIES or not isinstance(x, ShardTensor):
        return None
    with traced.outside_modes():
        m = torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
        if func is aten.clone.default or func is aten._to_copy.default:
            fmt = kwargs.get("memory_format")
            m = m.clone(memory_format=torch.preserve_format if fmt is None else fmt)
            if kwargs.get("dtype") is not None:  # _to_copy's new dtype
                m = m.to(kwargs["dtype"])
        return m


_COPIES = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default}


def with_strides(out, meta, inputs):
    """Results get the global strides torch gives on one device (from the meta run):
    the same on every rank, so composite ops that branch on them agree everywhere."""
    if meta is None:
        return out
    st = ShardTensor
    if isinstance(out, st) and isinstance(meta, torch.Tensor):
        if out.stride() == meta.stride() or tuple(out.shape) != tuple(meta.shape):
            return out
        if any(out is a for a in shards_in(inputs)):
            return out  # an in-place op returns its input as it is
        new = st._wrap(out._local_tensor, out.device_mesh, out._layout, stride=meta.stride())
        if hasattr(out, "_writeback"):
            new._writeback = out._writeback
        return new
    if isinstance(out, (list, tuple)) and isinstance(meta, (list, tuple)) and len(out) == len(meta):
        return rebuild(out, [with_strides(o, m, inputs) for o, m in zip(out, meta)])
    return out


def elementwise_shapes(args, kwargs, meta) -> bool:
    """Is every tensor result the broadcast shape of the inputs? (torch tags ``glu``
    pointwise, but it halves a dim: blocks of odd length would fail on some ranks.)"""
    if meta is None:
        return True
    shape = torch.broadcast_shapes(
        *[tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    )
    return all(tuple(m.shape) == shape for m in tree_leaves(meta) if isinstance(m, torch.Tensor))
