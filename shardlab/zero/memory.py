"""Live bytes that follow a storage's resizes: what FSDP2 needs counted.

:class:`shardlab.trace.LiveBytes <shardlab.trace.memory.LiveBytes>` sees a storage when an
op makes it and when it is freed. FSDP2 frees an unsharded parameter another way: it
keeps the storage and resizes it to 0 bytes after use (``storage.resize_(0)``), and back
to its size before the next all-gather; no op runs, so a dispatch mode never sees it.
:class:`StateBytes` also wraps ``UntypedStorage.resize_`` while it is open (restored on
exit) and moves its count by each resize of a storage it follows.

It also sorts what is alive into the three model states (:func:`state_bytes`): the
bytes of the distinct storages under the parameters, their gradients and the optimizer's
state.
"""

from __future__ import annotations

import weakref

import torch

from shardlab.trace.memory import LiveBytes

__all__ = ["StateBytes", "local", "state_bytes", "state_tensors", "storage_bytes"]


class StateBytes(LiveBytes):
    """``with StateBytes() as mem:`` counts every storage made inside the block that is
    still alive (``mem.now``, bytes) and the highest count (``mem.peak``), at each storage's
    current size. ``mem.reset_peak()`` starts a new peak from ``now``."""

    def __enter__(self):
        counter = self
        original = torch.UntypedStorage.__dict__.get("resize_")  # None: the C method

        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = torch._C.StorageBase.resize_(storage, nbytes)
            counter._resized(storage, before, storage.nbytes())
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._original_resize is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._original_resize

    def reset_peak(self) -> None:
        self.peak = self.now

    def follow(self, tensors) -> None:
        """Count the storages of ``tensors`` it does not follow yet (at their size now):
        ``torch.tensor(...)`` makes its storage out of the dispatcher's sight (Adam's step
        counts)."""
        for t in tensors:
            s = local(t).untyped_storage()
            key, nbytes = id(s), s.nbytes()
            if key not in self.live and nbytes:
                self.live[key] = (weakref.ref(s, self._dropper(key, nbytes)), nbytes)
                self.now += nbytes
                self.peak = max(self.peak, self.now)

    def _resized(self, storage, before: int, after: int) -> None:
        key = id(storage)
        entry = self.live.get(key)
        if entry is None:
            return  # made before the block: not followed
        self.live[key] = (entry[0], after)
        self.now += after - before
        self.peak = max(self.peak, self.now)

    def _dropper(self, key: int, nbytes: int):
        def drop(_ref):  # the size the storage has now, not the one it was made with
            entry = self.live.pop(key, None)
            if entry is not None:
                self.now -= entry[1]

        return drop


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients are DTensors); a plain
    tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view counts its whole storage,
    once); ``seen`` (storage pointers) carries over between calls, so that a storage
    already counted under one name is not counted again under another."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def state_tensors(optimizer):
    """The tensors of an optimizer's state (``ZeroRedundancyOptimizer`` keeps them in its
    local optimizer, ``.optim``)."""
    inner = getattr(optimizer, "optim", optimizer)
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optim"}``: bytes of the storages this rank holds under the
    parameters of ``module``, their ``.grad`` and ``optimizer``'s state (each storage
    counted once, under the first of those names it appears in)."""
    seen: set = set()
    params = list(module.parameters())
    return {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes([p.grad for p in params], seen),
        "optim": storage_bytes(state_tensors(optimizer), seen),
    }
