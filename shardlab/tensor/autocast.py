"""``torch.autocast`` for the calls shardlab takes over above torch's dispatcher.

torch applies autocast per aten op, in its dispatcher: a ShardTensor's aten ops
(``x @ w``, ``F.linear``, ``softmax`` …) pass through it and follow the policy on their
own. The ``torch.nn.functional`` calls that shardlab routes to its own sharded code
(halo convolutions, ring attention, norms with all-reduces, losses …) never reach it with
the user's arguments, so they apply the policy here, as one device would::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.conv2d(x, w)          # one device: x, w cast to bfloat16, a bfloat16 result
        F.cross_entropy(z, t)   # one device: z cast to float32, a float32 result

1. ask torch what the call does under the active autocast: the *original* function on
   fake tensors of the global shapes and dtypes (no data, no messages), with autocast and
   without; cached per signature (a few hundred microseconds the first time);
2. where autocast changes the result's dtype, every floating-point tensor argument is
   cast to it (torch's rule for its lower-precision and float32 lists); otherwise the
   arguments stay as they are (batch norm's float32 running statistics too);
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
    target = _target_dtype(name, original, args, kwargs, device_type)
    if target is not None:
        args = [_cast(a, target) for a in args]
        kwargs = {k: _cast(v, target) for k, v in kwargs.items()}
    with torch.autocast(device_type, enabled=False):
        return handler(*args, **kwargs)


def _cast(a, dtype):
    if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype:
        return a.to(dtype)
    return a


def _target_dtype(name, original, args, kwargs, device_type):
    """The dtype autocast makes the call's result, or None when it changes nothing."""
    dtype = torch.get_autocast_dtype(device_type)
    key = _key(name, args, kwargs, device_type, dtype)
    hit = _CACHE.get(key, _MISSING) if key is not None else _MISSING
    if hit is not _MISSING:
        return hit
    on = _probe(original, args, kwargs, device_type, autocast=True)
    off = _probe(original, args, kwargs, device_type, autocast=False)
    target = on if on is not None and on != off else None
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = target
    return target


def _probe(original, args, kwargs, device_type, autocast: bool):
    """The dtype of the first floating-point result of ``original`` on fake tensors of the
    arguments' global shapes (None: it raises, or returns no floating-point tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(a):
        if isinstance(a, torch.Tensor):
            return torch.empty(tuple(a.shape), dtype=a.dtype, device=device_type)
        if isinstance(a, (list, tuple)):
            return type(a)(fake(x) for x in a)
        return a

    try:
        with FakeTensorMode(), torch.no_grad():
            with torch.autocast(device_type, enabled=autocast):
                out = original(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})
    except Exception:
        return None  # torch refuses these arguments: the real call will say so
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


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
