"""What ``shardlab.explain`` reads of memory: live bytes now and their peak."""

from __future__ import annotations

import torch

__all__ = ["_Memory"]


class _Memory:
    """Live tensor bytes now: the CUDA allocator's statistics, or on CPU a
    :class:`LiveBytes` dispatch mode (it sees every op: the costly part of ``explain``
    on CPU, so there only with ``memory=True``)."""

    def __init__(self, device):
        from shardlab.trace.memory import LiveBytes

        self.cuda = device.type == "cuda"
        self.count = None if self.cuda else LiveBytes()

    def __enter__(self):
        if self.count is not None:
            self.count.__enter__()

    def __exit__(self, *exc):
        if self.count is not None:
            self.count.__exit__(*exc)

    def reset_peak(self) -> int:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        self.count.peak = self.count.now
        return self.count.now

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else self.count.peak
