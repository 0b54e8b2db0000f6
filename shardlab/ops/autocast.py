"""``torch.autocast`` for the calls shardlab takes over above torch's dispatcher.

torch applies autocast per aten op, in its dispatcher: a ShardTensor's aten ops
(``x @ w``, ``F.linear``, ``softmax`` …) pass through it and follow the policy on their
own. The ``torch.nn.functional`` calls that shardlab routes to its own sharded code
(halo convolutions, ring attention, norms with all-reduces, losses …) never reach it with
the user's arguments, so they apply the policy here, as one device would::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.conv2d(x, w)          # one device: x, w cast to bfloat16, a bfloat16 result
        F.cross_entropy(z, t)   # one device: z cast to float32, a float32 result

1. ask torch what autocast does to the call's arguments: the *original* function on
   fake tensors of the global shapes and dtypes (no data, no messages) under the active
   autocast, a dispatch mode below autocast watching which arguments it casts to what;
   cached per signature (a few hundred microseconds the first time);
2. exactly those arguments are cast (torch's lower-precision and float32 lists cast
   every floating-point argument; ops on neither list none: batch norm's float32 running
   statistics stay);
3. shardlab's implementation runs with autocast off, so its local ops compute in exactly
   those dtypes (gradients flow back through the casts, as on one device).

Composite calls that torch writes as several autocast ops (``multi_head_attention_forward``)
keep autocast on: each op inside follows the policy, as it does on one device.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_call"]

COMPOSITE = frozenset({"multi_head_attention_forward"})
_CACHE: dict = {}
_CACHE_SIZE = 4096  # signatures; the oldest goes first
_MISSING = object()


def autocast_call(name: str, original, handler, args, kwargs, device_type: str):
    """``handler(*args, **kwargs)`` for ``torch.nn.functional.<name>`` (``original``) under
    the caller's autocast state of ``device_type`` (steps 1-3 above)."""
    if not torch.is_autocast_enabled(device_type) or name in COMPOSITE:
        return handler(*args, **kwargs)
    casts = _casts(name, original, args, kwargs, device_type)
    if casts:
        n = len(args)
        args = [_cast(a, casts.get(i)) for i, a in enumerate(args)]
        kwargs = {k: _cast(v, casts.get(n + j)) for j, (k, v) in enumerate(kwargs.items())}
    with torch.autocast(device_type, enabled=False):
        return handler(*args, **kwargs)


def _cast(a, dtype):
    return a if dtype is None else a.to(dtype)


def _casts(name, original, args, kwargs, device_type) -> dict:
    """{argument position: dtype}: the arguments autocast casts in this call (cached)."""
    dtype = torch.get_autocast_dtype(device_type)
    key = _key(name, args, kwargs, device_type, dtype)
    hit = _CACHE.get(key, _MISSING) if key is not None else _MISSING
    if hit is not _MISSING:
        return hit
    casts = _probe(original, args, kwargs, device_type)
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = casts
    return casts


def _probe(original, args, kwargs, device_type) -> dict:
    """Run ``original`` on fake tensors of the arguments' global shapes under the active
    autocast and watch which of them autocast casts (its ``_to_copy`` of an argument, seen
    below autocast by a dispatch mode). Torch refusing the arguments: no casts (the real
    call says why)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    positions: dict = {}  # id(fake argument) -> position
    casts: dict = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            kw = kw or {}
            if func is torch.ops.aten._to_copy.default and id(a[0]) in positions:
                to = kw.get("dtype")
                if to is not None and to != a[0].dtype:
                    casts.setdefault(positions[id(a[0])], to)
            return func(*a, **kw)

    try:
        with FakeTensorMode(), torch.no_grad():
            values = []
            for i, a in enumerate((*args, *kwargs.values())):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    a = torch.empty(tuple(a.shape), dtype=a.dtype, device=device_type)
                    positions[id(a)] = i
                elif isinstance(a, torch.Tensor):
                    a = torch.empty(tuple(a.shape), dtype=a.dtype, device=device_type)
                values.append(a)
            n = len(args)
            with Watch():
                original(*values[:n], **dict(zip(kwargs, values[n:])))
    except Exception:
        return {}
    return casts


def _key(name, args, kwargs, device_type, dtype):
    """What the probe depends on: tensors by (shape, dtype), everything else by value;
    None when an argument cannot be part of a key (then the probe is not cached)."""
    try:
        key = (name, device_type, dtype, _freeze(args), _freeze(sorted(kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _freeze(a):
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_freeze(x) for x in a))
    if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return a
    raise TypeError(f"unhashable argument {type(a).__name__}")
