"""``StateBytes``: live bytes that follow FSDP2's storage resizes, and the model states
sorted by storage (no ranks)."""

from __future__ import annotations

import torch

from shardlab.zero.memory import StateBytes, state_bytes


def test_a_resized_storage_moves_the_count():
    with StateBytes() as mem:
        buf = torch.empty(1000)  # 4000 bytes
        buf.untyped_storage().resize_(0)  # FSDP2 frees an unsharded parameter so
        assert mem.now == 0 and mem.peak == 4000
        buf.untyped_storage().resize_(4000)  # ... and allocates it again before use
        mem.reset_peak()
        extra = torch.ones(500)  # 2000 bytes on top
        assert (mem.now, mem.peak) == (6000, 6000)
        del buf  # freed at the size it has now
        assert mem.now == 2000
    assert "resize_" not in torch.UntypedStorage.__dict__  # the C method again
    assert extra.sum() == 500


def test_views_count_once_and_each_state_once():
    lin = torch.nn.Linear(10, 10)  # 110 parameters: 440 bytes
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 10)).sum().backward()
    opt.step()  # two moments per parameter (880 bytes) and a 4-byte step count per tensor
    assert state_bytes(lin, opt) == {"params": 440, "grads": 440, "optim": 880 + 8}
