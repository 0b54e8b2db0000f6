"""Live tensor memory on any device, CPU included: :class:`LiveBytes`.

CPU has no allocator statistics; a dispatch mode sees every tensor an op creates, and a
weak reference to its storage sees the storage freed (torch keeps one Python object per
storage, so one reference per storage suffices). Used by ``shardlab.explain`` (the memory
column on CPU), the demos and the benchmarks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "LiveCount"]

_ALIASES: dict = {}  # OpOverload -> whether an output may share an input's storage
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types whose storage an op may alias


def _may_alias(func) -> bool:
    alias = _ALIASES.get(func)
    if alias is None:
        alias = _ALIASES[func] = any(r.alias_info is not None for r in func._schema.returns)
    return alias


class LiveCount:
    """Bytes of the storages made since it was created that are still alive: ``now``,
    and the highest ``now`` seen: ``peak``. ``see(func, args, kwargs, out)`` after each op.

    A storage counts once however many tensors view it; outputs of views and in-place
    ops that land in a storage made before (an input's) are not counted.
    """

    def __init__(self):
        self.live: dict[int, tuple] = {}  # id(storage) -> (weakref, bytes)
        self.now = self.peak = 0

    def see(self, func, args, kwargs, out) -> None:
        outs = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
        known = None
        for t in outs:
            if type(t) is not torch.Tensor:
                continue
            s = t.untyped_storage()
            key = id(s)
            if key in self.live or not s.data_ptr():
                continue
            if _may_alias(func):  # a view of, or written into, a tensor made before
                if known is None:
                    known = {  # a parameter's view (``w.t()`` in a linear) is no new storage
                        id(a.untyped_storage())
                        for a in tree_leaves((args, kwargs))
                        if type(a) in _PLAIN
                    }
                if key in known:
                    continue
            nbytes = s.nbytes()
            self.live[key] = (weakref.ref(s, self._dropper(key, nbytes)), nbytes)
            self.now += nbytes
            if self.now > self.peak:
                self.peak = self.now

    def _dropper(self, key: int, nbytes: int):
        def drop(_ref):
            if self.live.pop(key, None) is not None:
                self.now -= nbytes

        return drop


class LiveBytes(TorchDispatchMode, LiveCount):
    """Peak bytes of the tensor storages created inside the block that are alive at once
    (``now``, ``peak``): a :class:`LiveCount` that watches every op torch runs (forward and
    backward, ShardTensor ops as their local ops)."""

    def __init__(self):
        TorchDispatchMode.__init__(self)
        LiveCount.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        for t in types:  # the subclasses among the arguments
            if t is not torch.Tensor and issubclass(t, DTensor):
                return NotImplemented  # let ShardTensor run its local ops (seen here) first
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.see(func, args, kwargs, out)
        return out
