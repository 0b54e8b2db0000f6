"""Live tensor memory on any device, CPU included: :class:`LiveBytes`.

CPU has no allocator statistics; a dispatch mode sees every tensor an op creates and a
``weakref.finalize`` sees it freed. Used by ``shardlab.explain`` (the memory column),
the demos and the benchmarks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the block that are alive at once.

    Sees every op torch runs (forward and backward, ShardTensor ops as their local ops);
    an output whose storage is new counts its bytes until its last tensor is freed.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [tensors alive, bytes]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):  # the subclasses among the arguments
            return NotImplemented  # let ShardTensor run its local ops (seen here) first
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in inputs}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor or not t.untyped_storage().data_ptr():
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.live:
                if ptr in known:
                    continue  # a view of, or written into, a tensor made before the block
                self.live[ptr] = [0, t.untyped_storage().nbytes()]
                self.now += self.live[ptr][1]
                self.peak = max(self.peak, self.now)
            self.live[ptr][0] += 1
            weakref.finalize(t, self._drop, ptr)
        return out

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.now -= entry[1]
                del self.live[ptr]
